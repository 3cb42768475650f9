// Built with -O3 -ffp-contract=off -fno-math-errno (CMakeLists.txt): the
// compiler vectorises the loop (sqrt without errno) but fuses no multiply-add
// on its own; the two fused multiply-adds below are LibTorch's own (its
// vectorised add with alpha, and addcmul).
#include "train/adamw_kernel.h"

#include <cmath>
#include <string>
#include <vector>

namespace shardtrain::train::detail {

namespace {

// The loop, compiled into each of the entry points below for their
// instruction set (a function without target options inlines into one with).
inline __attribute__((always_inline)) void update(float* __restrict param, const float* __restrict grad,
                                                  float* __restrict exp_avg, float* __restrict exp_avg_sq,
                                                  int64_t n, const AdamWScalars& s) {
  const bool decay = s.decay;
  const float decay_factor = s.decay_factor, beta1 = s.beta1, omb1 = s.one_minus_beta1;
  const float beta2 = s.beta2, omb2 = s.one_minus_beta2, sqrt_bc2 = s.sqrt_bias_correction2;
  const float eps = s.eps, neg_step = s.neg_step_size;
  for (int64_t i = 0; i < n; ++i) {
    const float g = grad[i];
    float p = param[i];
    if (decay) p = p * decay_factor;                              // p.mul_(1 - lr * wd)
    const float m = std::fma(g, omb1, exp_avg[i] * beta1);        // m.mul_(b1).add_(g, 1 - b1)
    const float v = std::fma(omb2 * g, g, exp_avg_sq[i] * beta2);  // v.mul_(b2).addcmul_(g, g, 1 - b2)
    const float denom = std::sqrt(v) / sqrt_bc2 + eps;            // (v.sqrt() / sqrt(bc2)).add_(eps)
    param[i] = p + neg_step * m / denom;                           // p.addcdiv_(m, denom, -step_size)
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
  }
}

using Update = void (*)(float*, const float*, float*, float*, int64_t, const AdamWScalars&);

__attribute__((target("avx512f,avx512vl,fma"))) void update_avx512(
    float* param, const float* grad, float* exp_avg, float* exp_avg_sq, int64_t n, const AdamWScalars& s) {
  update(param, grad, exp_avg, exp_avg_sq, n, s);
}

__attribute__((target("avx2,fma"))) void update_avx2(float* param, const float* grad, float* exp_avg,
                                                     float* exp_avg_sq, int64_t n, const AdamWScalars& s) {
  update(param, grad, exp_avg, exp_avg_sq, n, s);
}

// Without FMA instructions std::fma is a library call: correct, slower.
void update_baseline(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, int64_t n,
                     const AdamWScalars& s) {
  update(param, grad, exp_avg, exp_avg_sq, n, s);
}

struct Variant {
  const char* name;
  Update update;
};

// The variants this CPU runs, best first, by its features (GCC's
// target_clones with arch= would test the CPU model instead, and take the
// baseline on every AMD CPU).
std::vector<Variant> variants() {
  __builtin_cpu_init();
  std::vector<Variant> out;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("fma")) {
    out.push_back({"avx512", update_avx512});
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) out.push_back({"avx2", update_avx2});
  out.push_back({"baseline", update_baseline});
  return out;
}

}  // namespace

AdamWScalars adamw_scalars(double lr, double weight_decay, double beta1, double beta2, double eps,
                           int64_t step) {
  const double bias_correction1 = 1 - std::pow(beta1, static_cast<double>(step));
  const double bias_correction2 = 1 - std::pow(beta2, static_cast<double>(step));
  AdamWScalars s;
  s.decay = weight_decay != 0;
  s.decay_factor = static_cast<float>(1 - lr * weight_decay);
  s.beta1 = static_cast<float>(beta1);
  s.one_minus_beta1 = static_cast<float>(1 - beta1);
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta2 = static_cast<float>(1 - beta2);
  s.sqrt_bias_correction2 = static_cast<float>(std::sqrt(bias_correction2));
  s.eps = static_cast<float>(eps);
  s.neg_step_size = static_cast<float>(-lr / bias_correction1);
  return s;
}

void adamw_update(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, int64_t n,
                  const AdamWScalars& s) {
  static const Update best = variants().front().update;
  best(param, grad, exp_avg, exp_avg_sq, n, s);
}

std::vector<std::string> adamw_update_variants() {
  std::vector<std::string> names;
  for (const Variant& v : variants()) names.emplace_back(v.name);
  return names;
}

void adamw_update_variant(const std::string& name, float* param, const float* grad, float* exp_avg,
                          float* exp_avg_sq, int64_t n, const AdamWScalars& s) {
  for (const Variant& v : variants()) {
    if (name == v.name) return v.update(param, grad, exp_avg, exp_avg_sq, n, s);
  }
}

}  // namespace shardtrain::train::detail
