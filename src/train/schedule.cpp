// The learning-rate schedule: warmup, then constant, linear or cosine.
#include "shardtrain/train/schedule.h"

#include <algorithm>
#include <cmath>

namespace shardtrain::train {

double scheduled_lr(const config::Config& config, int64_t step) {
  const auto& s = config.schedule;
  const double lr = config.optimizer.lr;
  if (s.warmup_steps > 0 && step < s.warmup_steps) {
    return lr * static_cast<double>(step + 1) / static_cast<double>(s.warmup_steps);
  }
  if (s.name == LrSchedule::Constant) return lr;
  const int64_t decay_steps = std::max<int64_t>(1, config.trainer.max_steps - s.warmup_steps);
  const double progress =
      std::min(1.0, static_cast<double>(step - s.warmup_steps) / static_cast<double>(decay_steps));
  if (s.name == LrSchedule::Linear) return lr + (s.min_lr - lr) * progress;
  // cosine
  return s.min_lr + 0.5 * (lr - s.min_lr) * (1.0 + std::cos(M_PI * progress));
}

}  // namespace shardtrain::train
