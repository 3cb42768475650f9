// Tokenizers: text to token ids and back.
//
// One interface, three kinds behind it: bytes (one token per byte, the
// built-in GPT's vocabulary), a Hugging Face `tokenizer.json` (read by our own
// implementation: normalizers, pre-tokenizers, BPE, added tokens, the
// post-processor and the decoder), and a SentencePiece `tokenizer.model`
// (through libsentencepiece). Encoding is thread-safe on a const tokenizer.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace shardtrain::data {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  /// Token ids of `text`. With `add_special_tokens` the post-processor's
  /// tokens (e.g. BOS) are added as the model's own tokenizer would.
  /// Special tokens written inside `text` are matched as tokens.
  virtual std::vector<int32_t> encode(std::string_view text, bool add_special_tokens = false) const = 0;
  /// The text of `ids`; with `skip_special_tokens` special tokens are left out.
  /// An id outside the vocabulary is a ConfigError naming it.
  virtual std::string decode(const std::vector<int32_t>& ids, bool skip_special_tokens = false) const = 0;
  /// Number of ids (the largest id + 1, added tokens included).
  virtual int64_t vocab_size() const = 0;
  /// The id of a token's exact text (e.g. "<|eot_id|>"), if it is one.
  virtual std::optional<int32_t> token_to_id(std::string_view token) const = 0;
  virtual std::optional<int32_t> bos_id() const = 0;
  virtual std::optional<int32_t> eos_id() const = 0;
  /// "bytes", "tokenizer.json" or "sentencepiece", for messages.
  virtual std::string kind() const = 0;
  /// A digest of everything that decides the ids (hex), for caches keyed by
  /// the tokenizer.
  virtual std::string fingerprint() const = 0;
};

/// The tokenizer that `spec` names: "bytes"; "auto" (model_dir's
/// tokenizer.json, else its tokenizer.model, else bytes); or a path to a
/// tokenizer.json, a tokenizer.model or a directory holding one. A missing or
/// unreadable file, or a tokenizer.json of a kind we do not implement, is a
/// ConfigError naming the file and what is supported.
std::shared_ptr<const Tokenizer> load_tokenizer(const std::string& spec, const std::string& model_dir = "");

/// The files of the tokenizer that load_tokenizer(spec, model_dir) reads:
/// its tokenizer.json or tokenizer.model, with the tokenizer_config.json and
/// special_tokens_map.json beside it when present (a model directory's
/// tokenizer, to ship with an exported model); none for bytes.
std::vector<std::string> tokenizer_files(const std::string& spec, const std::string& model_dir = "");

}  // namespace shardtrain::data
