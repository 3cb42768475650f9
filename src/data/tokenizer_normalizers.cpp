// Normalizers of tokenizer.json. Unicode normalization uses utf8proc: a small
// C library with its own tables (no data files, no locale), one call per
// form, and thread-safe; ICU would do the same at many times the size.
#include <utf8proc.h>

#include <cstdlib>

#include "data/tokenizer_pipeline.h"
#include "data/tokenizer_text.h"
#include "shardtrain/core/error.h"

namespace shardtrain::data::detail {

namespace {

using nlohmann::json;

constexpr const char* kSupportedNormalizers = "Sequence, Prepend, Replace, NFC, NFKC, NFD, NFKD, Lowercase, Strip";

// A normalizer about to make the text longer than the document's bound.
void refuse_expansion(const std::string& what, const std::string& normalizer, size_t bytes, size_t max_bytes) {
  ST_CHECK(false, ConfigError, what, ": normalizer ", normalizer, " would make the text ", bytes,
           " bytes long, beyond the ", max_bytes, " bytes left of what a document may grow to (", kExpansionFactor,
           " times its size plus ", kExpansionSlack, " bytes)",
           "; hint: this tokenizer.json expands text without bound; use the model's original tokenizer.json");
}

class SequenceNormalizer : public Normalizer {
 public:
  explicit SequenceNormalizer(std::vector<std::unique_ptr<Normalizer>> parts) : parts_(std::move(parts)) {}
  void normalize(std::string& text, size_t max_bytes) const override {
    for (const auto& p : parts_) p->normalize(text, max_bytes);
  }

 private:
  std::vector<std::unique_ptr<Normalizer>> parts_;
};

class PrependNormalizer : public Normalizer {
 public:
  PrependNormalizer(std::string prefix, const std::string& what) : prefix_(std::move(prefix)), what_(what) {}
  void normalize(std::string& text, size_t max_bytes) const override {
    if (text.empty()) return;
    if (text.size() + prefix_.size() > max_bytes) {
      refuse_expansion(what_, "Prepend of \"" + shorten(prefix_) + "\"", text.size() + prefix_.size(), max_bytes);
    }
    text.insert(0, prefix_);
  }

 private:
  std::string prefix_;
  std::string what_;
};

// Replace: a literal string or a regex, every occurrence.
class ReplaceNormalizer : public Normalizer {
 public:
  ReplaceNormalizer(const json& pattern, std::string content, const std::string& what)
      : content_(std::move(content)), what_(what) {
    if (pattern.contains("String")) {
      literal_ = pattern.at("String").get<std::string>();
      ST_CHECK(!literal_.empty(), ConfigError, what, ": Replace with an empty String pattern",
               "; hint: the tokenizer.json is malformed");
      name_ = "Replace of \"" + shorten(literal_) + "\"";
    } else {
      regex_ = std::make_unique<Regex>(pattern.at("Regex").get<std::string>(), what);
      name_ = "Replace of /" + shorten(regex_->pattern()) + "/";
    }
  }
  void normalize(std::string& text, size_t max_bytes) const override {
    if (!regex_) {
      // The result's size first: a replacement many times the pattern's
      // size is refused before it is built.
      size_t hits = 0;
      for (size_t at = text.find(literal_); at != std::string::npos; at = text.find(literal_, at + literal_.size())) ++hits;
      if (hits == 0) return;
      const size_t bytes = text.size() - hits * literal_.size() + hits * content_.size();
      if (bytes > max_bytes) refuse_expansion(what_, name_, bytes, max_bytes);
      text = replace_all(text, literal_, content_);
      return;
    }
    std::string out;
    size_t at = 0;
    regex_->for_each_match(text, [&](size_t b, size_t e) {
      if (out.size() + (b - at) + content_.size() > max_bytes) {
        refuse_expansion(what_, name_, out.size() + (b - at) + content_.size(), max_bytes);
      }
      out.append(text, at, b - at);
      out += content_;
      at = e;
    });
    if (at == 0 && out.empty()) return;
    if (out.size() + (text.size() - at) > max_bytes) refuse_expansion(what_, name_, out.size() + (text.size() - at), max_bytes);
    out.append(text, at, std::string::npos);
    text = std::move(out);
  }

 private:
  std::string literal_;
  std::unique_ptr<Regex> regex_;
  std::string content_;
  std::string what_;
  std::string name_;
};

bool is_ascii(const std::string& s) {
  for (const char c : s) {
    if (static_cast<unsigned char>(c) >= 0x80) return false;
  }
  return true;
}

class UnicodeNormalizer : public Normalizer {
 public:
  UnicodeNormalizer(int options, const char* name, const std::string& what)
      : options_(options), name_(name), what_(what) {}
  void normalize(std::string& text, size_t max_bytes) const override {
    if (is_ascii(text)) return;  // every form leaves ASCII as it is
    utf8proc_uint8_t* out = nullptr;
    const utf8proc_ssize_t n =
        utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()),
                     static_cast<utf8proc_ssize_t>(text.size()), &out,
                     static_cast<utf8proc_option_t>(options_));
    if (n < 0) return;  // cannot happen on repaired UTF-8; leave the text as it is
    // A form grows a text by a bounded factor (Unicode's own): check after.
    if (static_cast<size_t>(n) > max_bytes) {
      std::free(out);
      refuse_expansion(what_, name_, static_cast<size_t>(n), max_bytes);
    }
    text.assign(reinterpret_cast<const char*>(out), static_cast<size_t>(n));
    std::free(out);
  }

 private:
  int options_;
  const char* name_;
  std::string what_;
};

class LowercaseNormalizer : public Normalizer {
 public:
  explicit LowercaseNormalizer(const std::string& what) : what_(what) {}
  void normalize(std::string& text, size_t max_bytes) const override {
    std::string out;
    out.reserve(text.size());
    for (size_t i = 0; i < text.size();) {
      append_utf8(out, static_cast<uint32_t>(utf8proc_tolower(static_cast<utf8proc_int32_t>(next_code_point(text, i)))));
    }
    if (out.size() > max_bytes) refuse_expansion(what_, "Lowercase", out.size(), max_bytes);  // at most 1.5 times
    text = std::move(out);
  }

 private:
  std::string what_;
};

bool is_space(uint32_t cp) {
  return cp == ' ' || (cp >= 0x09 && cp <= 0x0D) || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}

class StripNormalizer : public Normalizer {
 public:
  StripNormalizer(bool left, bool right) : left_(left), right_(right) {}
  void normalize(std::string& text, size_t) const override {  // never longer
    size_t begin = 0, end = text.size();
    if (left_) {
      for (size_t i = 0; i < text.size() && is_space(next_code_point(text, i));) begin = i;
    }
    if (right_) {
      // Walk forward, remembering where the last non-space ended.
      size_t last = begin;
      for (size_t i = begin; i < text.size();) {
        const bool space = is_space(next_code_point(text, i));
        if (!space) last = i;
      }
      end = last;
    }
    text = text.substr(begin, end - begin);
  }

 private:
  bool left_, right_;
};

}  // namespace

std::unique_ptr<Normalizer> make_normalizer(const json& j, const std::string& what) {
  if (j.is_null()) return nullptr;
  const std::string type = j.value("type", "");
  if (type == "Sequence") {
    std::vector<std::unique_ptr<Normalizer>> parts;
    for (const auto& n : j.at("normalizers")) {
      if (auto p = make_normalizer(n, what)) parts.push_back(std::move(p));
    }
    return std::make_unique<SequenceNormalizer>(std::move(parts));
  }
  if (type == "Prepend") return std::make_unique<PrependNormalizer>(j.at("prepend").get<std::string>(), what);
  if (type == "Replace") {
    return std::make_unique<ReplaceNormalizer>(j.at("pattern"), j.at("content").get<std::string>(), what);
  }
  constexpr int kStable = UTF8PROC_STABLE;
  if (type == "NFC") return std::make_unique<UnicodeNormalizer>(kStable | UTF8PROC_COMPOSE, "NFC", what);
  if (type == "NFKC") {
    return std::make_unique<UnicodeNormalizer>(kStable | UTF8PROC_COMPOSE | UTF8PROC_COMPAT, "NFKC", what);
  }
  if (type == "NFD") return std::make_unique<UnicodeNormalizer>(kStable | UTF8PROC_DECOMPOSE, "NFD", what);
  if (type == "NFKD") {
    return std::make_unique<UnicodeNormalizer>(kStable | UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT, "NFKD", what);
  }
  if (type == "Lowercase") return std::make_unique<LowercaseNormalizer>(what);
  if (type == "Strip") {
    return std::make_unique<StripNormalizer>(j.value("strip_left", true), j.value("strip_right", true));
  }
  ST_CHECK(false, ConfigError, what, ": normalizer type '", type, "' is not supported (supported: ",
           kSupportedNormalizers, "); hint: use a tokenizer.json without it or a tokenizer.model");
  return nullptr;
}

}  // namespace shardtrain::data::detail
