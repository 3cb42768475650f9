// `--set KEY=VALUE` overrides and unknown keys, with their suggestions. The
// set of known keys is the YAML that to_yaml() writes for a default Config,
// so it is the key table (schema.cpp) and nothing else.
#include "overrides.h"

#include <algorithm>
#include <vector>

#include "shardtrain/config/config.h"

namespace shardtrain::config::detail {

using shardtrain::detail::str_cat;

namespace {

constexpr const char* kOverrideSyntax =
    "expected KEY=VALUE with a dotted key and a YAML value, e.g. --set optimizer.lr=1e-3, "
    "--set optimizer.betas=[0.9,0.99] or --set batch.accumulate=null";

std::string trim(const std::string& s) {
  const size_t begin = s.find_first_not_of(" \t");
  if (begin == std::string::npos) return "";
  const size_t end = s.find_last_not_of(" \t");
  return s.substr(begin, end - begin + 1);
}

std::string key_path(const std::string& prefix, const std::string& key) {
  return prefix.empty() ? key : prefix + "." + key;
}

std::vector<std::string> keys_of(const YAML::Node& map) {
  std::vector<std::string> keys;
  for (const auto& item : map) keys.push_back(item.first.Scalar());
  return keys;
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = up;
    }
  }
  return row[b.size()];
}

// "did you mean ...?" for an unknown key: the closest sibling within edit
// distance 1, else the same key name in another section, else the closest
// sibling within distance 2 (so `lr` at the top level is optimizer.lr, not lora).
std::string suggestion(const std::string& key, const YAML::Node& siblings) {
  std::string best;
  size_t best_distance = 3;
  for (const std::string& known : keys_of(siblings)) {
    const size_t d = edit_distance(key, known);
    if (d < best_distance) {
      best = known;
      best_distance = d;
    }
  }
  if (!best.empty() && best_distance <= 1) return "did you mean '" + best + "'? ";
  std::vector<std::string> elsewhere;
  for (const auto& item : known_keys()) {
    const YAML::Node section = item.second;
    if (section.IsMap() && section[key].IsDefined()) {
      elsewhere.push_back(item.first.Scalar() + "." + key);
    }
  }
  if (!elsewhere.empty()) return "did you mean '" + join(elsewhere, "' or '") + "'? ";
  if (!best.empty()) return "did you mean '" + best + "'? ";
  return "";
}

std::string unknown_key(const std::string& key, const YAML::Node& known, const std::string& prefix) {
  return str_cat("unknown key; ", suggestion(key, known), "keys in ",
                 prefix.empty() ? "the top level" : prefix, ": ", join(keys_of(known), ", "));
}

// Sets parts[i..] under `node` to `value`, creating missing sections.
void set_path(const Source& source, YAML::Node node, const std::vector<std::string>& parts, size_t i,
              const YAML::Node& value, const std::string& text) {
  if (i + 1 == parts.size()) {
    node[parts[i]] = value;
    return;
  }
  const YAML::Node child = node[parts[i]];
  if (!child.IsDefined() || child.IsNull()) {
    node[parts[i]] = YAML::Node(YAML::NodeType::Map);
  } else if (!child.IsMap()) {
    const std::vector<std::string> head(parts.begin(), parts.begin() + static_cast<long>(i) + 1);
    const std::string path = join(head, ".");
    source.fail_at(source.where(path, &child), path, show(child),
                   str_cat("a section (a mapping) so that --set '", text, "' can apply"));
  }
  set_path(source, node[parts[i]], parts, i + 1, value, text);
}

void check_keys_under(const Source& source, const YAML::Node& node, const YAML::Node& known,
                      const std::string& prefix) {
  for (const auto& item : node) {
    const std::string key = item.first.Scalar();
    const std::string path = key_path(prefix, key);
    const YAML::Node expected = known[key];
    if (!expected.IsDefined()) {
      source.problem_at(source.where(path, &item.first), path, unknown_key(key, known, prefix));
    }
    if (!expected.IsMap()) continue;
    if (item.second.IsMap()) {
      check_keys_under(source, item.second, expected, path);
    } else if (!item.second.IsNull()) {
      source.fail_at(source.where(path, &item.second), path, show(item.second),
                     str_cat("a section with keys ", join(keys_of(expected), ", ")));
    }
  }
}

}  // namespace

const YAML::Node& known_keys() {
  static const YAML::Node tree = YAML::Load(Config().to_yaml());
  return tree;
}

void apply_override(Source& source, YAML::Node& root, const std::string& text) {
  const size_t eq = text.find('=');
  const std::string key = eq == std::string::npos ? "" : trim(text.substr(0, eq));
  const std::vector<std::string> parts = split_dots(key);
  const bool empty_part =
      std::any_of(parts.begin(), parts.end(), [](const std::string& p) { return p.empty(); });
  if (eq == std::string::npos || key.empty() || empty_part) {
    throw ConfigError(str_cat("--set '", text, "': malformed override; ", kOverrideSyntax));
  }
  YAML::Node value;
  try {
    value = YAML::Load(text.substr(eq + 1));
  } catch (const YAML::Exception& e) {
    throw ConfigError(str_cat("--set '", text, "': ", key, ": the value is not valid YAML (", e.msg,
                              "); ", kOverrideSyntax));
  }
  // The key must name a known key or section, part by part. yaml-cpp's
  // assignment between nodes rebinds the tree, so each level is kept as a
  // new node rather than reassigned.
  std::vector<YAML::Node> levels = {known_keys()};
  levels.reserve(parts.size() + 1);
  std::string path;
  for (const std::string& part : parts) {
    const YAML::Node& known = levels.back();
    if (!known.IsMap()) {
      throw ConfigError(str_cat("--set '", text, "': ", path, " is a value, not a section, so ",
                                key, " is not a key; ", kDocsHint));
    }
    const YAML::Node next = known[part];
    if (!next.IsDefined()) {
      throw ConfigError(str_cat("--set '", text, "': ", key_path(path, part), ": ",
                                unknown_key(part, known, path), "; ", kDocsHint));
    }
    levels.push_back(next);
    path = key_path(path, part);
  }
  set_path(source, root, parts, 0, value, text);
  source.add_override(key, text);
}

void check_known_keys(const Source& source, const YAML::Node& root) {
  check_keys_under(source, root, known_keys(), "");
}

}  // namespace shardtrain::config::detail
