// Where the keys a user wrote meet the known ones: `--set KEY=VALUE`
// overrides, and unknown keys in the file, both answered with a
// "did you mean ...?" when a known key is close.
#pragma once

#include <string>

#include "yaml.h"

namespace shardtrain::config::detail {

/// The default Config as a YAML tree: every known key, sections as maps.
const YAML::Node& known_keys();

/// Applies one "a.b=c" override onto `root` (creating missing sections) and
/// records it in `source`. ConfigError with the expected syntax for a
/// malformed override, and with a suggestion for an unknown key.
void apply_override(Source& source, YAML::Node& root, const std::string& text);

/// ConfigError at the first key of `root` (at any depth) that is not known,
/// or a known section written as a scalar.
void check_known_keys(const Source& source, const YAML::Node& root);

}  // namespace shardtrain::config::detail
