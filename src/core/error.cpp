#include "shardtrain/core/error.h"

#include <c10/util/Exception.h>

namespace shardtrain::detail {

void throw_internal(const char* file, int line, const char* cond, const std::string& msg) {
  throw InternalError(str_cat("internal error at ", file, ":", line, ": ", cond,
                              " failed", msg.empty() ? "" : ": ", msg,
                              " (this is a bug in shardtrain; please report it)"));
}

std::string one_line_message(const std::string& what) {
  // c10 appends its backtrace as "\nException raised from F at FILE:LINE
  // (most recent call first):\nframe #0: ..."; older paths start it with
  // "frame #0" alone.
  std::string s = what;
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
