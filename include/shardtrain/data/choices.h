// The closed sets of values the data section chooses between, each with its
// one name table (core/enum_names.h); the names are the YAML values.
#pragma once

#include "shardtrain/core/enum_names.h"

namespace shardtrain::data {

/// How data.train is read. Auto: a `.jsonl` name is JSON lines, otherwise a
/// token file when it starts with the token-file magic, else text (today's
/// detection, so existing configs keep working).
enum class DataFormat { Auto, Tokens, Text, Jsonl };
ST_ENUM_NAMES(DataFormat, {DataFormat::Auto, "auto"}, {DataFormat::Tokens, "tokens"},
              {DataFormat::Text, "text"}, {DataFormat::Jsonl, "jsonl"});

/// The chat template that renders `messages` records. Auto: recognised from
/// the model directory's tokenizer_config.json.
enum class ChatTemplateKind { Auto, Llama3, Chatml, Qwen3, Mistral, Llama2 };
ST_ENUM_NAMES(ChatTemplateKind, {ChatTemplateKind::Auto, "auto"},
              {ChatTemplateKind::Llama3, "llama3"}, {ChatTemplateKind::Chatml, "chatml"},
              {ChatTemplateKind::Qwen3, "qwen3"}, {ChatTemplateKind::Mistral, "mistral"},
              {ChatTemplateKind::Llama2, "llama2"});

/// What happens to a sample longer than the block.
enum class Overlong { Truncate, Drop };
ST_ENUM_NAMES(Overlong, {Overlong::Truncate, "truncate"}, {Overlong::Drop, "drop"});

}  // namespace shardtrain::data
