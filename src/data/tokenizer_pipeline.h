// The stages of a Hugging Face tokenizer.json around its model: normalizers,
// pre-tokenizers and decoders, each built once from its JSON object. Every
// stage is immutable after construction and safe to run from many threads.
//
// Supported (the `type` field):
//   normalizers     Sequence, Prepend, Replace, NFC, NFKC, NFD, NFKD,
//                   Lowercase, Strip
//   pre-tokenizers  Sequence, ByteLevel, Split, Metaspace, Digits,
//                   Whitespace, WhitespaceSplit
//   decoders        Sequence, ByteLevel, ByteFallback, Fuse, Strip, Replace,
//                   Metaspace
// Anything else is a ConfigError that names the type and this list.
#pragma once

#include <nlohmann/json.hpp>

#include <memory>
#include <string>
#include <vector>

namespace shardtrain::data::detail {

class Normalizer {
 public:
  virtual ~Normalizer() = default;
  virtual void normalize(std::string& text) const = 0;
};

/// A piece of text on its way to the model. `at_start`: the piece begins at
/// offset 0 of the input (Metaspace's prepend_scheme "first").
struct PreToken {
  std::string text;
  bool at_start = false;
};

class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  /// Replaces `pieces` by their splits (in order).
  virtual void pre_tokenize(std::vector<PreToken>& pieces) const = 0;
};

/// A token on its way back to text; `added`: an added token's content
/// (ByteLevel leaves those as they are).
struct DecodePiece {
  std::string text;
  bool added = false;
};

class Decoder {
 public:
  virtual ~Decoder() = default;
  virtual void decode(std::vector<DecodePiece>& pieces) const = 0;
};

/// `what` names the file for messages. A null JSON value gives nullptr.
std::unique_ptr<Normalizer> make_normalizer(const nlohmann::json& j, const std::string& what);
std::unique_ptr<PreTokenizer> make_pre_tokenizer(const nlohmann::json& j, const std::string& what);
std::unique_ptr<Decoder> make_decoder(const nlohmann::json& j, const std::string& what);

}  // namespace shardtrain::data::detail
