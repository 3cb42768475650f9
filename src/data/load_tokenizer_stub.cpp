// STUB until the tokenizer branch is merged: load_tokenizer knows only
// "bytes" here. The tokenizer branch defines the real load_tokenizer (bytes,
// tokenizer.json, SentencePiece); delete this file when merging it.
#include "shardtrain/core/error.h"
#include "shardtrain/data/tokenizer.h"

namespace shardtrain::data {

namespace {

class BytesStub final : public Tokenizer {
 public:
  std::vector<int32_t> encode(std::string_view text, bool) const override {
    std::vector<int32_t> ids;
    for (unsigned char c : text) ids.push_back(c);
    return ids;
  }
  std::string decode(const std::vector<int32_t>& ids, bool) const override {
    std::string s;
    for (int32_t id : ids) {
      ST_CHECK(id >= 0 && id < 256, ConfigError, "byte tokenizer: id ", id, " is not a byte");
      s.push_back(static_cast<char>(id));
    }
    return s;
  }
  int64_t vocab_size() const override { return 256; }
  std::optional<int32_t> token_to_id(std::string_view) const override { return std::nullopt; }
  std::optional<int32_t> bos_id() const override { return std::nullopt; }
  std::optional<int32_t> eos_id() const override { return std::nullopt; }
  std::string kind() const override { return "bytes"; }
  std::string fingerprint() const override { return "bytes"; }
};

}  // namespace

std::shared_ptr<const Tokenizer> load_tokenizer(const std::string& spec, const std::string&) {
  ST_CHECK(spec == "bytes", ConfigError, "data.tokenizer '", spec,
           "' needs the tokenizer branch (not merged here); this build knows only 'bytes'");
  return std::make_shared<BytesStub>();
}

}  // namespace shardtrain::data
