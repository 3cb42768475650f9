#include "shardtrain/core/error.h"

#include <c10/util/Exception.h>

#include <cctype>
#include <cstdlib>
#include <cstring>

namespace shardtrain::detail {

namespace {

bool debug_output() {
  const char* v = std::getenv("SHARDTRAIN_DEBUG");
  return v != nullptr && *v != '\0' && std::strcmp(v, "0") != 0;
}

// Length of a " [name.cpp:12]" tag (ST_CHECK's check site) starting at
// s[at], or 0 when none starts there.
size_t tag_length(const std::string& s, size_t at) {
  if (s.compare(at, 2, " [") != 0) return 0;
  size_t i = at + 2;
  while (i < s.size() && (std::isalnum(static_cast<unsigned char>(s[i])) || s[i] == '_' ||
                          s[i] == '-' || s[i] == '.')) {
    ++i;
  }
  const std::string name = s.substr(at + 2, i - at - 2);
  const auto ends = [&](const char* tail) {
    const size_t n = std::strlen(tail);
    return name.size() > n && name.compare(name.size() - n, n, tail) == 0;
  };
  if (!(ends(".cpp") || ends(".h")) || i >= s.size() || s[i] != ':') return 0;
  const size_t digits = ++i;
  while (i < s.size() && std::isdigit(static_cast<unsigned char>(s[i]))) ++i;
  if (i == digits || i >= s.size() || s[i] != ']') return 0;
  return i + 1 - at;
}

// The check sites are for whoever debugs shardtrain, not for its users:
// they stay in the message only with SHARDTRAIN_DEBUG=1.
std::string without_check_sites(const std::string& s) {
  if (debug_output()) return s;
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const size_t n = tag_length(s, i);
    if (n > 0) {
      i += n;
    } else {
      out += s[i++];
    }
  }
  return out;
}

}  // namespace

void throw_internal(const char* file, int line, const char* cond, const std::string& msg) {
  throw InternalError(str_cat("internal error at ", file, ":", line, ": ", cond,
                              " failed", msg.empty() ? "" : ": ", msg,
                              " (this is a bug in shardtrain; please report it)"));
}

std::string one_line_message(const std::string& what) {
  // c10 appends its backtrace as "\nException raised from F at FILE:LINE
  // (most recent call first):\nframe #0: ..."; older paths start it with
  // "frame #0" alone.
  std::string s = without_check_sites(what);
  for (const char* marker : {"Exception raised from ", "frame #0"}) {
    const size_t at = s.find(marker);
    if (at != std::string::npos) s.erase(at);
  }
  std::string out;
  bool pending = false;  // a line break not yet written
  for (const char c : s) {
    if (c == '\n' || c == '\r') {
      pending = !out.empty();
      continue;
    }
    if (pending) out += "; ";
    pending = false;
    out += c;
  }
  while (!out.empty() && (out.back() == ' ' || out.back() == ';')) out.pop_back();
  return out;
}

std::string one_line_message(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) {
    return one_line_message(c10_error->what_without_backtrace());
  }
  return one_line_message(std::string(e.what()));
}

}  // namespace shardtrain::detail
