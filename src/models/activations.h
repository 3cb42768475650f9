// The families' fused activations as autograd functions over
// models/activation_kernels: one pass forward and one backward on contiguous
// fp32 or bf16 CPU tensors; anything else (another dtype or device, a
// strided view) takes LibTorch's ops.
#pragma once

#include <ATen/core/Tensor.h>

namespace shardtrain::models::detail {

/// GELU, tanh approximation (GPT's MLP).
at::Tensor gelu_tanh(const at::Tensor& x);

/// silu(g) * u (Llama's SwiGLU gate); g and u of one shape and dtype.
at::Tensor swiglu(const at::Tensor& g, const at::Tensor& u);

}  // namespace shardtrain::models::detail
