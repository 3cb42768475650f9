// A SentencePiece tokenizer.model, through libsentencepiece. Control pieces
// written in the text (<s>, </s>) are matched as tokens, like the added
// tokens of a tokenizer.json; the text between them goes to SentencePiece.
//
// Why a module of its own: Debian's libsentencepiece carries its own copy of
// protobuf-lite and exports its symbols, which clash with the libprotobuf
// that LibTorch and our TensorBoard writer use (whichever loads first serves
// the other's calls: a crash at start-up or a silent version mix). This file
// is built as libshardtrain_sentencepiece.so, the one thing that links
// libsentencepiece, and load_tokenizer dlopens it with RTLD_LOCAL |
// RTLD_DEEPBIND, so libsentencepiece resolves protobuf to its own copy and
// nothing else ever sees that copy (src/data/tokenizer.cpp).
#include <sentencepiece_processor.h>

#include <algorithm>

#include "data/tokenizer_kinds.h"  // the helpers it shares, from libshardtrain
#include "data/tokenizer_text.h"
#include "shardtrain/core/error.h"

namespace shardtrain::data::detail {

namespace {

class SentencePieceTokenizer : public Tokenizer {
 public:
  SentencePieceTokenizer(const std::string& path, const std::string& bytes) : path_(path) {
    const auto status = sp_.LoadFromSerializedProto(bytes);
    ST_CHECK(status.ok(), ConfigError, path, " is not a SentencePiece model: ", status.ToString(),
             "; hint: point --tokenizer at a tokenizer.model or a tokenizer.json");
    digest_ = fnv1a(bytes);
    for (int id = 0; id < sp_.GetPieceSize(); ++id) {
      if (sp_.IsControl(id) && !sp_.IdToPiece(id).empty()) controls_.emplace_back(sp_.IdToPiece(id), id);
    }
    std::stable_sort(controls_.begin(), controls_.end(),
                     [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
  }

  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens) const override {
    std::string repaired;
    if (repair_utf8(text, repaired)) text = repaired;
    std::vector<int32_t> ids;
    // With special tokens: BOS only, Llama's convention for SentencePiece models.
    if (add_special_tokens && bos_id()) ids.push_back(*bos_id());
    size_t begin = 0;
    auto flush = [&](size_t end) {
      if (end <= begin) return;
      const std::vector<int> part = sp_.EncodeAsIds(std::string(text.substr(begin, end - begin)));
      ids.insert(ids.end(), part.begin(), part.end());
    };
    for (size_t i = 0; i < text.size();) {
      int found = -1;
      size_t len = 0;
      if (text[i] == '<' || text[i] == '[') {
        for (const auto& [piece, id] : controls_) {
          if (text.compare(i, piece.size(), piece) == 0) {
            found = id;
            len = piece.size();
            break;
          }
        }
      }
      if (found < 0) {
        ++i;
        continue;
      }
      flush(i);
      ids.push_back(found);
      begin = i = i + len;
    }
    flush(text.size());
    return ids;
  }

  std::string decode(const std::vector<int32_t>& ids, bool skip_special_tokens) const override {
    std::string out;
    std::vector<int> run;
    auto flush = [&] {
      if (!run.empty()) out += sp_.DecodeIds(run);
      run.clear();
    };
    for (size_t i = 0; i < ids.size(); ++i) {
      const int32_t id = ids[i];
      ST_CHECK(id >= 0 && id < sp_.GetPieceSize(), ConfigError, "decode: id ", id, " at position ", i,
               " is not in the vocabulary of ", path_, " (", sp_.GetPieceSize(),
               " ids); hint: the ids come from another tokenizer or a model with a larger vocab_size");
      if (sp_.IsControl(id)) {
        flush();
        if (!skip_special_tokens) out += sp_.IdToPiece(id);
      } else {
        run.push_back(id);
      }
    }
    flush();
    return out;
  }

  int64_t vocab_size() const override { return sp_.GetPieceSize(); }
  std::optional<int32_t> token_to_id(std::string_view token) const override {
    const int id = sp_.PieceToId(std::string(token));
    if (id < 0 || sp_.IdToPiece(id) != token) return std::nullopt;
    return id;
  }
  std::optional<int32_t> bos_id() const override {
    return sp_.bos_id() >= 0 ? std::optional<int32_t>(sp_.bos_id()) : std::nullopt;
  }
  std::optional<int32_t> eos_id() const override {
    return sp_.eos_id() >= 0 ? std::optional<int32_t>(sp_.eos_id()) : std::nullopt;
  }
  std::string kind() const override { return "sentencepiece"; }
  std::string fingerprint() const override { return fingerprint_hex(kind(), digest_); }

 private:
  std::string path_;
  sentencepiece::SentencePieceProcessor sp_;
  std::vector<std::pair<std::string, int>> controls_;  // longest first
  uint64_t digest_ = 0;
};

}  // namespace

}  // namespace shardtrain::data::detail

/// The module's entry point (dlsym'd by name): a tokenizer for the model
/// `bytes` read from `path`; ConfigError when it is not one.
extern "C" __attribute__((visibility("default"))) shardtrain::data::Tokenizer* shardtrain_make_sentencepiece_tokenizer(
    const std::string& path, const std::string& bytes) {
  return new shardtrain::data::detail::SentencePieceTokenizer(path, bytes);
}
