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
// Normalization is bounded (expansion_bound); a Metaspace replacement is one
// character, as in Hugging Face's own format.
#pragma once

#include <nlohmann/json.hpp>

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace shardtrain::data::detail {

/// How long normalization may make a document of `n` bytes: at most
/// kExpansionFactor times as long, plus kExpansionSlack bytes. Real
/// normalizers stay far below (NFKD at most about 11 times, on a document of
/// ligatures; Replace " " by "▁" 3 times); a hostile Replace that maps "a" to
/// 200,000 characters is refused instead of growing the text until the OOM
/// killer comes.
constexpr size_t kExpansionFactor = 16;
constexpr size_t kExpansionSlack = 4096;
inline size_t expansion_bound(size_t n) { return n * kExpansionFactor + kExpansionSlack; }

class Normalizer {
 public:
  virtual ~Normalizer() = default;
  /// Normalizes `text` in place. A normalizer whose result would be longer
  /// than `max_bytes` throws a ConfigError naming the file and itself, before
  /// it builds that result.
  virtual void normalize(std::string& text, size_t max_bytes) const = 0;
  /// The same within the bound of a document of `text`'s size.
  void normalize(std::string& text) const { normalize(text, expansion_bound(text.size())); }
};

/// A piece of text on its way to the model. `at_start`: the piece begins at
/// offset 0 of the input (Metaspace's prepend_scheme "first").
struct PreToken {
  std::string text;
  bool at_start = false;
};

/// Where a pre-tokenizer hands its pieces, one at a time, in order.
using PreTokenSink = std::function<void(PreToken&&)>;

class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  /// Cuts `piece` and hands each of its pieces to `emit` as soon as it is
  /// known, in order. Nothing is collected: a document of 50 MB on one line
  /// costs its own bytes and one piece at a time, not a vector of millions
  /// of strings.
  virtual void pre_tokenize(PreToken piece, const PreTokenSink& emit) const = 0;
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
