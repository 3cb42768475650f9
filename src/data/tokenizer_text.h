// Text helpers of the tokenizers: UTF-8 walking, GPT-2's byte-to-unicode
// map and a compiled PCRE2 regex. Internal to src/data; no LibTorch here.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace shardtrain::data::detail {

/// Length in bytes of the UTF-8 sequence that starts with `lead` (1 for a
/// stray continuation byte, so walking never stalls).
inline int utf8_length(unsigned char lead) {
  if (lead < 0x80) return 1;
  if ((lead >> 5) == 0x6) return 2;
  if ((lead >> 4) == 0xE) return 3;
  if ((lead >> 3) == 0x1E) return 4;
  return 1;
}

/// Appends code point `cp` as UTF-8.
void append_utf8(std::string& out, uint32_t cp);

/// Decodes the code point at `s[i]` (valid UTF-8 assumed) and advances `i`.
uint32_t next_code_point(std::string_view s, size_t& i);

/// `s` with every ill-formed UTF-8 subsequence replaced by U+FFFD, one per
/// maximal subpart (as WHATWG's TextDecoder and Rust's from_utf8_lossy do).
/// Returns `s` unchanged (no copy into `out`) when it is valid: `out` is
/// written only when something was replaced.
bool repair_utf8(std::string_view s, std::string& out);

/// GPT-2's byte-level alphabet: byte b is the code point kByteToCodePoint[b]
/// (printable Latin-1 bytes map to themselves, the rest to U+0100 onwards).
struct ByteMap {
  uint32_t byte_to_cp[256];
  std::string byte_to_utf8[256];  // the same code points, encoded
  /// Code point -> byte, -1 when the code point is not in the alphabet.
  int cp_to_byte(uint32_t cp) const { return cp < 324 ? cp_to_byte_[cp] : -1; }
  int16_t cp_to_byte_[324];
};
const ByteMap& byte_map();

/// A regex compiled once (PCRE2, UTF + Unicode properties, JIT when the
/// library has it). Matching is thread-safe: each thread has its own match
/// data and JIT stack. Subjects must be valid UTF-8.
class Regex {
 public:
  explicit Regex(const std::string& pattern, const std::string& what);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  /// Calls `on_match(begin, end)` for each non-overlapping match, in order.
  template <typename F>
  void for_each_match(std::string_view subject, F&& on_match) const {
    size_t at = 0;
    size_t begin = 0, end = 0;
    while (at <= subject.size() && find(subject, at, begin, end)) {
      on_match(begin, end);
      // An empty match moves on by one code point.
      at = end > begin ? end : end + (end < subject.size() ? utf8_length(static_cast<unsigned char>(subject[end])) : 1);
    }
  }

  /// The first match at or after `start`: true and [begin, end), or false.
  bool find(std::string_view subject, size_t start, size_t& begin, size_t& end) const;

  const std::string& pattern() const { return pattern_; }

 private:
  void* code_ = nullptr;  // pcre2_code_8*
  std::string pattern_;
};

/// `s` with every `from` replaced by `to` (`from` non-empty).
std::string replace_all(std::string_view s, std::string_view from, std::string_view to);

/// Whether `s` is exactly one UTF-8 character.
inline bool is_one_character(std::string_view s) {
  return !s.empty() && static_cast<size_t>(utf8_length(static_cast<unsigned char>(s[0]))) == s.size();
}

/// `s` cut to its first 40 bytes (whole characters) for a message.
std::string shorten(std::string_view s);

/// The PCRE2 form of a literal string (every metacharacter escaped).
std::string regex_escape(std::string_view s);

}  // namespace shardtrain::data::detail
