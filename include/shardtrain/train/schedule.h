// The learning-rate schedule the Trainer follows: a pure function of the
// step, so a resumed run continues it exactly.
#pragma once

#include <cstdint>

#include "shardtrain/config/config.h"

namespace shardtrain::train {

/// Learning rate of `step` (0-based): linear warmup over warmup_steps to lr,
/// then constant, linear decay to min_lr at max_steps, or cosine to min_lr.
double scheduled_lr(const config::Config& config, int64_t step);

}  // namespace shardtrain::train
