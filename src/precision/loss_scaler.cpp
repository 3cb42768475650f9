// DynamicLossScaler: DeepSpeed's dynamic loss scaling state machine
// (deepspeed/runtime/fp16/loss_scaler.py, DynamicLossScaler with
// consecutive_hysteresis=True). No tensors and no communication here: the
// caller passes the found-inf flag every rank already agreed on, so every
// rank runs this machine through the same states.
#include <cmath>
#include <iostream>

#include "shardtrain/core/error.h"
#include "shardtrain/precision/precision.h"

namespace shardtrain::precision {

namespace {
constexpr double kBackoffFactor = 0.5;
constexpr double kGrowthFactor = 2.0;
}  // namespace

DynamicLossScaler::DynamicLossScaler(const LossScalerOptions& options) : options_(options) {
  ST_CHECK(options.loss_scale_window() >= 1, ConfigError, "loss_scale_window must be >= 1, got ",
           options.loss_scale_window(), "; it is the number of clean steps before the scale doubles");
  ST_CHECK(options.hysteresis() >= 1, ConfigError, "hysteresis must be >= 1, got ",
           options.hysteresis(), "; 1 backs off on every overflow");
  ST_CHECK(options.min_loss_scale() > 0 && std::isfinite(options.min_loss_scale()), ConfigError,
           "min_loss_scale must be a positive finite number, got ", options.min_loss_scale());
  ST_CHECK(options.max_skips_at_min() >= 0, ConfigError, "max_skips_at_min must be >= 0, got ",
           options.max_skips_at_min(), " (0 means never fail)");
  const double initial = std::ldexp(1.0, options.initial_scale_power());
  ST_CHECK(std::isfinite(initial) && initial >= options.min_loss_scale(), ConfigError,
           "initial_scale_power ", options.initial_scale_power(), " gives an initial loss scale of ",
           initial, ", which must be finite and at least min_loss_scale (",
           options.min_loss_scale(), "); the default is 16 (65536)");
  state_.scale = initial;
  state_.iteration = 0;
  state_.last_overflow_iteration = -1;
  state_.hysteresis_left = options.hysteresis();
  state_.skips_at_min = 0;
  state_.skipped_steps = 0;
}

void DynamicLossScaler::update(bool found_inf) {
  LossScalerState& s = state_;
  if (found_inf) {
    // The step is skipped. Hysteresis absorbs isolated overflows; once it is
    // used up every further overflow halves the scale, down to the minimum.
    const bool at_min = s.scale <= options_.min_loss_scale();
    if (s.hysteresis_left > 1) {
      --s.hysteresis_left;
    } else {
      s.scale = std::max(s.scale * kBackoffFactor, options_.min_loss_scale());
    }
    s.last_overflow_iteration = s.iteration;
    ++s.skipped_steps;
    ++s.iteration;
    if (at_min) {
      ++s.skips_at_min;
      const bool fatal = options_.max_skips_at_min() > 0 && s.skips_at_min >= options_.max_skips_at_min();
      ST_CHECK(!fatal, Error, "gradients overflowed (inf/NaN) in ", s.skips_at_min,
               " consecutive steps at the minimum loss scale ", options_.min_loss_scale(),
               "; training diverged. Use precision: bf16-mixed or a lower learning rate");
      std::cerr << "shardtrain: warning: step skipped, gradients overflowed (inf/NaN) at the "
                   "minimum loss scale "
                << options_.min_loss_scale() << " (" << s.skips_at_min
                << " consecutive skips at the minimum";
      if (options_.max_skips_at_min() > 0) {
        std::cerr << "; training fails after " << options_.max_skips_at_min();
      }
      std::cerr << "). Consider precision: bf16-mixed or a lower learning rate.\n";
    }
    return;
  }
  // A clean step refills the hysteresis, and the scale grows after
  // loss_scale_window clean steps in a row (counted from the last overflow,
  // or from the start: last_overflow_iteration starts at -1, so the first
  // growth happens on the window-th clean step).
  s.hysteresis_left = options_.hysteresis();
  s.skips_at_min = 0;
  if ((s.iteration - s.last_overflow_iteration) % options_.loss_scale_window() == 0) {
    s.scale *= kGrowthFactor;
  }
  ++s.iteration;
}

}  // namespace shardtrain::precision
