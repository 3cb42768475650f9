// Batch arithmetic: global = micro × accumulate × world_size. Loading refuses
// what no world size can fix; resolve_batch() derives the missing number once
// the world size is known, and shows the arithmetic when the three disagree.
#include "key_table.h"

namespace shardtrain::config {
namespace detail {

using shardtrain::detail::str_cat;

namespace {

bool checked_mul(int64_t a, int64_t b, int64_t& out) { return !__builtin_mul_overflow(a, b, &out); }

}  // namespace

std::string batch_text(const BatchConfig& b) {
  const auto one = [](const std::optional<int64_t>& v) { return format_value(v); };
  return str_cat("{global: ", one(b.global), ", micro: ", one(b.micro),
                 ", accumulate: ", one(b.accumulate), "}");
}

void check_batch(const Source& s, const BatchConfig& b) {
  const int given = (b.global ? 1 : 0) + (b.micro ? 1 : 0) + (b.accumulate ? 1 : 0);
  s.require(given >= 2, "batch", batch_text(b),
            "at least two of batch.global, batch.micro, batch.accumulate "
            "(global = micro × accumulate × world_size derives the third)");
  // What no world size can fix is an error now; the rest waits for resolve_batch().
  if (b.global && b.micro && b.accumulate) {
    int64_t unit = 0;
    const bool fits = checked_mul(*b.micro, *b.accumulate, unit);
    s.require(fits && *b.global % unit == 0, "batch.global", std::to_string(*b.global),
              str_cat("a multiple of batch.micro × batch.accumulate = ", *b.micro, " × ",
                      *b.accumulate, " = ", unit,
                      " for any world size; or set one of the three to null to derive it"),
              {"batch.micro", "batch.accumulate"});
  } else if (b.global && (b.micro || b.accumulate)) {
    const char* name = b.micro ? "batch.micro" : "batch.accumulate";
    const int64_t other = b.micro ? *b.micro : *b.accumulate;
    s.require(*b.global % other == 0, "batch.global", std::to_string(*b.global),
              str_cat("a multiple of ", name, "=", other), {name});
  }
}

namespace {

// The world size and each batch number given: whole numbers of at least one.
void check_resolvable(const BatchConfig& b, int world_size) {
  if (world_size < 1) {
    throw ConfigError(str_cat("batch: world_size ", world_size,
                              " is not a number of ranks; it must be >= 1"));
  }
  const auto check_positive = [&](const char* name, const std::optional<int64_t>& v) {
    if (v && *v < 1) {
      throw ConfigError(str_cat("batch.", name, ": got ", *v, ", expected an integer >= 1 or null; ",
                                kDocsHint));
    }
  };
  check_positive("global", b.global);
  check_positive("micro", b.micro);
  check_positive("accumulate", b.accumulate);
}

// All three given: they must agree at this world size.
BatchPlan all_three(const BatchConfig& b, int64_t world) {
  int64_t per_world = 0;
  int64_t product = 0;
  const bool fits = checked_mul(*b.micro, *b.accumulate, per_world) &&
                    checked_mul(per_world, world, product);
  if (!fits || product != *b.global) {
    throw ConfigError(str_cat(
        "batch: batch.micro × batch.accumulate × world_size = ", *b.micro, " × ", *b.accumulate,
        " × ", world, " = ", fits ? std::to_string(product) : std::string("(overflow)"),
        " ≠ batch.global=", *b.global,
        "; give only two of the three (set one to null) and the third is derived"));
  }
  return {*b.global, *b.micro, *b.accumulate};
}

// Measured load balancing: the global batch and accumulate or micro given.
BatchPlan measured_shares(const BatchConfig& b, int64_t world) {
  int64_t unit = 0;
  const int64_t accumulate = b.accumulate ? *b.accumulate
                             : checked_mul(*b.micro, world, unit) ? (*b.global + unit - 1) / unit
                                                                  : 1;
  return {*b.global, (*b.global + accumulate * world - 1) / (accumulate * world), accumulate};
}

// Two of the three given: the third derived, when the two divide evenly.
BatchPlan derive_third(const BatchConfig& b, int64_t world) {
  if (b.global && b.micro) {
    int64_t unit = 0;
    if (!checked_mul(*b.micro, world, unit) || *b.global % unit != 0) {
      throw ConfigError(str_cat(
          "batch: batch.global=", *b.global, " is not divisible by batch.micro=", *b.micro,
          " × world_size=", world, " = ", unit, "; make batch.global a multiple of ", unit,
          " or change batch.micro"));
    }
    return {*b.global, *b.micro, *b.global / unit};
  }
  if (b.global && b.accumulate) {
    int64_t unit = 0;
    if (!checked_mul(*b.accumulate, world, unit) || *b.global % unit != 0) {
      throw ConfigError(str_cat(
          "batch: batch.global=", *b.global, " is not divisible by batch.accumulate=",
          *b.accumulate, " × world_size=", world, " = ", unit,
          "; make batch.global a multiple of ", unit, " or change batch.accumulate"));
    }
    return {*b.global, *b.global / unit, *b.accumulate};
  }
  if (b.micro && b.accumulate) {
    int64_t per_world = 0;
    int64_t global = 0;
    if (!checked_mul(*b.micro, *b.accumulate, per_world) ||
        !checked_mul(per_world, world, global)) {
      throw ConfigError(str_cat("batch: batch.micro × batch.accumulate × world_size = ", *b.micro,
                                " × ", *b.accumulate, " × ", world,
                                " overflows; use smaller batch numbers"));
    }
    return {global, *b.micro, *b.accumulate};
  }
  throw ConfigError(str_cat("batch: got ", batch_text(b),
                            ", expected at least two of batch.global, batch.micro and "
                            "batch.accumulate (global = micro × accumulate × world_size "
                            "derives the third); ",
                            kDocsHint));
}

}  // namespace

}  // namespace detail

BatchPlan Config::resolve_batch(int world_size) const {
  const BatchConfig& b = batch;
  detail::check_resolvable(b, world_size);
  const int64_t world = world_size;
  if (b.global && b.micro && b.accumulate) return detail::all_three(b, world);
  // Measured load balancing splits each micro-step's rows by the ranks'
  // shares, so the global batch need not divide by the world: accumulate is
  // as given (or the fewest micro-steps of batch.micro rows per rank), micro
  // the even share rounded up (a rank may get none).
  if (distributed.load_balance() == train::LoadBalance::Measured && b.global && !(b.micro && b.accumulate)) {
    return detail::measured_shares(b, world);
  }
  return detail::derive_third(b, world);
}

}  // namespace shardtrain::config
