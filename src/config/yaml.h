// YAML in and out for the config, one value type at a time, and Source: where
// each value came from, so that every message names the file and line (or
// the --set override) of the value it is about.
//
// Internal to src/config. The value types are those of the config structs:
// std::string, bool, double, int, int64_t, uint64_t, enums with a name table
// (core/enum_names.h), std::optional<int64_t> and std::vector of these.
#pragma once

#include <yaml-cpp/yaml.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "shardtrain/core/enum_names.h"
#include "shardtrain/core/error.h"

namespace shardtrain::config::detail {

constexpr const char* kDocsHint = "see docs/config.md";

// ---- type traits ------------------------------------------------------------------------

// True for an enum with an ST_ENUM_NAMES table (found by argument-dependent lookup).
template <class T, class = void>
struct has_names : std::false_type {};
template <class T>
struct has_names<T, std::void_t<decltype(enum_name_table(T{}))>> : std::true_type {};

template <class T>
struct is_vector : std::false_type {};
template <class T>
struct is_vector<std::vector<T>> : std::true_type {};

template <class T>
struct is_optional : std::false_type {};
template <class T>
struct is_optional<std::optional<T>> : std::true_type {};

// ---- text --------------------------------------------------------------------------------

std::string join(const std::vector<std::string>& items, const std::string& sep);
std::vector<std::string> split_dots(const std::string& key);
/// The shortest decimal that reads back to exactly `v`, with ".0" on whole numbers.
std::string format_double(double v);
/// A string as a YAML scalar: plain when YAML reads it back as the same
/// string, double-quoted otherwise.
std::string format_string(const std::string& s);
/// A node as it appears in a message: scalars quoted as written, the rest in flow style.
std::string show(const YAML::Node& node);

/// A value as to_yaml() writes it.
template <class T>
std::string format_value(const T& v) {
  if constexpr (std::is_same_v<T, std::string>) {
    return format_string(v);
  } else if constexpr (std::is_same_v<T, bool>) {
    return v ? "true" : "false";
  } else if constexpr (std::is_floating_point_v<T>) {
    return format_double(v);
  } else if constexpr (std::is_integral_v<T>) {
    return std::to_string(v);
  } else if constexpr (has_names<T>::value) {
    return format_string(enum_name(v));
  } else if constexpr (is_optional<T>::value) {
    return v ? format_value(*v) : std::string("null");
  } else {
    static_assert(is_vector<T>::value, "not a config value type");
    std::vector<std::string> items;
    for (const auto& item : v) items.push_back(format_value(item));
    return "[" + join(items, ", ") + "]";
  }
}

/// A value as a message shows it after "got": strings and names quoted.
template <class T>
std::string show_value(const T& v) {
  if constexpr (std::is_same_v<T, std::string>) {
    return "'" + v + "'";
  } else if constexpr (has_names<T>::value) {
    return std::string("'") + enum_name(v) + "'";
  } else {
    return format_value(v);
  }
}

/// The type column of the docs.
template <class T>
std::string type_name() {
  if constexpr (std::is_same_v<T, std::string> || has_names<T>::value) {
    return "string";
  } else if constexpr (std::is_same_v<T, bool>) {
    return "bool";
  } else if constexpr (std::is_floating_point_v<T>) {
    return "float";
  } else if constexpr (std::is_same_v<T, uint64_t>) {
    return "uint64";
  } else if constexpr (std::is_integral_v<T>) {
    return "int";
  } else if constexpr (is_optional<T>::value) {
    return type_name<typename T::value_type>() + " or null";
  } else {
    return "list of " + type_name<typename T::value_type>();
  }
}

// ---- reading scalars ---------------------------------------------------------------------

// Each returns false when the node is not a scalar of that type.
bool parse_scalar(const YAML::Node& node, std::string& out);
bool parse_scalar(const YAML::Node& node, bool& out);
bool parse_scalar(const YAML::Node& node, double& out);
bool parse_scalar(const YAML::Node& node, int64_t& out);
bool parse_scalar(const YAML::Node& node, uint64_t& out);
bool parse_scalar(const YAML::Node& node, int& out);
template <class E, class = std::enable_if_t<has_names<E>::value>>
bool parse_scalar(const YAML::Node& node, E& out) {
  if (!node.IsScalar()) return false;
  const std::optional<E> v = parse_enum<E>(node.Scalar());
  if (v) out = *v;
  return v.has_value();
}

/// What a message says a value of type T must be.
template <class T>
std::string expected_text() {
  if constexpr (std::is_same_v<T, std::string>) {
    return "a string";
  } else if constexpr (std::is_same_v<T, bool>) {
    return "true or false";
  } else if constexpr (std::is_floating_point_v<T>) {
    return "a finite number";
  } else if constexpr (std::is_same_v<T, uint64_t>) {
    return "an integer in [0, 2^64)";
  } else if constexpr (std::is_same_v<T, int>) {
    return "an integer in [-2^31, 2^31)";
  } else if constexpr (std::is_integral_v<T>) {
    return "an integer in [-2^63, 2^63)";
  } else if constexpr (has_names<T>::value) {
    return "one of: " + enum_choices<T>();
  } else if constexpr (is_optional<T>::value) {
    return "an integer >= 1 or null (null: derived from the other two)";
  } else if constexpr (std::is_same_v<T, std::vector<double>>) {
    return "a list of numbers, e.g. [0.9, 0.95]";
  } else if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
    return "a list of integers, e.g. [64, 128, 64]";
  } else {
    return "a list of strings, e.g. [BlockImpl]";
  }
}

// ---- where values came from --------------------------------------------------------------

class Source {
 public:
  explicit Source(std::string origin) : origin_(std::move(origin)) {}
  const std::string& origin() const { return origin_; }

  /// Records that the override `text` wrote `key` (a key or a section).
  void add_override(const std::string& key, const std::string& text) {
    overrides_.emplace_back(key, text);
  }
  /// Where the value at `path` came from: the last override that wrote it,
  /// else origin:line of `node`, else the origin.
  std::string where(const std::string& path, const YAML::Node* node) const;
  /// Records where the value at `path` came from, for checks after reading.
  void remember(const std::string& path, const YAML::Node& node) {
    seen_[path] = where(path, &node);
  }
  /// Whether the input (the file or an override) set `path`.
  bool was_set(const std::string& path) const { return seen_.count(path) > 0; }
  /// Where the first of `paths` that the input set came from (a section
  /// matches any key under it); the origin alone when all are defaults.
  std::string where_seen(const std::vector<std::string>& paths) const;

  /// "AT: PATH: got GOT, expected EXPECTED; see docs/config.md".
  [[noreturn]] void fail_at(const std::string& at, const std::string& path, const std::string& got,
                            const std::string& expected) const;
  /// "AT: PATH: PROBLEM; see docs/config.md".
  [[noreturn]] void problem_at(const std::string& at, const std::string& path,
                               const std::string& problem) const;
  /// A check after reading: fails at where `path` (or else the first of
  /// `also`, the other keys of a cross-key check) was set.
  void require(bool ok, const std::string& path, const std::string& got,
               const std::string& expected, std::vector<std::string> also = {}) const;

  /// Reads `node` into `out`; a wrong type is an error naming `path` and
  /// `expected` (by default what any value of type T is).
  template <class T>
  void read(const std::string& path, const YAML::Node& node, T& out,
            const std::string& expected = "") const {
    bool ok = true;
    if constexpr (is_optional<T>::value) {
      typename T::value_type v{};
      ok = node.IsNull() || parse_scalar(node, v);
      if (ok) out = node.IsNull() ? T() : T(v);
    } else if constexpr (is_vector<T>::value) {
      T values;
      ok = node.IsSequence();
      for (size_t i = 0; ok && i < node.size(); ++i) {
        typename T::value_type v{};
        ok = node[i].IsScalar() && parse_scalar(node[i], v);
        values.push_back(v);
      }
      if (ok) out = std::move(values);
    } else {
      ok = parse_scalar(node, out);
    }
    if (!ok) fail_at(where(path, &node), path, show(node), expected.empty() ? expected_text<T>() : expected);
  }

 private:
  std::string origin_;
  // (dotted key, override text), in the order applied; the last one wins.
  std::vector<std::pair<std::string, std::string>> overrides_;
  // Where each key that was present came from.
  std::map<std::string, std::string> seen_;
};

/// Parses YAML text; an empty document is an empty map. ConfigError naming
/// origin:line:column for bad syntax, and for a document that is not a map.
YAML::Node load_yaml(const Source& source, const std::string& text);

}  // namespace shardtrain::config::detail
