#include "core/json.h"

namespace shardtrain::detail {

bool json_too_deep(const std::string& text, int max_depth) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (const char c : text) {
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth) return true;
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
  return false;
}

std::string json_parse_problem(const std::string& what) {
  std::string out;
  for (const char c : what) out += (c == '\n' || c == '\r') ? ' ' : c;
  if (out.size() > 200) out = out.substr(0, 200) + "...";
  return out;
}

}  // namespace shardtrain::detail
