// The BPE model of tokenizer.json: a word (one pre-token) to token ids.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace shardtrain::data::detail {

/// Merges are applied lowest rank first, leftmost first among equal ranks
/// (as Hugging Face tokenizers and transformers.js do). Results of words
/// shorter than kCacheMaxWordBytes are cached per thread, up to
/// kCacheEntries words per thread and model.
class BpeModel {
 public:
  static constexpr size_t kCacheMaxWordBytes = 256;
  static constexpr size_t kCacheEntries = 1 << 16;

  /// `model` is tokenizer.json's "model" object (type BPE); `what` names the
  /// file for messages. Every id must be an integer in [0, 2^31 - 1)
  /// (read_token_id) and at least one token must be non-empty: ConfigError
  /// otherwise. How far apart the ids may lie is the caller's bound
  /// (tokenizer_hf.cpp), which also counts the added tokens.
  BpeModel(const nlohmann::json& model, const std::string& what);

  /// Appends the ids of `word` to `out`.
  void encode_word(std::string_view word, std::vector<int32_t>& out) const;

  std::optional<int32_t> token_to_id(std::string_view token) const;
  /// The token of `id`, nullptr when the model has none.
  const std::string* id_to_token(int32_t id) const;
  /// Largest id + 1.
  int32_t size() const { return max_id_ + 1; }
  /// How many different ids the vocabulary defines.
  size_t distinct_ids() const { return by_id_.size(); }

 private:
  struct Merge {
    int32_t rank;
    int32_t id;
  };
  static uint64_t pair_key(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }
  void merge_word(std::string_view word, std::vector<int32_t>& out) const;
  void add_merge(const std::string& a, const std::string& b, int32_t rank);

  std::unordered_map<std::string, int32_t> vocab_;
  // id -> its token (a key of vocab_): a map, so that nothing is allocated
  // by the value of an id before the caller has bounded them.
  std::unordered_map<int32_t, const std::string*> by_id_;
  int32_t max_id_ = -1;
  std::unordered_map<uint64_t, Merge> merges_;
  std::optional<int32_t> unk_id_;
  bool fuse_unk_ = false;
  bool byte_fallback_ = false;
  bool ignore_merges_ = false;
  std::string prefix_;  // continuing_subword_prefix
  std::string suffix_;  // end_of_word_suffix
  int32_t byte_ids_[256];  // "<0xAB>" ids, -1 when absent
  uint64_t serial_;        // tells the per-thread caches apart
};

/// The id `v` of `entry` of the file `what` ("model.vocab 'abc'",
/// "added_tokens[3]"): an integer in [0, kMaxTokenId]; anything else (a
/// negative id, a float, 2^31 and beyond) is a ConfigError naming both.
int32_t read_token_id(const nlohmann::json& v, const std::string& what, const std::string& entry);
/// The largest id a token may have (2^31 - 2): vocab_size, max id + 1, still
/// fits an int32.
constexpr int32_t kMaxTokenId = 2147483646;

}  // namespace shardtrain::data::detail
