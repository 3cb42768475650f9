// Decoders of tokenizer.json: token strings back to text.
#include "data/tokenizer_pipeline.h"
#include "data/tokenizer_text.h"
#include "shardtrain/core/error.h"

namespace shardtrain::data::detail {

namespace {

using nlohmann::json;

constexpr const char* kSupported = "Sequence, ByteLevel, ByteFallback, Fuse, Strip, Replace, Metaspace";

class SequenceDecoder : public Decoder {
 public:
  explicit SequenceDecoder(std::vector<std::unique_ptr<Decoder>> parts) : parts_(std::move(parts)) {}
  void decode(std::vector<DecodePiece>& pieces) const override {
    for (const auto& p : parts_) p->decode(pieces);
  }

 private:
  std::vector<std::unique_ptr<Decoder>> parts_;
};

// GPT-2's alphabet back to bytes. Runs of model tokens are decoded together
// (a character's bytes may span tokens) and repaired as UTF-8; added tokens
// stay as written.
class ByteLevelDecoder : public Decoder {
 public:
  void decode(std::vector<DecodePiece>& pieces) const override {
    const ByteMap& map = byte_map();
    std::vector<DecodePiece> out;
    std::string bytes;
    bool open = false;
    auto flush = [&] {
      if (!open) return;
      std::string repaired;
      if (repair_utf8(bytes, repaired)) bytes.swap(repaired);
      out.push_back(DecodePiece{std::move(bytes), false});
      bytes.clear();
      open = false;
    };
    for (DecodePiece& p : pieces) {
      if (p.added) {
        flush();
        out.push_back(std::move(p));
        continue;
      }
      open = true;
      const size_t mark = bytes.size();
      bool all_mapped = true;
      for (size_t i = 0; i < p.text.size();) {
        const int b = map.cp_to_byte(next_code_point(p.text, i));
        if (b < 0) {
          all_mapped = false;
          break;
        }
        bytes += static_cast<char>(b);
      }
      if (!all_mapped) bytes.replace(mark, std::string::npos, p.text);  // not byte-level: as written
    }
    flush();
    pieces = std::move(out);
  }
};

// Runs of "<0xAB>" tokens become their bytes: one piece when they form valid
// UTF-8, one U+FFFD per byte otherwise.
class ByteFallbackDecoder : public Decoder {
 public:
  void decode(std::vector<DecodePiece>& pieces) const override {
    std::vector<DecodePiece> out;
    std::string bytes;
    size_t count = 0;
    auto flush = [&] {
      if (count == 0) return;
      std::string repaired;
      if (repair_utf8(bytes, repaired)) {
        for (size_t k = 0; k < count; ++k) out.push_back(DecodePiece{"\xEF\xBF\xBD", false});
      } else {
        out.push_back(DecodePiece{bytes, false});
      }
      bytes.clear();
      count = 0;
    };
    for (DecodePiece& p : pieces) {
      int value = -1;
      if (!p.added) value = byte_token_value(p.text);
      if (value < 0) {
        flush();
        out.push_back(std::move(p));
      } else {
        bytes += static_cast<char>(value);
        ++count;
      }
    }
    flush();
    pieces = std::move(out);
  }

  // 0..255 for "<0xAB>", -1 for anything else.
  static int byte_token_value(const std::string& t) {
    if (t.size() != 6 || t.compare(0, 3, "<0x") != 0 || t[5] != '>') return -1;
    int v = 0;
    for (int k = 3; k < 5; ++k) {
      const char c = t[k];
      v *= 16;
      if (c >= '0' && c <= '9') v += c - '0';
      else if (c >= 'A' && c <= 'F') v += c - 'A' + 10;
      else if (c >= 'a' && c <= 'f') v += c - 'a' + 10;
      else return -1;
    }
    return v;
  }
};

class FuseDecoder : public Decoder {
 public:
  void decode(std::vector<DecodePiece>& pieces) const override {
    std::string all;
    for (const DecodePiece& p : pieces) all += p.text;
    pieces.assign(1, DecodePiece{std::move(all), false});
  }
};

// Up to `start` leading and `stop` trailing copies of `content` per piece.
class StripDecoder : public Decoder {
 public:
  StripDecoder(std::string content, int start, int stop) : content_(std::move(content)), start_(start), stop_(stop) {}
  void decode(std::vector<DecodePiece>& pieces) const override {
    const size_t n = content_.size();
    for (DecodePiece& p : pieces) {
      std::string& s = p.text;
      size_t begin = 0, end = s.size();
      for (int k = 0; k < start_ && end - begin >= n && s.compare(begin, n, content_) == 0; ++k) begin += n;
      for (int k = 0; k < stop_ && end - begin >= n && s.compare(end - n, n, content_) == 0; ++k) end -= n;
      s = s.substr(begin, end - begin);
    }
  }

 private:
  std::string content_;
  int start_, stop_;
};

class ReplaceDecoder : public Decoder {
 public:
  ReplaceDecoder(const json& pattern, std::string content, const std::string& what)
      : content_(std::move(content)), what_(what) {
    if (pattern.contains("String")) {
      literal_ = pattern.at("String").get<std::string>();
    } else {
      regex_ = std::make_unique<Regex>(pattern.at("Regex").get<std::string>(), what);
    }
  }
  // Bounded as the normalizers are (expansion_bound): the pieces together
  // may grow to 16 times their size plus 4 KiB.
  void decode(std::vector<DecodePiece>& pieces) const override {
    size_t in = 0;
    for (const DecodePiece& p : pieces) in += p.text.size();
    const size_t max_bytes = expansion_bound(in);
    size_t total = 0;
    const auto grow = [&](size_t bytes) {
      total += bytes;
      ST_CHECK(total <= max_bytes, ConfigError, what_, ": decoder Replace would make the decoded text longer than ",
               max_bytes, " bytes (", kExpansionFactor, " times the tokens' size plus ", kExpansionSlack, " bytes)",
               "; hint: this tokenizer.json expands text without bound; use the model's original tokenizer.json");
    };
    for (DecodePiece& p : pieces) {
      std::string out;
      size_t at = 0;
      const auto on_match = [&](size_t b, size_t e) {
        grow(b - at + content_.size());
        out.append(p.text, at, b - at);
        out += content_;
        at = e;
      };
      if (regex_) {
        regex_->for_each_match(p.text, on_match);
      } else if (!literal_.empty()) {
        for (size_t hit = p.text.find(literal_); hit != std::string::npos; hit = p.text.find(literal_, at)) {
          on_match(hit, hit + literal_.size());
        }
      }
      grow(p.text.size() - at);
      out.append(p.text, at, std::string::npos);
      p.text = std::move(out);
    }
  }

 private:
  std::string literal_;
  std::unique_ptr<Regex> regex_;
  std::string content_;
  std::string what_;
};

// The replacement becomes a space again; the first piece loses the space
// that the pre-tokenizer put in front.
class MetaspaceDecoder : public Decoder {
 public:
  MetaspaceDecoder(std::string replacement, bool strip_first)
      : replacement_(std::move(replacement)), strip_first_(strip_first) {}
  void decode(std::vector<DecodePiece>& pieces) const override {
    for (size_t i = 0; i < pieces.size(); ++i) {
      std::string& s = pieces[i].text;
      s = replace_all(s, replacement_, " ");
      if (i == 0 && strip_first_ && !s.empty() && s[0] == ' ') s.erase(0, 1);
    }
  }

 private:
  std::string replacement_;
  bool strip_first_;
};

}  // namespace

std::unique_ptr<Decoder> make_decoder(const json& j, const std::string& what) {
  if (j.is_null()) return nullptr;
  const std::string type = j.value("type", "");
  if (type == "Sequence") {
    std::vector<std::unique_ptr<Decoder>> parts;
    for (const auto& d : j.at("decoders")) {
      if (auto made = make_decoder(d, what)) parts.push_back(std::move(made));
    }
    return std::make_unique<SequenceDecoder>(std::move(parts));
  }
  if (type == "ByteLevel") return std::make_unique<ByteLevelDecoder>();
  if (type == "ByteFallback") return std::make_unique<ByteFallbackDecoder>();
  if (type == "Fuse") return std::make_unique<FuseDecoder>();
  if (type == "Strip") {
    return std::make_unique<StripDecoder>(j.at("content").get<std::string>(), j.value("start", 0), j.value("stop", 0));
  }
  if (type == "Replace") {
    return std::make_unique<ReplaceDecoder>(j.at("pattern"), j.at("content").get<std::string>(), what);
  }
  if (type == "Metaspace") {
    bool strip = j.value("add_prefix_space", true);
    if (j.contains("prepend_scheme")) strip = j.at("prepend_scheme").get<std::string>() != "never";
    std::string replacement = j.value("replacement", std::string("\xE2\x96\x81"));
    ST_CHECK(is_one_character(replacement), ConfigError, what, ": Metaspace decoder replacement \"", shorten(replacement),
             "\" is not one character; hint: the tokenizer.json is malformed (the usual replacement is \"\xE2\x96\x81\")");
    return std::make_unique<MetaspaceDecoder>(std::move(replacement), strip);
  }
  ST_CHECK(false, ConfigError, what, ": decoder type '", type, "' is not supported (supported: ", kSupported,
           "); hint: use a tokenizer.json without it or a tokenizer.model");
  return nullptr;
}

}  // namespace shardtrain::data::detail
