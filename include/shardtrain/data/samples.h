// Samples: records tokenized once, with the tokens whose prediction is
// trained marked, cached beside the data.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "shardtrain/data/choices.h"
#include "shardtrain/data/jsonl.h"
#include "shardtrain/data/tokenizer.h"

namespace shardtrain::data {

/// One tokenized example. `trained[i]` says whether predicting ids[i] (the
/// target of position i-1) counts in the loss; trained[0] is never used.
struct Sample {
  std::vector<int32_t> ids;
  std::vector<uint8_t> trained;
};

struct SampleOptions {
  /// Resolved; Auto when none could be (a dataset without chat records
  /// needs none): a chat record is then a ConfigError saying `no_template`.
  ChatTemplateKind chat_template = ChatTemplateKind::Llama3;
  std::string no_template;
  bool train_on_inputs = false;  // true: prompt, system and user tokens count too
};

/// Tokenizes one record: text is BOS? + text + EOS?, all trained;
/// prompt/completion is BOS? + prompt (masked) + completion + EOS? (trained);
/// chat is the template's pieces, each encoded on its own (special-token
/// text inside a piece becomes its single id). BOS/EOS are added only when
/// the tokenizer has them.
Sample tokenize_record(const Record& record, const Tokenizer& tokenizer, const SampleOptions& options);

/// Every record of the JSON-lines file `path`, tokenized; read from the cache
/// file `cache_path(path, ...)` when it matches, else tokenized and the cache
/// written atomically (every rank does the same deterministic work, so any
/// rank may write it; the rename makes concurrent writers safe). A cache that
/// cannot be written (read-only directory) is skipped. The cache ends with
/// the SHA-256 of its content: one that fails it (edited in place), or that
/// is not a regular file (a FIFO, a link to a device), is never trusted: it
/// is rebuilt, with one line on stderr saying so.
std::vector<Sample> load_samples(const std::string& path, const Tokenizer& tokenizer,
                                 const SampleOptions& options);

/// Where load_samples caches `path`: beside it, named by a digest of the
/// tokenizer's fingerprint, the options and the SHA-256 of the file's content
/// (not its size and mtime, which an edit can keep). Reads the whole file.
std::string samples_cache_path(const std::string& path, const Tokenizer& tokenizer,
                               const SampleOptions& options);

}  // namespace shardtrain::data
