// The key table: every config key declared once, as (name, accessor, check,
// doc), type-erased into Key so that reading, validation, to_yaml() and the
// docs tables are loops over one list (src/config/schema.cpp declares it).
//
//   auto t = section(keys, "trainer", [](auto& c) -> auto& { return c.trainer; });
//   t.key(ST_FIELD(max_steps), at_least(1), "Optimizer steps to run.");
//
// A key's type and default come from its struct; its check is a Rule (a
// predicate, the message's "expected ..." and the docs' "Allowed" text);
// an enum key needs none, its name table is the check.
#pragma once

#include <algorithm>
#include <cstdio>
#include <functional>
#include <initializer_list>
#include <optional>
#include <type_traits>
#include <string>
#include <utility>
#include <vector>

#include "shardtrain/config/config.h"
#include "yaml.h"

/// "name", and an accessor of the plain member `name` of a section.
#define ST_FIELD(name) #name, [](auto& s) -> auto& { return s.name; }
/// "name", and an accessor of the ST_ARG option `name` of a section.
#define ST_OPTION(name) #name, [](auto& s) -> auto& { return s.name(); }

namespace shardtrain::config::detail {

/// One key, type-erased.
struct Key {
  std::string path;     // "trainer.early_stopping.patience"
  std::string type;     // docs: "int"
  std::string allowed;  // docs: "≥ 1"
  std::string doc;      // docs: one line
  std::function<void(const Source&, const YAML::Node&, Config&)> read;
  std::function<std::string(const Config&)> write;  // the value as to_yaml() writes it
  std::function<void(const Source&, const Config&)> check;
};

/// The largest value of an `auto_count` key (ranks per node), as the
/// launcher's --nproc-per-node allows.
constexpr int64_t kMaxAutoCount = 65536;

/// Every key, in the order to_yaml() writes them (sections contiguous).
const std::vector<Key>& keys();
/// The key at `path`, or null.
const Key* find_key(const std::string& path);
/// The checks that involve more than one key (after every key's own check).
void check_relations(const Source& source, const Config& config);
/// The batch section's cross-key checks (batch.cpp), and its text for messages.
void check_batch(const Source& source, const BatchConfig& batch);
std::string batch_text(const BatchConfig& batch);

// ---- rules -------------------------------------------------------------------------------

template <class Pred>
struct Rule {
  Pred ok;
  std::string expected;  // the message's "expected ..."
  std::string allowed;   // the docs' Allowed column
  // The least value of an integer key (at_least): both messages then state
  // the range the key's type and the rule accept together.
  std::optional<int64_t> min_int;

  /// The same check, described otherwise in the docs (cross-key conditions).
  Rule allowing(std::string text) const {
    Rule r = *this;
    r.allowed = std::move(text);
    return r;
  }
};

template <class Pred>
Rule<Pred> rule(Pred ok, std::string expected, std::string allowed) {
  return {std::move(ok), std::move(expected), std::move(allowed), std::nullopt};
}

/// "an integer in [LO, 2^63)": what an integer key of type T with least value
/// `lo` accepts.
template <class T>
std::string integer_range_text(int64_t lo) {
  const char* top = std::is_same_v<T, uint64_t> ? "2^64" : sizeof(T) <= 4 ? "2^31" : "2^63";
  return "an integer in [" + std::to_string(lo) + ", " + top + ")";
}

inline std::string number_text(double x) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", x);
  return buf;
}

/// Any value of the type; `allowed` only documents it.
inline auto any(std::string allowed = "") {
  return rule([](const auto&) { return true; }, "", std::move(allowed));
}
inline auto at_least(int64_t n) {
  auto r = rule([n](auto v) { return static_cast<int64_t>(v) >= n; },
                "an integer >= " + std::to_string(n), "≥ " + std::to_string(n));
  r.min_int = n;
  return r;
}
inline auto at_least_or_null(int64_t n) {
  return rule([n](const std::optional<int64_t>& v) { return !v || *v >= n; },
              "an integer >= " + std::to_string(n), "≥ " + std::to_string(n));
}
inline auto in_range(int64_t lo, int64_t hi, std::string expected) {
  return rule([lo, hi](auto v) { return v >= lo && v <= hi; }, std::move(expected),
              std::to_string(lo) + ".." + std::to_string(hi));
}
inline auto above(double x, std::string expected) {
  return rule([x](double v) { return v > x; }, std::move(expected), "> " + number_text(x));
}
inline auto not_below(double x, std::string expected) {
  return rule([x](double v) { return v >= x; }, std::move(expected), "≥ " + number_text(x));
}
inline auto fraction(std::string expected) {
  return rule([](double v) { return v >= 0.0 && v < 1.0; }, std::move(expected), "[0, 1)");
}
inline auto non_empty(std::string expected) {
  return rule([](const std::string& v) { return !v.empty(); }, std::move(expected), "non-empty");
}
/// One of a closed set of strings.
inline auto one_of_strings(std::vector<std::string> allowed) {
  std::vector<std::string> quoted;
  for (const auto& v : allowed) quoted.push_back("`" + v + "`");
  const std::string names = join(allowed, ", ");
  return rule([allowed](const std::string& v) {
                return std::find(allowed.begin(), allowed.end(), v) != allowed.end();
              },
              "one of: " + names, join(quoted, ", "));
}
/// Some of an enum's values.
template <class E>
auto one_of(std::initializer_list<E> values) {
  std::vector<E> allowed(values);
  std::vector<std::string> names, quoted;
  for (E v : allowed) {
    names.push_back(enum_name(v));
    quoted.push_back(std::string("`") + enum_name(v) + "`");
  }
  return rule([allowed](E v) { return std::find(allowed.begin(), allowed.end(), v) != allowed.end(); },
              "one of: " + join(names, ", "), join(quoted, ", "));
}

// ---- declaring keys ----------------------------------------------------------------------

/// The keys of one section: `get_section` maps a Config (const or not) to it.
template <class GetSection>
class SectionKeys {
 public:
  SectionKeys(std::vector<Key>& out, std::string prefix, GetSection get_section)
      : out_(out), prefix_(std::move(prefix)), get_section_(get_section) {}

  template <class GetField, class Pred>
  SectionKeys& key(const char* name, GetField get_field, Rule<Pred> rule, std::string doc) {
    using Section = std::decay_t<decltype(get_section_(std::declval<Config&>()))>;
    using T = std::decay_t<decltype(get_field(std::declval<Section&>()))>;
    const GetSection get_section = get_section_;
    const auto value = [get_section, get_field](auto& c) -> auto& { return get_field(get_section(c)); };
    Key k;
    k.path = prefix_.empty() ? name : prefix_ + "." + name;
    k.type = type_name<T>();
    k.allowed = rule.allowed;
    if constexpr (has_names<T>::value) {
      if (k.allowed.empty()) k.allowed = "`" + enum_choices<T>("`, `") + "`";
    }
    k.doc = std::move(doc);
    // An enum key restricted to some of its names says which in both messages.
    std::string expected = has_names<T>::value ? rule.expected : "";
    std::string check_expected = rule.expected;
    if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
      // max_steps: 'abc' and -5 alike are told "an integer in [1, 2^63)".
      if (rule.min_int) expected = check_expected = integer_range_text<T>(*rule.min_int);
    }
    k.read = [path = k.path, value, expected](const Source& s, const YAML::Node& node, Config& c) {
      s.read(path, node, value(c), expected);
    };
    k.write = [value](const Config& c) { return format_value(value(c)); };
    k.check = [path = k.path, value, rule, check_expected](const Source& s, const Config& c) {
      const T& v = value(c);
      s.require(rule.ok(v), path, show_value(v), check_expected);
    };
    out_.push_back(std::move(k));
    return *this;
  }

  template <class GetField>
  SectionKeys& key(const char* name, GetField get_field, std::string doc) {
    return key(name, get_field, any(), std::move(doc));
  }

  /// An integer key whose 0 is written `auto` (a count found at start-up).
  template <class GetField>
  SectionKeys& auto_count(const char* name, GetField get_field, std::string doc, int64_t max = kMaxAutoCount);

 private:
  std::vector<Key>& out_;
  std::string prefix_;
  GetSection get_section_;
};

template <class GetSection>
SectionKeys<GetSection> section(std::vector<Key>& out, std::string prefix, GetSection get_section) {
  return SectionKeys<GetSection>(out, std::move(prefix), get_section);
}

template <class GetSection>
template <class GetField>
SectionKeys<GetSection>& SectionKeys<GetSection>::auto_count(const char* name, GetField get_field,
                                                             std::string doc, int64_t max) {
  const GetSection get_section = get_section_;
  const auto value = [get_section, get_field](auto& c) -> auto& { return get_field(get_section(c)); };
  // At most kMaxAutoCount: the count becomes an int (processes, threads);
  // 99999999999 must be refused, not wrapped.
  const std::string expected = "auto or an integer in 1.." + std::to_string(max);
  Key k;
  k.path = prefix_ + "." + name;
  k.type = "`auto` or int";
  k.allowed = "`auto`, 1.." + std::to_string(max) + " (0 also means auto)";
  k.doc = std::move(doc);
  k.read = [path = k.path, value, expected](const Source& s, const YAML::Node& node, Config& c) {
    int64_t v = 0;
    if (node.IsScalar() && node.Scalar() == "auto") {
      value(c) = 0;
    } else if (parse_scalar(node, v)) {
      value(c) = v;
    } else {
      s.fail_at(s.where(path, &node), path, show(node), expected);
    }
  };
  k.write = [value](const Config& c) {
    return value(c) == 0 ? std::string("auto") : std::to_string(value(c));
  };
  k.check = [path = k.path, value, expected, max](const Source& s, const Config& c) {
    s.require(value(c) >= 0 && value(c) <= max, path, std::to_string(value(c)), expected);
  };
  out_.push_back(std::move(k));
  return *this;
}

}  // namespace shardtrain::config::detail
