// One name table per closed set of values. An enum that appears in options
// or in the YAML config declares its names once, next to the enum:
//
//   enum class Sharding { FullShard, ShardGradOp };
//   ST_ENUM_NAMES(Sharding, {Sharding::FullShard, "full_shard"},
//                           {Sharding::ShardGradOp, "shard_grad_op"});
//
// and everything else is derived from that table: enum_name() for messages
// and YAML output, parse_enum() for config values and command-line flags,
// enum_choices() for "is not one of ..." errors and the docs.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "shardtrain/core/error.h"

namespace shardtrain {

/// Declares the name table of enum E; use it in E's own namespace (the
/// table is found by argument-dependent lookup).
#define ST_ENUM_NAMES(E, ...)                                                       \
  inline constexpr std::pair<E, const char*> kEnumNames##E[] = {__VA_ARGS__};      \
  constexpr const auto& enum_name_table(E) { return kEnumNames##E; }

/// The name of `value` ("?" for a value outside the table).
template <class E>
constexpr const char* enum_name(E value) {
  for (const auto& [v, name] : enum_name_table(E{})) {
    if (v == value) return name;
  }
  return "?";
}

/// The value named `name`, or nothing.
template <class E>
std::optional<E> parse_enum(std::string_view name) {
  for (const auto& [v, n] : enum_name_table(E{})) {
    if (name == n) return v;
  }
  return std::nullopt;
}

/// "a, b, c": the names in table order, for error messages and docs.
template <class E>
std::string enum_choices(const char* separator = ", ") {
  std::string out;
  for (const auto& [v, n] : enum_name_table(E{})) {
    if (!out.empty()) out += separator;
    out += n;
  }
  return out;
}

/// The value named `name`; ConfigError naming `key` and the allowed names
/// otherwise (e.g. "distributed.sharding 'full' is not one of ...").
template <class E>
E enum_from_name(std::string_view name, std::string_view key) {
  if (auto v = parse_enum<E>(name)) return *v;
  throw ConfigError(detail::str_cat(key, " '", name, "' is not one of ", enum_choices<E>()));
}

}  // namespace shardtrain
