// YAML in and out, one value type at a time, and where each value came from.
#include "yaml.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>

namespace shardtrain::config::detail {

using shardtrain::detail::str_cat;

// ---- text --------------------------------------------------------------------------------

std::string join(const std::vector<std::string>& items, const std::string& sep) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) out += (i ? sep : "") + items[i];
  return out;
}

std::vector<std::string> split_dots(const std::string& key) {
  std::vector<std::string> parts;
  size_t start = 0;
  while (true) {
    const size_t dot = key.find('.', start);
    parts.push_back(key.substr(start, dot == std::string::npos ? std::string::npos : dot - start));
    if (dot == std::string::npos) return parts;
    start = dot + 1;
  }
}

std::string format_double(double v) {
  char buf[64];
  int precision = 1;
  for (; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof(buf), "%.*g", precision, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  // %g writes 100 as 1e+02; plain decimals read better from 1e-4 to 1e15.
  if (v != 0.0 && std::isfinite(v)) {
    const int exponent = static_cast<int>(std::floor(std::log10(std::fabs(v))));
    if (exponent >= -4 && exponent < 15) {
      char fixed[64];
      std::snprintf(fixed, sizeof(fixed), "%.*f", std::max(0, precision - 1 - exponent), v);
      if (std::strtod(fixed, nullptr) == v) std::snprintf(buf, sizeof(buf), "%s", fixed);
    }
  }
  std::string s = buf;
  if (s.find_first_not_of("-0123456789") == std::string::npos) s += ".0";
  return s;
}

namespace {

bool is_yaml_reserved(const std::string& s) {
  std::string lower = s;
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  for (const char* word : {"null", "~", "true", "false", "yes", "no", "on", "off", "y", "n"}) {
    if (lower == word) return true;
  }
  return false;
}

}  // namespace

std::string format_string(const std::string& s) {
  const bool simple =
      !s.empty() && !is_yaml_reserved(s) &&
      s.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_./-") ==
          std::string::npos &&
      s.front() != '-' && s.front() != '.';
  if (simple) return s;
  YAML::Emitter out;
  out << YAML::DoubleQuoted << s;
  return out.c_str();
}

std::string show(const YAML::Node& node) {
  if (node.IsNull()) return "null";
  if (node.IsScalar()) return "'" + node.Scalar() + "'";
  YAML::Emitter out;
  out << YAML::Flow << node;
  return out.c_str();
}

// ---- reading scalars ---------------------------------------------------------------------

bool parse_scalar(const YAML::Node& node, std::string& out) {
  if (!node.IsScalar()) return false;
  out = node.Scalar();
  return true;
}

bool parse_scalar(const YAML::Node& node, bool& out) {
  if (!node.IsScalar()) return false;
  try {
    out = node.as<bool>();
    return true;
  } catch (const YAML::Exception&) {
    return false;
  }
}

bool parse_scalar(const YAML::Node& node, double& out) {
  if (!node.IsScalar()) return false;
  const std::string& text = node.Scalar();
  if (text.empty() || std::isspace(static_cast<unsigned char>(text.front()))) return false;
  errno = 0;
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (errno != 0 || *end != '\0' || !std::isfinite(v)) return false;
  out = v;
  return true;
}

bool parse_scalar(const YAML::Node& node, int64_t& out) {
  if (!node.IsScalar()) return false;
  const std::string& text = node.Scalar();
  if (text.empty() || std::isspace(static_cast<unsigned char>(text.front()))) return false;
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (errno != 0 || *end != '\0') return false;
  out = v;
  return true;
}

bool parse_scalar(const YAML::Node& node, int& out) {
  int64_t v = 0;
  if (!parse_scalar(node, v) || v < std::numeric_limits<int>::min() ||
      v > std::numeric_limits<int>::max()) {
    return false;
  }
  out = static_cast<int>(v);
  return true;
}

bool parse_scalar(const YAML::Node& node, uint64_t& out) {
  if (!node.IsScalar() || node.Scalar().empty() ||
      !std::isdigit(static_cast<unsigned char>(node.Scalar().front()))) {
    return false;
  }
  errno = 0;
  char* end = nullptr;
  const unsigned long long v = std::strtoull(node.Scalar().c_str(), &end, 10);
  if (errno != 0 || *end != '\0') return false;
  out = v;
  return true;
}

namespace {

// yaml-cpp keeps both entries of a key written twice in one mapping and
// lookups find the first, so `lr: 1e-3` then `lr: -5` silently trained with
// 1e-3. Every mapping, at any depth, is checked for repeated keys.
//
// Aliases make the document a graph whose expansion can be exponential in its
// size: ten aliases nested nine deep are 570 bytes and 10^9 nodes. The walk
// counts the nodes it expands and refuses a document past kMaxExpandedNodes,
// so no later reader (or message that prints a value) meets the expansion
// either. A real config expands to a few hundred nodes.
constexpr int64_t kMaxExpandedNodes = 100000;

void refuse_duplicate_keys(const Source& source, const YAML::Node& node, const std::string& path,
                           int64_t& expanded) {
  if (++expanded > kMaxExpandedNodes) {
    const YAML::Mark& m = node.Mark();
    source.problem_at(m.is_null() ? source.origin() : str_cat(source.origin(), ":", m.line + 1),
                      path.empty() ? "<top level>" : path,
                      str_cat("the document expands to more than ", kMaxExpandedNodes,
                              " values (aliases '*name' nested in one another multiply); write "
                              "the values out instead of nesting aliases"));
  }
  if (node.IsSequence()) {
    for (size_t i = 0; i < node.size(); ++i) {
      refuse_duplicate_keys(source, node[i], str_cat(path, "[", i, "]"), expanded);
    }
    return;
  }
  if (!node.IsMap()) return;
  std::map<std::string, YAML::Mark> seen;
  for (const auto& entry : node) {
    const std::string key = entry.first.IsScalar() ? entry.first.Scalar() : show(entry.first);
    const std::string full = path.empty() ? key : path + "." + key;
    const auto [first, fresh] = seen.emplace(key, entry.first.Mark());
    if (!fresh) {
      const YAML::Mark& again = entry.first.Mark();
      const auto line = [](const YAML::Mark& m) {
        return m.is_null() ? std::string("?") : std::to_string(m.line + 1);
      };
      source.problem_at(
          again.is_null() ? source.origin() : str_cat(source.origin(), ":", again.line + 1), full,
          str_cat("the key is written twice, at line ", line(first->second), " and at line ",
                  line(again), "; YAML would silently keep only one of them, so delete the other"));
    }
    refuse_duplicate_keys(source, entry.second, full, expanded);
  }
}

}  // namespace

YAML::Node load_yaml(const Source& source, const std::string& text) {
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    const std::string at =
        e.mark.is_null() ? source.origin()
                         : str_cat(source.origin(), ":", e.mark.line + 1, ":", e.mark.column + 1);
    throw ConfigError(str_cat(at, ": invalid YAML: ", e.msg,
                              "; fix the syntax there (indentation, a ':' after each key, "
                              "closed brackets and quotes)"));
  }
  if (root.IsNull()) return YAML::Node(YAML::NodeType::Map);
  if (!root.IsMap()) {
    source.fail_at(source.where("", &root), "<top level>", show(root),
                   "a mapping of sections (run:, model:, data:, ...)");
  }
  int64_t expanded = 0;
  refuse_duplicate_keys(source, root, "", expanded);
  return root;
}

// ---- where values came from --------------------------------------------------------------

std::string Source::where(const std::string& path, const YAML::Node* node) const {
  for (auto it = overrides_.rbegin(); it != overrides_.rend(); ++it) {
    const std::string& key = it->first;
    if (path == key || path.rfind(key + ".", 0) == 0) {
      return str_cat("--set '", it->second, "' (on ", origin_, ")");
    }
  }
  if (node != nullptr && !node->Mark().is_null()) return str_cat(origin_, ":", node->Mark().line + 1);
  return origin_;
}

std::string Source::where_seen(const std::vector<std::string>& paths) const {
  for (const std::string& path : paths) {
    const auto it = seen_.find(path);
    if (it != seen_.end()) return it->second;
    for (const auto& [key, at] : seen_) {
      if (key.rfind(path + ".", 0) == 0) return at;
    }
  }
  return str_cat(origin_, " (", paths.front(), " at its default)");
}

void Source::fail_at(const std::string& at, const std::string& path, const std::string& got,
                     const std::string& expected) const {
  throw ConfigError(str_cat(at, ": ", path, ": got ", got, ", expected ", expected, "; ", kDocsHint));
}

void Source::problem_at(const std::string& at, const std::string& path,
                        const std::string& problem) const {
  throw ConfigError(str_cat(at, ": ", path, ": ", problem, "; ", kDocsHint));
}

void Source::require(bool ok, const std::string& path, const std::string& got,
                     const std::string& expected, std::vector<std::string> also) const {
  if (ok) return;
  also.insert(also.begin(), path);
  fail_at(where_seen(also), path, got, expected);
}

}  // namespace shardtrain::config::detail
