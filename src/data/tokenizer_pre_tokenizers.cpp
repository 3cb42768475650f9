// Pre-tokenizers of tokenizer.json: how text is cut into words before BPE.
#include "data/tokenizer_pipeline.h"
#include "data/tokenizer_text.h"
#include "shardtrain/core/error.h"

namespace shardtrain::data::detail {

namespace {

using nlohmann::json;

constexpr const char* kSupportedPreTokenizers =
    "Sequence, ByteLevel, Split, Metaspace, Digits, Whitespace, WhitespaceSplit";

// GPT-2's word pattern (ByteLevel with use_regex).
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

enum class Behavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };

Behavior parse_behavior(const std::string& name, const std::string& what) {
  if (name == "Removed") return Behavior::Removed;
  if (name == "Isolated") return Behavior::Isolated;
  if (name == "MergedWithPrevious") return Behavior::MergedWithPrevious;
  if (name == "MergedWithNext") return Behavior::MergedWithNext;
  if (name == "Contiguous") return Behavior::Contiguous;
  ST_CHECK(false, ConfigError, what, ": Split behavior '", name,
           "' is not one of Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous",
           "; hint: the tokenizer.json is malformed");
  return Behavior::Isolated;
}

// Whether run `cur` joins the piece of the run before it, `prev`, under
// `behavior` (Hugging Face's SplitDelimiterBehavior; Removed drops matches
// before this is asked).
bool joins_previous(Behavior behavior, bool prev_match, bool cur_match) {
  switch (behavior) {
    case Behavior::MergedWithPrevious: return cur_match && !prev_match;
    case Behavior::MergedWithNext: return prev_match && !cur_match;
    case Behavior::Contiguous: return cur_match && prev_match;
    default: return false;
  }
}

// Cuts `piece` at the matches of `regex` as Hugging Face's
// NormalizedString::split does with `behavior`; `invert` swaps the roles of
// matches and the text between them. The text is covered by runs (the
// matches and the text between them, empty ones left out); a run starts a
// piece or extends the last one, and a piece is handed on once the next
// one starts: nothing is collected, however long `piece` is.
void split_piece(const PreToken& piece, const Regex& regex, Behavior behavior, bool invert,
                 const PreTokenSink& emit) {
  const std::string& s = piece.text;
  bool open = false;  // a piece [begin, end) is being built
  size_t begin = 0, end = 0;
  bool has_prev = false, prev_match = false;  // the run before (Removed ones too)
  const auto flush = [&] {
    if (open) emit(PreToken{s.substr(begin, end - begin), piece.at_start && begin == 0});
    open = false;
  };
  const auto run = [&](size_t b, size_t e, bool match) {
    const bool joins = has_prev && open && joins_previous(behavior, prev_match, match);
    has_prev = true;
    prev_match = match;
    if (behavior == Behavior::Removed && match) return;
    if (joins) {
      end = e;
      return;
    }
    flush();
    open = true;
    begin = b;
    end = e;
  };
  size_t at = 0;
  regex.for_each_match(s, [&](size_t b, size_t e) {
    if (b > at) run(at, b, invert);
    if (e > b) run(b, e, !invert);
    at = e;
  });
  if (at < s.size()) run(at, s.size(), invert);
  flush();
}

class SequencePreTokenizer : public PreTokenizer {
 public:
  explicit SequencePreTokenizer(std::vector<std::unique_ptr<PreTokenizer>> parts) : parts_(std::move(parts)) {}
  void pre_tokenize(PreToken piece, const PreTokenSink& emit) const override { stage(0, std::move(piece), emit); }

 private:
  // Part `i` cuts `piece`; each of its pieces goes through the parts after it.
  void stage(size_t i, PreToken piece, const PreTokenSink& emit) const {
    if (i == parts_.size()) {
      emit(std::move(piece));
      return;
    }
    struct Next {
      const SequencePreTokenizer* self;
      size_t i;
      const PreTokenSink* emit;
    } next{this, i + 1, &emit};
    // One pointer captured: the sink stays within std::function's own storage.
    parts_[i]->pre_tokenize(std::move(piece), [n = &next](PreToken&& p) { n->self->stage(n->i, std::move(p), *n->emit); });
  }

  std::vector<std::unique_ptr<PreTokenizer>> parts_;
};

class SplitPreTokenizer : public PreTokenizer {
 public:
  SplitPreTokenizer(const json& pattern, Behavior behavior, bool invert, const std::string& what)
      : regex_(pattern.contains("String") ? regex_escape(pattern.at("String").get<std::string>())
                                          : pattern.at("Regex").get<std::string>(),
               what),
        behavior_(behavior),
        invert_(invert) {}
  void pre_tokenize(PreToken piece, const PreTokenSink& emit) const override {
    split_piece(piece, regex_, behavior_, invert_, emit);
  }

 private:
  Regex regex_;
  Behavior behavior_;
  bool invert_;
};

// Bytes to GPT-2's printable alphabet, after an optional space and GPT-2's
// word split.
class ByteLevelPreTokenizer : public PreTokenizer {
 public:
  ByteLevelPreTokenizer(bool add_prefix_space, bool use_regex, const std::string& what)
      : add_prefix_space_(add_prefix_space),
        regex_(use_regex ? std::make_unique<Regex>(kGpt2Pattern, what) : nullptr) {}
  void pre_tokenize(PreToken piece, const PreTokenSink& emit) const override {
    // An empty piece stays empty (Hugging Face's prepend does nothing there).
    if (add_prefix_space_ && !piece.text.empty() && piece.text[0] != ' ') piece.text.insert(0, 1, ' ');
    const PreTokenSink map = [&emit](PreToken&& p) {
      const ByteMap& bytes = byte_map();
      std::string mapped;
      mapped.reserve(p.text.size() * 2);
      for (const char c : p.text) mapped += bytes.byte_to_utf8[static_cast<unsigned char>(c)];
      emit(PreToken{std::move(mapped), p.at_start});
    };
    if (regex_) {
      split_piece(piece, *regex_, Behavior::Isolated, false, map);
    } else {
      map(std::move(piece));
    }
  }

 private:
  bool add_prefix_space_;
  std::unique_ptr<Regex> regex_;
};

// Spaces become the replacement (U+2581 "▁"), a replacement is put in front
// as prepend_scheme says, and with `split` every replacement starts a piece.
class MetaspacePreTokenizer : public PreTokenizer {
 public:
  enum class Prepend { Always, First, Never };
  MetaspacePreTokenizer(std::string replacement, Prepend prepend, bool split)
      : replacement_(std::move(replacement)), prepend_(prepend), split_(split) {}
  void pre_tokenize(PreToken piece, const PreTokenSink& emit) const override {
    if (piece.text.empty()) return;
    std::string s = replace_all(piece.text, " ", replacement_);
    const bool starts = s.compare(0, replacement_.size(), replacement_) == 0;
    if (!starts && (prepend_ == Prepend::Always || (prepend_ == Prepend::First && piece.at_start))) {
      s.insert(0, replacement_);
    }
    if (!split_) {
      emit(PreToken{std::move(s), piece.at_start});
      return;
    }
    // MergedWithNext on the replacement.
    size_t begin = 0;
    for (size_t hit = s.find(replacement_, 1); hit != std::string::npos;
         hit = s.find(replacement_, hit + replacement_.size())) {
      if (hit > begin) emit(PreToken{s.substr(begin, hit - begin), piece.at_start && begin == 0});
      begin = hit;
    }
    if (begin < s.size()) emit(PreToken{s.substr(begin), piece.at_start && begin == 0});
  }

 private:
  std::string replacement_;
  Prepend prepend_;
  bool split_;
};

}  // namespace

std::unique_ptr<PreTokenizer> make_pre_tokenizer(const json& j, const std::string& what) {
  if (j.is_null()) return nullptr;
  const std::string type = j.value("type", "");
  if (type == "Sequence") {
    std::vector<std::unique_ptr<PreTokenizer>> parts;
    for (const auto& p : j.at("pretokenizers")) {
      if (auto made = make_pre_tokenizer(p, what)) parts.push_back(std::move(made));
    }
    return std::make_unique<SequencePreTokenizer>(std::move(parts));
  }
  if (type == "ByteLevel") {
    return std::make_unique<ByteLevelPreTokenizer>(j.value("add_prefix_space", true), j.value("use_regex", true), what);
  }
  if (type == "Split") {
    return std::make_unique<SplitPreTokenizer>(j.at("pattern"), parse_behavior(j.value("behavior", "Isolated"), what),
                                               j.value("invert", false), what);
  }
  if (type == "Metaspace") {
    using P = MetaspacePreTokenizer::Prepend;
    P prepend = j.value("add_prefix_space", true) ? P::Always : P::Never;
    if (j.contains("prepend_scheme")) {
      const std::string scheme = j.at("prepend_scheme").get<std::string>();
      ST_CHECK(scheme == "always" || scheme == "first" || scheme == "never", ConfigError, what,
               ": Metaspace prepend_scheme '", scheme, "' is not one of always, first, never",
               "; hint: the tokenizer.json is malformed");
      prepend = scheme == "always" ? P::Always : scheme == "first" ? P::First : P::Never;
    }
    std::string replacement = j.value("replacement", std::string("\xE2\x96\x81"));
    // One character, as Hugging Face's format has it: a long one would
    // multiply every space of the text.
    ST_CHECK(is_one_character(replacement), ConfigError, what, ": Metaspace replacement \"", shorten(replacement),
             "\" is not one character; hint: the tokenizer.json is malformed (the usual replacement is \"\xE2\x96\x81\")");
    return std::make_unique<MetaspacePreTokenizer>(std::move(replacement), prepend, j.value("split", true));
  }
  if (type == "Digits") {
    // Digits isolated one by one, or runs of digits kept together.
    const bool individual = j.value("individual_digits", false);
    return std::make_unique<SplitPreTokenizer>(json{{"Regex", R"(\p{N})"}},
                                               individual ? Behavior::Isolated : Behavior::Contiguous,
                                               false, what);
  }
  if (type == "Whitespace") {
    return std::make_unique<SplitPreTokenizer>(json{{"Regex", R"(\w+|[^\w\s]+)"}}, Behavior::Removed, true, what);
  }
  if (type == "WhitespaceSplit") {
    return std::make_unique<SplitPreTokenizer>(json{{"Regex", R"(\s+)"}}, Behavior::Removed, false, what);
  }
  ST_CHECK(false, ConfigError, what, ": pre-tokenizer type '", type, "' is not supported (supported: ",
           kSupportedPreTokenizers, "); hint: use a tokenizer.json without it or a tokenizer.model");
  return nullptr;
}

}  // namespace shardtrain::data::detail
