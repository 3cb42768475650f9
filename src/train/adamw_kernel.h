// One pass of AdamW over a contiguous float32 parameter: the same arithmetic,
// in the same order and float rounding, as LibTorch's torch::optim::AdamW
// step (weight decay, both moments, bias-corrected denominator, update), so
// results match it exactly, but reading and writing each element once
// instead of once per tensor op. No LibTorch in this header.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace shardtrain::train::detail {

struct AdamWScalars {
  bool decay = false;        // weight decay != 0
  float decay_factor = 1.f;  // 1 - lr * weight_decay
  float beta1 = 0.9f, one_minus_beta1 = 0.1f;
  float beta2 = 0.999f, one_minus_beta2 = 0.001f;
  float sqrt_bias_correction2 = 1.f;  // sqrt(1 - beta2^step)
  float eps = 1e-8f;
  float neg_step_size = 0.f;  // -lr / (1 - beta1^step)
};

/// The scalars of step `step` (counted from 1) as LibTorch's AdamW ops see
/// them: computed in double, then rounded to float.
AdamWScalars adamw_scalars(double lr, double weight_decay, double beta1, double beta2, double eps,
                           int64_t step);

/// Updates param, exp_avg and exp_avg_sq in place over [0, n), with the
/// best variant of the loop for this CPU.
void adamw_update(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, int64_t n,
                  const AdamWScalars& s);

/// For tests: the variants this CPU can run ("avx512", "avx2", "baseline"),
/// best first, and one of them by name (a no-op for an unknown name).
std::vector<std::string> adamw_update_variants();
void adamw_update_variant(const std::string& name, float* param, const float* grad, float* exp_avg,
                          float* exp_avg_sq, int64_t n, const AdamWScalars& s);

}  // namespace shardtrain::train::detail
