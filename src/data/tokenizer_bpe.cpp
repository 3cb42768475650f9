// BPE: characters to ids, then merges by rank with a heap (O(n log n) per
// word, so a model without a pre-tokenizer, where a word is a whole text,
// stays fast), with a per-thread cache of whole words.
#include "data/tokenizer_bpe.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <functional>

#include "data/tokenizer_text.h"
#include "shardtrain/core/error.h"

namespace shardtrain::data::detail {

namespace {

using nlohmann::json;

std::atomic<uint64_t> next_serial{1};

// One thread's results per model (keyed by the model's serial number).
struct WordCache {
  std::unordered_map<std::string, std::vector<int32_t>> words;
};

WordCache& thread_cache(uint64_t serial) {
  thread_local std::unordered_map<uint64_t, WordCache> caches;
  // Models come and go (tests load many); keep a thread's caches few.
  if (caches.size() > 8 && caches.find(serial) == caches.end()) caches.clear();
  return caches[serial];
}

struct Symbol {
  int32_t id;
  int32_t prev;
  int32_t next;
  bool alive;
};

struct Candidate {
  int32_t rank;
  int32_t pos;  // the left symbol; its index is its original position
  int32_t id;   // the merged token
  bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
};

}  // namespace

BpeModel::BpeModel(const json& model, const std::string& what) : serial_(next_serial++) {
  const auto null_or = [&](const char* key, std::string fallback) {
    return model.contains(key) && model.at(key).is_string() ? model.at(key).get<std::string>() : fallback;
  };
  prefix_ = null_or("continuing_subword_prefix", "");
  suffix_ = null_or("end_of_word_suffix", "");
  fuse_unk_ = model.value("fuse_unk", false);
  byte_fallback_ = model.value("byte_fallback", false);
  ignore_merges_ = model.value("ignore_merges", false);
  ST_CHECK(!(model.contains("dropout") && model.at("dropout").is_number() && model.at("dropout").get<double>() > 0),
           ConfigError, what, ": BPE dropout is not supported (ids would be random)",
           "; hint: set model.dropout to null for training data");

  const json& vocab = model.at("vocab");
  ST_CHECK(vocab.is_object(), ConfigError, what, ": model.vocab of a BPE model must be an object",
           "; hint: the tokenizer.json is malformed");
  vocab_.reserve(vocab.size());
  by_id_.reserve(vocab.size());
  bool usable = false;
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    const int32_t id = read_token_id(it.value(), what, "model.vocab '" + shorten(it.key()) + "'");
    const auto [entry, added] = vocab_.emplace(it.key(), id);
    if (!added) continue;
    by_id_.emplace(id, &entry->first);  // two tokens with one id: the first (in key order) decodes
    max_id_ = std::max(max_id_, id);
    usable = usable || !it.key().empty();
  }
  // Without a token every character would be dropped, silently.
  ST_CHECK(usable, ConfigError, what, ": model.vocab holds no token (", vocab.size(),
           " entries, none a non-empty string), so every character of the text would be dropped",
           "; hint: the tokenizer.json is damaged or not a BPE model's; re-download it");
  const std::string unk = null_or("unk_token", "");
  if (!unk.empty()) unk_id_ = token_to_id(unk);

  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    byte_ids_[b] = token_to_id(name).value_or(-1);
  }

  // Merges: "a b" strings (older files) or ["a", "b"] pairs.
  const json& merges = model.at("merges");
  merges_.reserve(merges.size());
  int32_t rank = 0;
  for (const auto& m : merges) {
    if (m.is_string()) {
      const std::string s = m.get<std::string>();
      const size_t space = s.find(' ');
      ST_CHECK(space != std::string::npos, ConfigError, what, ": merge ", rank, " '", s,
               "' is not two tokens separated by a space; hint: the tokenizer.json is malformed");
      add_merge(s.substr(0, space), s.substr(space + 1), rank);
    } else {
      ST_CHECK(m.is_array() && m.size() == 2, ConfigError, what, ": merge ", rank,
               " is neither \"a b\" nor [\"a\", \"b\"]; hint: the tokenizer.json is malformed");
      add_merge(m[0].get<std::string>(), m[1].get<std::string>(), rank);
    }
    ++rank;
  }
}

void BpeModel::add_merge(const std::string& a, const std::string& b, int32_t rank) {
  const auto ia = token_to_id(a);
  const auto ib = token_to_id(b);
  const std::string joined = a + (b.compare(0, prefix_.size(), prefix_) == 0 ? b.substr(prefix_.size()) : b);
  const auto ij = token_to_id(joined);
  // A merge whose parts or result are not in the vocabulary can never apply.
  if (!ia || !ib || !ij) return;
  merges_.emplace(pair_key(*ia, *ib), Merge{rank, *ij});  // the first (lowest) rank wins
}

std::optional<int32_t> BpeModel::token_to_id(std::string_view token) const {
  thread_local std::string key;
  key.assign(token.data(), token.size());
  const auto it = vocab_.find(key);
  if (it == vocab_.end()) return std::nullopt;
  return it->second;
}

const std::string* BpeModel::id_to_token(int32_t id) const {
  const auto it = by_id_.find(id);
  return it == by_id_.end() ? nullptr : it->second;
}

int32_t read_token_id(const json& v, const std::string& what, const std::string& entry) {
  // An id is an index into the model's embedding: a float, a negative id or
  // one past the int32 range would wrap or index outside it.
  const bool integer = v.is_number_integer();
  const bool in_range = integer && (v.is_number_unsigned() ? v.get<uint64_t>() <= uint64_t{kMaxTokenId}
                                                           : v.get<int64_t>() >= 0 && v.get<int64_t>() <= kMaxTokenId);
  ST_CHECK(in_range, ConfigError, what, ": ", entry, " has the id ", v.dump(), ", not an integer in 0..", kMaxTokenId,
           "; hint: the tokenizer.json is damaged or hostile; re-download the model's tokenizer.json");
  return static_cast<int32_t>(v.get<int64_t>());
}

void BpeModel::encode_word(std::string_view word, std::vector<int32_t>& out) const {
  if (word.empty()) return;
  if (ignore_merges_) {
    // Llama-3: a word that is itself a token is that token, whatever the merges say.
    if (const auto id = token_to_id(word)) {
      out.push_back(*id);
      return;
    }
  }
  if (word.size() >= kCacheMaxWordBytes) {
    merge_word(word, out);
    return;
  }
  WordCache& cache = thread_cache(serial_);
  thread_local std::string key;
  key.assign(word.data(), word.size());
  const auto hit = cache.words.find(key);
  if (hit != cache.words.end()) {
    out.insert(out.end(), hit->second.begin(), hit->second.end());
    return;
  }
  const size_t first = out.size();
  merge_word(word, out);
  if (cache.words.size() >= kCacheEntries) cache.words.clear();
  cache.words.emplace(key, std::vector<int32_t>(out.begin() + static_cast<std::ptrdiff_t>(first), out.end()));
}

void BpeModel::merge_word(std::string_view word, std::vector<int32_t>& out) const {
  thread_local std::vector<Symbol> symbols;
  thread_local std::string piece;
  symbols.clear();

  // ---- characters to symbols: the vocabulary, else bytes, else unk.
  bool last_unk = false;
  for (size_t i = 0; i < word.size();) {
    const size_t begin = i;
    i += std::min<size_t>(utf8_length(static_cast<unsigned char>(word[i])), word.size() - i);
    piece.clear();
    if (begin > 0) piece += prefix_;
    piece.append(word.data() + begin, i - begin);
    if (i == word.size()) piece += suffix_;
    const auto push = [&](int32_t id) {
      symbols.push_back(Symbol{id, static_cast<int32_t>(symbols.size()) - 1, static_cast<int32_t>(symbols.size()) + 1, true});
    };
    if (const auto id = token_to_id(piece)) {
      push(*id);
      last_unk = false;
      continue;
    }
    if (byte_fallback_) {
      bool all = true;
      for (size_t k = begin; k < i; ++k) all = all && byte_ids_[static_cast<unsigned char>(word[k])] >= 0;
      if (all) {
        for (size_t k = begin; k < i; ++k) push(byte_ids_[static_cast<unsigned char>(word[k])]);
        last_unk = false;
        continue;
      }
    }
    if (unk_id_) {
      if (!(fuse_unk_ && last_unk)) push(*unk_id_);
      last_unk = true;
    }
    // Without an unk token an unknown character is dropped (Hugging Face
    // fails the whole encode there); byte-level vocabularies never get here.
  }
  if (symbols.empty()) return;
  symbols.back().next = -1;

  // ---- merges, lowest rank first, leftmost first among equal ranks.
  // A min-heap on a per-thread vector: no allocation per word.
  thread_local std::vector<Candidate> heap;
  heap.clear();
  const auto later = std::greater<Candidate>();
  const auto consider = [&](int32_t pos) {
    if (pos < 0) return;
    const int32_t next = symbols[static_cast<size_t>(pos)].next;
    if (next < 0) return;
    const auto it = merges_.find(pair_key(symbols[static_cast<size_t>(pos)].id, symbols[static_cast<size_t>(next)].id));
    if (it == merges_.end()) return;
    heap.push_back(Candidate{it->second.rank, pos, it->second.id});
    std::push_heap(heap.begin(), heap.end(), later);
  };
  for (int32_t p = 0; p + 1 < static_cast<int32_t>(symbols.size()); ++p) consider(p);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), later);
    const Candidate c = heap.back();
    heap.pop_back();
    Symbol& left = symbols[static_cast<size_t>(c.pos)];
    if (!left.alive || left.next < 0) continue;
    Symbol& right = symbols[static_cast<size_t>(left.next)];
    const auto it = merges_.find(pair_key(left.id, right.id));
    if (it == merges_.end() || it->second.id != c.id || it->second.rank != c.rank) continue;  // stale
    left.id = c.id;
    right.alive = false;
    left.next = right.next;
    if (left.next >= 0) symbols[static_cast<size_t>(left.next)].prev = c.pos;
    if (left.prev >= 0) consider(left.prev);
    consider(c.pos);
  }
  for (int32_t p = 0; p >= 0; p = symbols[static_cast<size_t>(p)].next) out.push_back(symbols[static_cast<size_t>(p)].id);
}

}  // namespace shardtrain::data::detail
