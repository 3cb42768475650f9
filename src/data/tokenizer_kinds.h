// The kinds of tokenizer behind load_tokenizer (internal to src/data).
#pragma once

#include <memory>
#include <string>

#include "shardtrain/data/tokenizer.h"

namespace shardtrain::data::detail {

/// One token per byte (ids 0..255), no special tokens.
std::shared_ptr<const Tokenizer> make_byte_tokenizer();
/// A Hugging Face tokenizer.json, with tokenizer_config.json beside it when present.
std::shared_ptr<const Tokenizer> load_hf_tokenizer(const std::string& path);
/// A SentencePiece tokenizer.model.
std::shared_ptr<const Tokenizer> load_sentencepiece_tokenizer(const std::string& path);

/// The whole file as a string; ConfigError naming it when it cannot be read.
std::string read_tokenizer_file(const std::string& path);
/// 64-bit FNV-1a of `data` continuing from `h`, as hex by fingerprint_hex.
uint64_t fnv1a(const std::string& data, uint64_t h = 1469598103934665603ULL);
std::string fingerprint_hex(const std::string& kind, uint64_t h);

}  // namespace shardtrain::data::detail
