// UTF-8 helpers, GPT-2's byte map and the PCRE2 wrapper of the tokenizers.
#define PCRE2_CODE_UNIT_WIDTH 8
#include "data/tokenizer_text.h"

#include <pcre2.h>

#include <memory>

#include "shardtrain/core/error.h"

namespace shardtrain::data::detail {

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

uint32_t next_code_point(std::string_view s, size_t& i) {
  const auto lead = static_cast<unsigned char>(s[i]);
  const int n = utf8_length(lead);
  if (n == 1 || i + n > s.size()) {
    ++i;
    return lead;
  }
  uint32_t cp = lead & (0x7F >> n);
  for (int k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  i += n;
  return cp;
}

// Length of the well-formed sequence at s[i], or 0 with `bad` set to the
// length of the maximal ill-formed subpart (Unicode 3.9, table 3-7).
static size_t well_formed(std::string_view s, size_t i, size_t& bad) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  bad = 1;
  if (b0 < 0x80) return 1;
  int n = 0;
  unsigned char lo = 0x80, hi = 0xBF;
  if (b0 >= 0xC2 && b0 <= 0xDF) n = 2;
  else if (b0 == 0xE0) n = 3, lo = 0xA0;
  else if (b0 >= 0xE1 && b0 <= 0xEC) n = 3;
  else if (b0 == 0xED) n = 3, hi = 0x9F;
  else if (b0 >= 0xEE && b0 <= 0xEF) n = 3;
  else if (b0 == 0xF0) n = 4, lo = 0x90;
  else if (b0 >= 0xF1 && b0 <= 0xF3) n = 4;
  else if (b0 == 0xF4) n = 4, hi = 0x8F;
  else return 0;
  for (int k = 1; k < n; ++k) {
    if (i + k >= s.size()) return 0;
    const auto b = static_cast<unsigned char>(s[i + k]);
    if (b < lo || b > hi) return 0;
    lo = 0x80, hi = 0xBF;
    bad = static_cast<size_t>(k) + 1;
  }
  return static_cast<size_t>(n);
}

bool repair_utf8(std::string_view s, std::string& out) {
  size_t i = 0;
  // Fast path: ASCII and well-formed runs need no copy.
  for (size_t bad = 0; i < s.size();) {
    if (static_cast<unsigned char>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    const size_t n = well_formed(s, i, bad);
    if (n == 0) break;
    i += n;
  }
  if (i == s.size()) return false;
  out.assign(s.data(), i);
  while (i < s.size()) {
    size_t bad = 0;
    const size_t n = well_formed(s, i, bad);
    if (n > 0) {
      out.append(s.data() + i, n);
      i += n;
    } else {
      out += "\xEF\xBF\xBD";
      i += bad;
    }
  }
  return true;
}

const ByteMap& byte_map() {
  static const ByteMap map = [] {
    ByteMap m{};
    for (auto& v : m.cp_to_byte_) v = -1;
    uint32_t extra = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      const uint32_t cp = printable ? static_cast<uint32_t>(b) : 256 + extra++;
      m.byte_to_cp[b] = cp;
      append_utf8(m.byte_to_utf8[b], cp);
      m.cp_to_byte_[cp] = static_cast<int16_t>(b);
    }
    return m;
  }();
  return map;
}

// ---- regex ----------------------------------------------------------------------------------

namespace {

// One thread's match data and JIT stack, shared by every Regex it runs.
struct ThreadMatchState {
  pcre2_match_data* data = pcre2_match_data_create(1, nullptr);
  pcre2_jit_stack* stack = pcre2_jit_stack_create(32 * 1024, 4 * 1024 * 1024, nullptr);
  pcre2_match_context* context = [this] {
    pcre2_match_context* c = pcre2_match_context_create(nullptr);
    if (stack != nullptr) pcre2_jit_stack_assign(c, nullptr, stack);
    return c;
  }();
  ~ThreadMatchState() {
    pcre2_match_context_free(context);
    if (stack != nullptr) pcre2_jit_stack_free(stack);
    pcre2_match_data_free(data);
  }
};

ThreadMatchState& thread_state() {
  thread_local ThreadMatchState state;
  return state;
}

}  // namespace

Regex::Regex(const std::string& pattern, const std::string& what) : pattern_(pattern) {
  int error = 0;
  PCRE2_SIZE offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                   PCRE2_UTF | PCRE2_UCP | PCRE2_NO_UTF_CHECK, &error, &offset,
                                   nullptr);
  if (code == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error, message, sizeof(message));
    ST_CHECK(false, ConfigError, what, ": cannot compile the regex '", pattern, "' at offset ",
             offset, ": ", reinterpret_cast<const char*>(message),
             "; hint: the pattern must be a PCRE/Oniguruma-compatible regex");
  }
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);  // falls back to the interpreter when absent
  code_ = code;
}

Regex::~Regex() { pcre2_code_free(static_cast<pcre2_code*>(code_)); }

bool Regex::find(std::string_view subject, size_t start, size_t& begin, size_t& end) const {
  if (start > subject.size()) return false;
  ThreadMatchState& state = thread_state();
  const int rc = pcre2_match(static_cast<const pcre2_code*>(code_),
                             reinterpret_cast<PCRE2_SPTR>(subject.data()), subject.size(), start,
                             PCRE2_NO_UTF_CHECK, state.data, state.context);
  if (rc == PCRE2_ERROR_NOMATCH) return false;
  ST_CHECK(rc >= 0, ConfigError, "regex '", pattern_, "' failed with PCRE2 error ", rc,
           " on a text of ", subject.size(), " bytes; hint: report the pattern and the text");
  const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(state.data);
  begin = ov[0];
  end = ov[1];
  return true;
}

std::string replace_all(std::string_view s, std::string_view from, std::string_view to) {
  std::string out;
  out.reserve(s.size());
  size_t at = 0;
  for (size_t hit; (hit = s.find(from, at)) != std::string_view::npos; at = hit + from.size()) {
    out.append(s.data() + at, hit - at);
    out.append(to);
  }
  out.append(s.data() + at, s.size() - at);
  return out;
}

std::string shorten(std::string_view s) {
  constexpr size_t kMax = 40;
  if (s.size() <= kMax) return std::string(s);
  size_t cut = kMax;
  while (cut > 0 && (static_cast<unsigned char>(s[cut]) & 0xC0) == 0x80) --cut;  // not inside a character
  return std::string(s.substr(0, cut)) + "...";
}

std::string regex_escape(std::string_view s) {
  std::string out;
  for (const char c : s) {
    if (std::string_view("\\^$.|?*+()[]{}-/#").find(c) != std::string_view::npos) out += '\\';
    out += c;
  }
  return out;
}

}  // namespace shardtrain::data::detail
