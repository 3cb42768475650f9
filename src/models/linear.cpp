// The linear layers' autograd function (linear.h).
#include "models/linear.h"

#include <ATen/autocast_mode.h>
#include <ATen/record_function.h>
#include <torch/torch.h>

#include <vector>

#include "shardtrain/core/blas.h"

namespace shardtrain::models::detail {

namespace {

thread_local bool in_place_weight_grads = false;

// The weight's .grad() when linear()'s backward may add into it (linear.h).
at::Tensor in_place_target(const at::Tensor& weight) {
  if (!in_place_weight_grads || !weight.is_leaf()) return {};
  const at::Tensor& grad = weight.grad();
  if (!grad.defined() || grad.scalar_type() != at::kFloat || !grad.is_cpu() || !grad.is_contiguous() ||
      grad.sizes() != weight.sizes() || grad.requires_grad()) {
    return {};
  }
  return grad;
}

const uint16_t* bf16_bits(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); }

// c [m, n] (fp32, contiguous) = beta c + a^T b for contiguous a [k, m] and
// b [k, n] of one dtype, fp32 or bf16 (products summed in fp32). False when
// no bf16 GEMM is loaded.
bool add_at_b(const at::Tensor& a, const at::Tensor& b, float beta, const at::Tensor& c) {
  const int64_t m = a.size(1), n = b.size(1), k = a.size(0);
  if (k == 0) {
    if (beta == 0.0f) c.zero_();
    return true;
  }
  RECORD_FUNCTION("fused::linear_weight_grad", std::vector<c10::IValue>());  // a GEMM to profiles
  if (a.scalar_type() == at::kFloat) {
    ::shardtrain::detail::gemm(true, false, m, n, k, a.data_ptr<float>(), m, b.data_ptr<float>(), n, beta,
                               c.data_ptr<float>(), n);
    return true;
  }
  return ::shardtrain::detail::gemm_bf16(true, false, m, n, k, bf16_bits(a), m, bf16_bits(b), n, beta,
                                         c.data_ptr<float>(), n);
}

// y = x W^T + b for an fp32 weight (and bias), computed in fp32 or, under
// CPU autocast to bf16, in bf16 as autocast's linear is: x, W and b rounded
// to bf16 (W and b through autocast's cache of parameter casts), y bf16.
// Backward in the same dtype, except the weight's gradient: summed in fp32
// and never rounded, added into .grad() in place where linear.h allows.
struct Linear : public torch::autograd::Function<Linear> {
  // LibTorch 1.13's custom functions take no undefined tensors: without a
  // bias, `bias` is an empty placeholder and has_bias false.
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& weight, const at::Tensor& bias, bool has_bias, bool bf16) {
    // Autocast's own casts, so the bf16 copy of a weight is made once per
    // accumulation window and shared as autocast shares it.
    const auto cast = [&](const at::Tensor& t) {
      return bf16 ? at::autocast::cached_cast(at::kBFloat16, t, c10::DeviceType::CPU) : t;
    };
    const at::Tensor rows = cast(x.reshape({-1, weight.size(1)})).contiguous();
    const at::Tensor w = cast(weight);
    const at::Tensor y = has_bias ? at::addmm(cast(bias), rows, w.t()) : at::mm(rows, w.t());
    ctx->save_for_backward({rows, w, weight});
    ctx->saved_data["input_sizes"] = x.sizes().vec();
    ctx->saved_data["input_dtype"] = x.scalar_type();
    std::vector<int64_t> sizes = x.sizes().vec();
    sizes.back() = weight.size(0);
    return y.view(sizes);
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& rows = saved[0];  // x as computed with: [N, in], fp32 or bf16
    const at::Tensor& w = saved[1];     // W as computed with
    const at::Tensor& weight = saved[2];
    const int64_t out = w.size(0), in = w.size(1);
    const at::Tensor dy = grads[0].reshape({-1, out}).to(rows.scalar_type()).contiguous();
    at::Tensor dx, dw, db;
    if (ctx->needs_input_grad(0)) {
      dx = at::mm(dy, w).view(ctx->saved_data["input_sizes"].toIntVector())
               .to(ctx->saved_data["input_dtype"].toScalarType());
    }
    if (ctx->needs_input_grad(1)) {
      const at::Tensor target = in_place_target(weight);
      if (!target.defined() || !add_at_b(dy, rows, 1.0f, target)) {
        dw = at::empty({out, in}, weight.options());
        if (!add_at_b(dy, rows, 0.0f, dw)) dw = at::mm(dy.t(), rows).to(at::kFloat);
      }
    }
    if (ctx->needs_input_grad(2)) db = dy.sum(0, /*keepdim=*/false, at::kFloat);
    return {dx, dw, db, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  const bool autocast = at::autocast::is_cpu_enabled();
  const bool bf16 = autocast && at::autocast::get_autocast_cpu_dtype() == at::kBFloat16;
  const auto takes = [&](const at::Tensor& t) {
    return t.is_cpu() && (t.scalar_type() == at::kFloat || (bf16 && t.scalar_type() == at::kBFloat16));
  };
  const bool ours = torch::GradMode::is_enabled() && (bf16 || !autocast) && takes(x) && x.dim() >= 1 &&
                    weight.dim() == 2 && x.size(-1) == weight.size(1) && weight.is_cpu() && weight.scalar_type() == at::kFloat &&
                    (!bias.defined() || (bias.is_cpu() && bias.scalar_type() == at::kFloat));
  if (!ours) return at::linear(x, weight, bias);
  return Linear::apply(x, weight, bias.defined() ? bias : at::empty({0}, weight.options()), bias.defined(),
                       bf16);
}

InPlaceWeightGrads::InPlaceWeightGrads(bool enabled) : previous_(in_place_weight_grads) {
  in_place_weight_grads = enabled;
}

InPlaceWeightGrads::~InPlaceWeightGrads() { in_place_weight_grads = previous_; }

}  // namespace shardtrain::models::detail
