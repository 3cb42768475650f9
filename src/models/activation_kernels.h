// The families' activations, forward and backward, as plain loops over fp32
// or bf16 (stored as uint16_t) that the compiler vectorises. No LibTorch.
//
// bf16 values are widened to fp32, computed in fp32 and rounded to nearest
// even once per output.
#pragma once

#include <cstdint>

namespace shardtrain::models::detail {

/// GELU, tanh approximation: y = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
void gelu_tanh_forward(const float* x, float* y, int64_t n);
void gelu_tanh_forward(const uint16_t* x, uint16_t* y, int64_t n);
/// dx = dy * d gelu(x) / dx.
void gelu_tanh_backward(const float* x, const float* dy, float* dx, int64_t n);
void gelu_tanh_backward(const uint16_t* x, const uint16_t* dy, uint16_t* dx, int64_t n);

/// SwiGLU's gate: y = silu(g) * u, silu(g) = g / (1 + e^-g).
void swiglu_forward(const float* g, const float* u, float* y, int64_t n);
void swiglu_forward(const uint16_t* g, const uint16_t* u, uint16_t* y, int64_t n);
/// dg = dy * u * silu'(g), du = dy * silu(g).
void swiglu_backward(const float* g, const float* u, const float* dy, float* dg, float* du, int64_t n);
void swiglu_backward(const uint16_t* g, const uint16_t* u, const uint16_t* dy, uint16_t* dg, uint16_t* du,
                     int64_t n);

/// The instruction set the loops run with on this CPU: "avx512", "avx2" or
/// "baseline".
const char* activation_kernel_variant();

}  // namespace shardtrain::models::detail
