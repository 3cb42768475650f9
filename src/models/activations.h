// The families' fused activations and the language models' loss as autograd
// functions over models/activation_kernels: one pass forward and one
// backward on contiguous fp32 or bf16 CPU tensors; anything else (another
// dtype or device, a strided view) takes LibTorch's ops.
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

/// The sum over rows of -log softmax(logits[r])[target[r]] for logits
/// [N, V] and targets [N], rows whose target is ignore_index left out: a
/// language model's summed loss. An fp32 scalar (in fp32 arithmetic, summed
/// in double) for fp32 and bf16 logits; a target outside [0, V) that is not
/// ignore_index is an InvalidArgument.
at::Tensor cross_entropy_sum(const at::Tensor& logits, const at::Tensor& target, int64_t ignore_index);

}  // namespace shardtrain::models::detail
