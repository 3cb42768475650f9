// A Hugging Face tokenizer.json, read by our own implementation.
//
// encode: added tokens are cut out of the raw text first (longest match at
// the leftmost position); every stretch between them is normalized, cut
// again at the added tokens marked `normalized`, pre-tokenized into words,
// and each word goes through the BPE model. With add_special_tokens the
// post-processor's template puts BOS/EOS around the result.
// decode: ids to token strings (added tokens as written), the decoder chain,
// then the pieces joined.
//
// Hostile files are refused at load (ConfigError naming the file and the
// entry): every id, of the model, an added token or the post-processor, is an
// integer in [0, 2 * (ids defined) + kIdSlack), so holes in the id space are
// bounded and nothing is sized by an id the file made up; a normalizer may
// grow a document only to expansion_bound(its size).
#include <sys/stat.h>
#include <utf8proc.h>

#include <algorithm>
#include <cerrno>
#include <unordered_map>

#include "core/file.h"
#include "core/json.h"
#include "data/tokenizer_bpe.h"
#include "data/tokenizer_kinds.h"
#include "data/tokenizer_pipeline.h"
#include "data/tokenizer_text.h"
#include "shardtrain/core/error.h"

namespace shardtrain::data::detail {

namespace {

using nlohmann::json;

// Ids may leave holes, but the largest id + 1 (the vocabulary size a model
// gets) is at most twice the number of ids the file defines plus this.
constexpr int64_t kIdSlack = 1024;
// tokenizer.json and tokenizer.model (the largest real ones are about 35 MB)
// and tokenizer_config.json.
constexpr long long kMaxTokenizerBytes = 1LL << 30;
constexpr long long kMaxTokenizerConfigBytes = 64LL << 20;

struct AddedToken {
  std::string content;
  std::string match;  // what is looked for: content, normalized when `normalized`
  int32_t id = 0;
  bool special = false;
  bool lstrip = false;
  bool rstrip = false;
  bool single_word = false;
  bool normalized = false;
};

// A stretch of text, or an added token (index >= 0) with the whitespace
// that its lstrip/rstrip swallowed.
struct Segment {
  size_t begin, end;
  int token;
};

bool is_word_char(uint32_t cp) {
  if (cp == '_') return true;
  const auto cat = utf8proc_category(static_cast<utf8proc_int32_t>(cp));
  return (cat >= UTF8PROC_CATEGORY_LU && cat <= UTF8PROC_CATEGORY_LO) ||
         (cat >= UTF8PROC_CATEGORY_ND && cat <= UTF8PROC_CATEGORY_NO) ||
         (cat >= UTF8PROC_CATEGORY_MN && cat <= UTF8PROC_CATEGORY_ME);
}

bool is_space_at(std::string_view s, size_t i, size_t& len) {
  size_t j = i;
  const uint32_t cp = next_code_point(s, j);
  len = j - i;
  return cp == ' ' || (cp >= 0x09 && cp <= 0x0D) || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}

// The last code point before byte `i` of `s` (s[..i] valid UTF-8).
uint32_t code_point_before(std::string_view s, size_t i) {
  size_t b = i - 1;
  while (b > 0 && (static_cast<unsigned char>(s[b]) & 0xC0) == 0x80) --b;
  return next_code_point(s, b);
}

// Finds added tokens in text: at each position the longest one that
// matches, scanning left to right (Aho-Corasick's leftmost-longest, as
// Hugging Face and transformers.js do).
class AddedTokenMatcher {
 public:
  AddedTokenMatcher(const std::vector<AddedToken>& all, bool normalized_ones) : all_(&all) {
    for (size_t i = 0; i < all.size(); ++i) {
      if (all[i].normalized != normalized_ones || all[i].match.empty()) continue;
      by_first_[static_cast<unsigned char>(all[i].match[0])].push_back(static_cast<int>(i));
      any_ = true;
    }
    for (auto& list : by_first_) {
      std::stable_sort(list.begin(), list.end(), [&](int a, int b) {
        return all[static_cast<size_t>(a)].match.size() > all[static_cast<size_t>(b)].match.size();
      });
    }
  }
  bool empty() const { return !any_; }

  void split(std::string_view s, std::vector<Segment>& out) const {
    out.clear();
    size_t text_begin = 0;
    for (size_t i = 0; i < s.size();) {
      const auto& candidates = by_first_[static_cast<unsigned char>(s[i])];
      int found = -1;
      for (const int c : candidates) {
        const AddedToken& t = (*all_)[static_cast<size_t>(c)];
        if (s.compare(i, t.match.size(), t.match) != 0) continue;
        if (t.single_word && !single_word_ok(s, i, i + t.match.size())) continue;
        found = c;
        break;
      }
      if (found < 0) {
        ++i;
        continue;
      }
      const AddedToken& t = (*all_)[static_cast<size_t>(found)];
      size_t begin = i, end = i + t.match.size();
      if (t.lstrip) {
        while (begin > text_begin) {
          size_t b = begin - 1;
          while (b > text_begin && (static_cast<unsigned char>(s[b]) & 0xC0) == 0x80) --b;
          size_t len = 0;
          if (!is_space_at(s, b, len)) break;
          begin = b;
        }
      }
      if (t.rstrip) {
        for (size_t len = 0; end < s.size() && is_space_at(s, end, len);) end += len;
      }
      if (begin > text_begin) out.push_back(Segment{text_begin, begin, -1});
      out.push_back(Segment{begin, end, found});
      text_begin = i = end;
    }
    if (text_begin < s.size()) out.push_back(Segment{text_begin, s.size(), -1});
  }

 private:
  static bool single_word_ok(std::string_view s, size_t begin, size_t end) {
    if (begin > 0 && is_word_char(code_point_before(s, begin))) return false;
    size_t j = end;
    if (end < s.size() && is_word_char(next_code_point(s, j))) return false;
    return true;
  }
  const std::vector<AddedToken>* all_;
  std::vector<int> by_first_[256];
  bool any_ = false;
};

// The single-sequence template: ids before and after the text.
struct PostProcessor {
  std::vector<int32_t> prefix;
  std::vector<int32_t> suffix;
};

class HfTokenizer : public Tokenizer {
 public:
  HfTokenizer(const std::string& path, const json& j, const json* config, uint64_t digest);

  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens) const override;
  std::string decode(const std::vector<int32_t>& ids, bool skip_special_tokens) const override;
  int64_t vocab_size() const override { return vocab_size_; }
  std::optional<int32_t> token_to_id(std::string_view token) const override;
  std::optional<int32_t> bos_id() const override { return bos_; }
  std::optional<int32_t> eos_id() const override { return eos_; }
  std::string kind() const override { return "tokenizer.json"; }
  std::string fingerprint() const override { return fingerprint_hex(kind(), digest_); }

 private:
  void encode_stretch(std::string_view text, bool at_start, size_t& budget, std::vector<int32_t>& out) const;
  void encode_words(std::string text, bool at_start, std::vector<int32_t>& out) const;
  std::optional<int32_t> config_token(const json* config, const char* key) const;
  void check_id_bound() const;
  void read_post_processor(const json& p);
  int32_t special_id(const json& v, const std::string& entry) const;

  std::string what_;
  std::unique_ptr<Normalizer> normalizer_;
  std::unique_ptr<PreTokenizer> pre_tokenizer_;
  std::unique_ptr<BpeModel> model_;
  std::unique_ptr<Decoder> decoder_;
  std::vector<AddedToken> added_;
  std::unordered_map<int32_t, size_t> added_by_id_;
  std::unordered_map<std::string, int32_t> added_by_content_;
  std::unique_ptr<AddedTokenMatcher> raw_matcher_;
  std::unique_ptr<AddedTokenMatcher> normalized_matcher_;
  PostProcessor post_;
  std::optional<int32_t> bos_, eos_;
  int64_t vocab_size_ = 0;
  uint64_t digest_ = 0;
};

HfTokenizer::HfTokenizer(const std::string& path, const json& j, const json* config, uint64_t digest)
    : what_(path), digest_(digest) {
  // ---- the model: BPE only.
  ST_CHECK(j.contains("model") && j.at("model").is_object(), ConfigError, path,
           ": no \"model\" object; hint: is this a Hugging Face tokenizer.json?");
  const json& model = j.at("model");
  const std::string type = model.value("type", model.contains("merges") ? "BPE" : "");
  ST_CHECK(type == "BPE", ConfigError, path, ": model type '", type,
           "' is not supported (supported: BPE); hint: for a SentencePiece model point --tokenizer at its tokenizer.model");
  model_ = std::make_unique<BpeModel>(model, path);

  normalizer_ = make_normalizer(j.value("normalizer", json()), path);
  pre_tokenizer_ = make_pre_tokenizer(j.value("pre_tokenizer", json()), path);
  decoder_ = make_decoder(j.value("decoder", json()), path);

  // ---- added tokens.
  vocab_size_ = model_->size();
  for (const json& a : j.value("added_tokens", json::array())) {
    AddedToken t;
    t.content = a.at("content").get<std::string>();
    t.id = read_token_id(a.at("id"), path, "added_tokens '" + shorten(t.content) + "'");
    t.special = a.value("special", false);
    t.lstrip = a.value("lstrip", false);
    t.rstrip = a.value("rstrip", false);
    t.single_word = a.value("single_word", false);
    t.normalized = a.value("normalized", !t.special);
    added_by_id_[t.id] = added_.size();
    added_by_content_[t.content] = t.id;
    vocab_size_ = std::max<int64_t>(vocab_size_, int64_t{t.id} + 1);
    added_.push_back(std::move(t));
  }
  check_id_bound();
  // A normalized added token is matched in normalized text, so what is
  // looked for is its normalized content (as Hugging Face does); decode
  // still gives the content.
  for (AddedToken& t : added_) {
    t.match = t.content;
    if (t.normalized && normalizer_) normalizer_->normalize(t.match);
  }
  raw_matcher_ = std::make_unique<AddedTokenMatcher>(added_, false);
  normalized_matcher_ = std::make_unique<AddedTokenMatcher>(added_, true);

  read_post_processor(j.value("post_processor", json()));

  // ---- BOS/EOS: tokenizer_config.json, else the template.
  bos_ = config_token(config, "bos_token");
  eos_ = config_token(config, "eos_token");
  if (!bos_ && !post_.prefix.empty()) bos_ = post_.prefix.front();
  if (!eos_ && !post_.suffix.empty()) eos_ = post_.suffix.back();
}

void HfTokenizer::check_id_bound() const {
  int64_t defined = static_cast<int64_t>(model_->distinct_ids());
  for (const auto& entry : added_by_id_) defined += model_->id_to_token(entry.first) == nullptr ? 1 : 0;
  const int64_t bound = 2 * defined + kIdSlack;
  if (vocab_size_ <= bound) return;
  const int32_t largest = static_cast<int32_t>(vocab_size_ - 1);
  const auto added = added_by_id_.find(largest);
  const std::string entry = added != added_by_id_.end() ? "added_tokens '" + shorten(added_[added->second].content) + "'"
                                                        : "model.vocab '" + shorten(*model_->id_to_token(largest)) + "'";
  ST_CHECK(false, ConfigError, what_, ": ", entry, " has the id ", largest, ", but the file defines only ", defined,
           " ids: ids must be below ", bound, " (twice the ids defined plus ", kIdSlack,
           "), or most of the vocabulary would be holes",
           "; hint: the tokenizer.json is damaged or hostile; re-download the model's tokenizer.json");
}

int32_t HfTokenizer::special_id(const json& v, const std::string& entry) const {
  const int32_t id = read_token_id(v, what_, "post_processor " + entry);
  ST_CHECK(added_by_id_.count(id) != 0 || model_->id_to_token(id) != nullptr, ConfigError, what_, ": post_processor ",
           entry, " has the id ", id, ", which is no token of the vocabulary (", vocab_size_, " ids)",
           "; hint: the tokenizer.json is damaged or hostile; re-download the model's tokenizer.json");
  return id;
}

std::optional<int32_t> HfTokenizer::config_token(const json* config, const char* key) const {
  if (config == nullptr || !config->contains(key)) return std::nullopt;
  const json& v = config->at(key);
  std::string content;
  if (v.is_string()) content = v.get<std::string>();
  else if (v.is_object() && v.contains("content")) content = v.at("content").get<std::string>();
  else return std::nullopt;
  return token_to_id(content);
}

void HfTokenizer::read_post_processor(const json& p) {
  if (p.is_null()) return;
  const std::string type = p.value("type", "");
  if (type == "Sequence") {
    for (const json& q : p.at("processors")) read_post_processor(q);
  } else if (type == "TemplateProcessing") {
    bool after = false;
    for (const json& item : p.at("single")) {
      if (item.contains("Sequence")) {
        after = true;
        continue;
      }
      const std::string name = item.at("SpecialToken").at("id").get<std::string>();
      const json& specials = p.at("special_tokens");
      ST_CHECK(specials.contains(name), ConfigError, what_, ": the post-processor's template names '", name,
               "' but special_tokens does not define it; hint: the tokenizer.json is malformed");
      for (const json& id : specials.at(name).at("ids")) {
        (after ? post_.suffix : post_.prefix).push_back(special_id(id, "special_tokens '" + shorten(name) + "'"));
      }
    }
  } else if (type == "RobertaProcessing" || type == "BertProcessing") {
    post_.prefix.push_back(special_id(p.at("cls").at(1), "cls"));
    post_.suffix.push_back(special_id(p.at("sep").at(1), "sep"));
  } else {
    // ByteLevel only fixes offsets: nothing to do on ids.
    ST_CHECK(type == "ByteLevel", ConfigError, what_, ": post-processor type '", type,
             "' is not supported (supported: TemplateProcessing, ByteLevel, RobertaProcessing, BertProcessing, Sequence)",
             "; hint: remove it from the tokenizer.json if BOS/EOS are added elsewhere");
  }
}

std::optional<int32_t> HfTokenizer::token_to_id(std::string_view token) const {
  const auto it = added_by_content_.find(std::string(token));
  if (it != added_by_content_.end()) return it->second;
  return model_->token_to_id(token);
}

std::vector<int32_t> HfTokenizer::encode(std::string_view text, bool add_special_tokens) const {
  std::string repaired;
  if (repair_utf8(text, repaired)) text = repaired;
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 8);
  if (add_special_tokens) ids = post_.prefix;
  std::vector<Segment> segments;
  raw_matcher_->split(text, segments);
  // What normalization may write for the whole document, all stretches together.
  size_t budget = expansion_bound(text.size());
  for (const Segment& s : segments) {
    if (s.token >= 0) {
      ids.push_back(added_[static_cast<size_t>(s.token)].id);
    } else {
      encode_stretch(text.substr(s.begin, s.end - s.begin), s.begin == 0, budget, ids);
    }
  }
  if (add_special_tokens) ids.insert(ids.end(), post_.suffix.begin(), post_.suffix.end());
  return ids;
}

void HfTokenizer::encode_stretch(std::string_view text, bool at_start, size_t& budget,
                                 std::vector<int32_t>& out) const {
  std::string normalized(text);
  if (normalizer_) {
    normalizer_->normalize(normalized, budget);
    budget -= std::min(budget, normalized.size());
  }
  if (normalized_matcher_->empty()) {
    encode_words(std::move(normalized), at_start, out);
    return;
  }
  std::vector<Segment> segments;
  normalized_matcher_->split(normalized, segments);
  for (const Segment& s : segments) {
    if (s.token >= 0) {
      out.push_back(added_[static_cast<size_t>(s.token)].id);
    } else {
      encode_words(normalized.substr(s.begin, s.end - s.begin), at_start && s.begin == 0, out);
    }
  }
}

void HfTokenizer::encode_words(std::string text, bool at_start, std::vector<int32_t>& out) const {
  if (text.empty()) return;
  if (!pre_tokenizer_) {
    model_->encode_word(text, out);
    return;
  }
  // Each word is encoded as soon as it is cut: a long document is never held
  // as millions of pieces.
  pre_tokenizer_->pre_tokenize(PreToken{std::move(text), at_start},
                               [this, &out](PreToken&& p) { model_->encode_word(p.text, out); });
}

std::string HfTokenizer::decode(const std::vector<int32_t>& ids, bool skip_special_tokens) const {
  std::vector<DecodePiece> pieces;
  pieces.reserve(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    const int32_t id = ids[i];
    const auto added = added_by_id_.find(id);
    if (added != added_by_id_.end()) {
      const AddedToken& t = added_[added->second];
      if (!(skip_special_tokens && t.special)) pieces.push_back(DecodePiece{t.content, true});
      continue;
    }
    const std::string* token = model_->id_to_token(id);
    ST_CHECK(token != nullptr, ConfigError, "decode: id ", id, " at position ", i, " is not in the vocabulary of ",
             what_, " (", vocab_size_, " ids); hint: the ids come from another tokenizer or a model with a larger vocab_size");
    pieces.push_back(DecodePiece{*token, false});
  }
  if (!decoder_) {
    // Hugging Face joins tokens with spaces when there is no decoder.
    std::string out;
    for (size_t i = 0; i < pieces.size(); ++i) out += (i ? " " : "") + pieces[i].text;
    return out;
  }
  decoder_->decode(pieces);
  std::string out;
  for (const DecodePiece& p : pieces) out += p.text;
  return out;
}

}  // namespace

std::string read_tokenizer_file(const std::string& path) {
  std::string text, why;
  ST_CHECK(::shardtrain::detail::read_regular_file(path, kMaxTokenizerBytes, &text, &why), ConfigError,
           "cannot read tokenizer file '", path, "': ", why,
           "; hint: check the path given to --tokenizer / data.tokenizer");
  return text;
}

uint64_t fnv1a(const std::string& data, uint64_t h) {
  for (const char c : data) {
    h ^= static_cast<unsigned char>(c);
    h *= 1099511628211ULL;
  }
  return h;
}

std::string fingerprint_hex(const std::string& kind, uint64_t h) {
  h = fnv1a(kind, h);
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

std::shared_ptr<const Tokenizer> load_hf_tokenizer(const std::string& path) {
  const std::string text = read_tokenizer_file(path);
  json j;
  try {
    j = ::shardtrain::detail::parse_json_text(text);
  } catch (const json::exception& e) {
    ST_CHECK(false, ConfigError, path, " is not valid JSON: ", e.what(),
             "; hint: re-download the tokenizer.json");
  }
  uint64_t digest = fnv1a(text);
  // tokenizer_config.json beside it names BOS and EOS.
  const size_t slash = path.find_last_of('/');
  const std::string config_path = (slash == std::string::npos ? std::string() : path.substr(0, slash + 1)) + "tokenizer_config.json";
  json config;
  bool have_config = false;
  // Absent is fine; anything there that is not a readable regular file (a
  // FIFO, a device, a dangling link) is refused, never waited on.
  struct stat st {};
  if (::lstat(config_path.c_str(), &st) == 0 || errno != ENOENT) {
    std::string config_text, why;
    ST_CHECK(::shardtrain::detail::read_regular_file(config_path, kMaxTokenizerConfigBytes, &config_text, &why),
             ConfigError, "cannot read '", config_path, "' beside the tokenizer.json: ", why,
             "; hint: replace it with the model's tokenizer_config.json, or remove it (BOS/EOS then come from tokenizer.json)");
    try {
      config = ::shardtrain::detail::parse_json_text(config_text);
    } catch (const json::exception& e) {
      ST_CHECK(false, ConfigError, config_path, " is not valid JSON: ", e.what(),
               "; hint: re-download it or remove it (BOS/EOS then come from tokenizer.json)");
    }
    have_config = config.is_object();
    digest = fnv1a(config_text, digest);
  }
  try {
    return std::make_shared<HfTokenizer>(path, j, have_config ? &config : nullptr, digest);
  } catch (const json::exception& e) {
    ST_CHECK(false, ConfigError, path, " does not have the layout of a tokenizer.json: ", e.what(),
             "; hint: re-download it, or use the model's tokenizer.model");
  }
  return nullptr;
}

}  // namespace shardtrain::data::detail
