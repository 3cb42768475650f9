// Autograd functions over the fused activation loops (activations.h).
#include "models/activations.h"

#include <ATen/record_function.h>
#include <torch/torch.h>

#include "models/activation_kernels.h"

namespace shardtrain::models::detail {

namespace {

constexpr int64_t kGrain = int64_t{1} << 15;

bool fusable(const at::Tensor& x) {
  return x.is_cpu() && x.is_contiguous() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16);
}

// fn(element type tag, first, count) over `n` elements in parallel chunks,
// the tag float for fp32 tensors and uint16_t for bf16 ones.
template <typename Fn>
void for_chunks(const at::Tensor& like, const Fn& fn) {
  with_element_type(like.scalar_type(), [&](auto tag) {
    at::parallel_for(0, like.numel(), kGrain, [&](int64_t b, int64_t e) { fn(tag, b, e - b); });
  });
}

struct FusedGelu : public torch::autograd::Function<FusedGelu> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x) {
    // Named as LibTorch's own GELU ops are (in a namespace of their own: the
    // profile takes shardtrain:: ranges for phases), so a profile shows these loops.
    RECORD_FUNCTION("fused::gelu", std::vector<c10::IValue>());
    ctx->save_for_backward({x});
    at::Tensor y = at::empty_like(x);
    for_chunks(x, [&](auto tag, int64_t i, int64_t n) {
      using T = decltype(tag);
      gelu_tanh_forward(elements<T>(x) + i, elements<T>(y) + i, n);
    });
    return y;
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    RECORD_FUNCTION("fused::gelu_backward", std::vector<c10::IValue>());
    const at::Tensor x = ctx->get_saved_variables()[0];
    const at::Tensor dy = grads[0].to(x.scalar_type()).contiguous();
    at::Tensor dx = at::empty_like(x);
    for_chunks(x, [&](auto tag, int64_t i, int64_t n) {
      using T = decltype(tag);
      gelu_tanh_backward(elements<T>(x) + i, elements<T>(dy) + i, elements<T>(dx) + i, n);
    });
    return {dx};
  }
};

struct FusedSwiGlu : public torch::autograd::Function<FusedSwiGlu> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& g, const at::Tensor& u) {
    RECORD_FUNCTION("fused::swiglu", std::vector<c10::IValue>());
    ctx->save_for_backward({g, u});
    at::Tensor y = at::empty_like(g);
    for_chunks(g, [&](auto tag, int64_t i, int64_t n) {
      using T = decltype(tag);
      swiglu_forward(elements<T>(g) + i, elements<T>(u) + i, elements<T>(y) + i, n);
    });
    return y;
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    RECORD_FUNCTION("fused::swiglu_backward", std::vector<c10::IValue>());
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &g = saved[0], &u = saved[1];
    const at::Tensor dy = grads[0].to(g.scalar_type()).contiguous();
    at::Tensor dg = at::empty_like(g), du = at::empty_like(u);
    for_chunks(g, [&](auto tag, int64_t i, int64_t n) {
      using T = decltype(tag);
      swiglu_backward(elements<T>(g) + i, elements<T>(u) + i, elements<T>(dy) + i, elements<T>(dg) + i,
                      elements<T>(du) + i, n);
    });
    return {dg, du};
  }
};

}  // namespace

at::Tensor gelu_tanh(const at::Tensor& x) {
  return fusable(x) ? FusedGelu::apply(x) : torch::gelu(x, "tanh");
}

at::Tensor swiglu(const at::Tensor& g, const at::Tensor& u) {
  const bool fused = fusable(g) && u.is_contiguous() && g.sizes() == u.sizes() && g.scalar_type() == u.scalar_type();
  return fused ? FusedSwiGlu::apply(g, u) : at::silu(g) * u;
}

}  // namespace shardtrain::models::detail
