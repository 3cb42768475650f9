// The families' fused activations as autograd functions over
// models/activation_kernels: one pass forward and one backward on contiguous
// fp32 or bf16 CPU tensors; anything else (another dtype or device, a
// strided view) takes LibTorch's ops.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <type_traits>

namespace shardtrain::models::detail {

/// The elements of an fp32 (T = float) or bf16 (T = uint16_t) CPU tensor, as
/// the fused loops take them.
template <typename T>
T* elements(const at::Tensor& t) {
  if constexpr (std::is_same_v<T, float>) {
    return t.data_ptr<float>();
  } else {
    return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>());
  }
}

/// fn(float{}) for an fp32 dtype, fn(uint16_t{}) for bf16: the element type
/// tag elements<T>() takes.
template <typename Fn>
void with_element_type(at::ScalarType dtype, const Fn& fn) {
  if (dtype == at::kFloat) {
    fn(float{});
  } else {
    fn(uint16_t{});
  }
}

/// GELU, tanh approximation (GPT's MLP).
at::Tensor gelu_tanh(const at::Tensor& x);

/// silu(g) * u (Llama's SwiGLU gate); g and u of one shape and dtype.
at::Tensor swiglu(const at::Tensor& g, const at::Tensor& u);

}  // namespace shardtrain::models::detail
