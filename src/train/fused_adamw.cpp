#include "train/fused_adamw.h"

#include <ATen/Parallel.h>
#include <ATen/Functions.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/GradMode.h>

#include <cmath>

#include "train/adamw_kernel.h"

namespace shardtrain::train::detail {

namespace {

// Elements per parallel chunk: big enough that thread start-up is noise.
constexpr int64_t kGrain = int64_t{1} << 16;

bool fused_ok(const torch::Tensor& p, const torch::Tensor& grad, const torch::optim::AdamWOptions& o) {
  return !o.amsgrad() && p.device().is_cpu() && p.scalar_type() == torch::kFloat &&
         grad.scalar_type() == torch::kFloat && grad.layout() == torch::kStrided &&
         p.is_contiguous() && grad.is_contiguous();
}

}  // namespace

torch::Tensor FusedAdamW::step(LossClosure closure) {
  at::NoGradGuard no_grad;
  torch::Tensor loss;
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  for (auto& group : param_groups_) {
    auto& o = static_cast<torch::optim::AdamWOptions&>(group.options());
    const double beta1 = std::get<0>(o.betas());
    const double beta2 = std::get<1>(o.betas());
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      const torch::Tensor& grad = p.grad();
      TORCH_CHECK(!grad.is_sparse(), "AdamW does not support sparse gradients");
      auto& slot = state_[c10::guts::to_string(p.unsafeGetTensorImpl())];
      if (!slot) {
        auto fresh = std::make_unique<torch::optim::AdamWParamState>();
        fresh->step(0);
        fresh->exp_avg(at::zeros_like(p, torch::MemoryFormat::Preserve));
        fresh->exp_avg_sq(at::zeros_like(p, torch::MemoryFormat::Preserve));
        if (o.amsgrad()) fresh->max_exp_avg_sq(at::zeros_like(p, torch::MemoryFormat::Preserve));
        slot = std::move(fresh);
      }
      auto& state = static_cast<torch::optim::AdamWParamState&>(*slot);
      state.step(state.step() + 1);
      torch::Tensor& exp_avg = state.exp_avg();
      torch::Tensor& exp_avg_sq = state.exp_avg_sq();

      if (fused_ok(p, grad, o) && exp_avg.is_contiguous() && exp_avg_sq.is_contiguous() &&
          exp_avg.scalar_type() == torch::kFloat && exp_avg_sq.scalar_type() == torch::kFloat) {
        const AdamWScalars s = adamw_scalars(o.lr(), o.weight_decay(), beta1, beta2, o.eps(), state.step());
        float* pd = p.data_ptr<float>();
        const float* gd = grad.data_ptr<float>();
        float* md = exp_avg.data_ptr<float>();
        float* vd = exp_avg_sq.data_ptr<float>();
        at::parallel_for(0, p.numel(), kGrain, [&](int64_t begin, int64_t end) {
          adamw_update(pd + begin, gd + begin, md + begin, vd + begin, end - begin, s);
        });
        continue;
      }
      // Any other parameter: LibTorch's AdamW arithmetic as tensor ops.
      const double bias_correction1 = 1 - std::pow(beta1, state.step());
      const double bias_correction2 = 1 - std::pow(beta2, state.step());
      const double step_size = o.lr() / bias_correction1;
      if (o.weight_decay() != 0) p.mul_(1 - o.lr() * o.weight_decay());
      exp_avg.mul_(beta1).add_(grad, 1 - beta1);
      exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2);
      torch::Tensor denom;
      if (o.amsgrad()) {
        torch::Tensor& max_exp_avg_sq = state.max_exp_avg_sq();
        at::max_out(max_exp_avg_sq, exp_avg_sq, max_exp_avg_sq);
        denom = (max_exp_avg_sq.sqrt() / std::sqrt(bias_correction2)).add_(o.eps());
      } else {
        denom = (exp_avg_sq.sqrt() / std::sqrt(bias_correction2)).add_(o.eps());
      }
      p.addcdiv_(exp_avg, denom, -step_size);
    }
  }
  return loss;
}

}  // namespace shardtrain::train::detail
