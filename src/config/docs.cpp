// The key table as docs: the tables of docs/config.md and the view of the
// keys in config/schema.h.
#include <sstream>

#include "key_table.h"
#include "shardtrain/config/schema.h"

namespace shardtrain::config {

using shardtrain::detail::str_cat;

namespace {

constexpr const char* kBegin = "<!-- keys:";
constexpr const char* kEnd = "<!-- /keys -->";

// The section a key's table is in: its parent, or itself at the top level.
std::string section_of(const std::string& path) {
  const size_t dot = path.rfind('.');
  return dot == std::string::npos ? path : path.substr(0, dot);
}

}  // namespace

std::vector<KeyDoc> key_docs() {
  const Config defaults;
  std::vector<KeyDoc> out;
  for (const detail::Key& k : detail::keys()) {
    out.push_back({k.path, k.type, k.write(defaults), k.allowed, k.doc});
  }
  return out;
}

std::string value_text(const Config& config, const std::string& path) {
  const detail::Key* key = detail::find_key(path);
  if (key == nullptr) throw ConfigError(str_cat("'", path, "' is not a config key; ", detail::kDocsHint));
  return key->write(config);
}

std::string key_table(const std::string& section) {
  std::ostringstream t;
  t << "| Key | Type | Default | Allowed | Meaning |\n"
    << "|-----|------|---------|---------|---------|\n";
  int rows = 0;
  for (const KeyDoc& k : key_docs()) {
    if (section_of(k.path) != section) continue;
    t << "| `" << k.path << "` | " << k.type << " | `" << k.default_value << "` | " << k.allowed
      << " | " << k.doc << " |\n";
    ++rows;
  }
  if (rows == 0) {
    throw ConfigError(str_cat("'", section, "' is not a config section with keys; ",
                              detail::kDocsHint));
  }
  return t.str();
}

std::string with_key_tables(const std::string& markdown) {
  std::istringstream in(markdown);
  std::ostringstream out;
  std::string line;
  int line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    out << line << "\n";
    if (line.rfind(kBegin, 0) != 0) continue;
    const size_t close = line.find(" -->");
    const std::string section = line.substr(std::string(kBegin).size(),
                                            close == std::string::npos ? std::string::npos
                                                                       : close - std::string(kBegin).size());
    const int begin_line = line_no;
    bool ended = false;
    while (std::getline(in, line)) {
      ++line_no;
      if (line == kEnd) {
        ended = true;
        break;
      }
    }
    if (!ended) {
      throw ConfigError(str_cat("line ", begin_line, ": '", kBegin, section,
                                " -->' has no '", kEnd, "' after it"));
    }
    out << key_table(section) << kEnd << "\n";
  }
  std::string text = out.str();
  // getline drops a missing final newline; keep the input's ending.
  if (!markdown.empty() && markdown.back() != '\n' && !text.empty()) text.pop_back();
  return text;
}

}  // namespace shardtrain::config
