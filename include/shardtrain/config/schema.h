// The config's keys as data, for documentation, tools and tests. Every key
// is declared once, in src/config/schema.cpp; this is a read-only view of
// that table.
//
// docs/config.md keeps its prose by hand and its key tables generated: the
// lines between `<!-- keys:SECTION -->` and `<!-- /keys -->` are
// key_table(SECTION). `shardtrain config --docs docs/config.md` (or the
// build target `config-docs`) rewrites them; a unit test fails when they
// differ from the declarations.
#pragma once

#include <string>
#include <vector>

#include "shardtrain/config/config.h"

namespace shardtrain::config {

/// One key as the docs show it.
struct KeyDoc {
  /// The dotted path: "trainer.early_stopping.patience"; "precision".
  std::string path;
  /// "int", "float", "string", "list of int", "int or null", ...
  std::string type;
  /// The default, as to_yaml() writes it.
  std::string default_value;
  /// What is allowed (markdown; "" when any value of the type is).
  std::string allowed;
  /// What the key does (markdown, one line).
  std::string doc;
};

/// Every key, in the order to_yaml() writes them.
std::vector<KeyDoc> key_docs();

/// The YAML text of the value of key `path` in `config`, as to_yaml()
/// writes it; ConfigError for an unknown path.
std::string value_text(const Config& config, const std::string& path);

/// The markdown table of a section's keys ("trainer" has the trainer keys
/// without trainer.early_stopping's; a top-level key such as "precision" is
/// its own section). ConfigError for a section without keys.
std::string key_table(const std::string& section);

/// `markdown` with each `<!-- keys:SECTION -->` ... `<!-- /keys -->` block's
/// lines replaced by key_table(SECTION). ConfigError for an unknown section
/// or a block without its end marker.
std::string with_key_tables(const std::string& markdown);

}  // namespace shardtrain::config
