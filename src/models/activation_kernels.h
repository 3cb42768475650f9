// The families' activations and the language models' cross-entropy, over
// fp32 or bf16 (stored as uint16_t), and attention's softmax rows, over
// fp32, forward and backward, as plain loops that the compiler vectorises.
// No LibTorch.
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

/// Softmax over part of a row of `cols` scores: y[lo, hi) = softmax(scale *
/// x[lo, hi)), every other y 0 (scale > 0, lo < hi <= cols); stats[0, 2)
/// gets the row's largest x and 1 / the sum of its exponentials.
void softmax_row_forward(const float* x, float* y, int64_t cols, int64_t lo, int64_t hi, float scale,
                         float* stats);
/// The same y again from the same x and the forward's stats, element for
/// element as the forward computed it.
void softmax_row_again(const float* x, float* y, int64_t cols, int64_t lo, int64_t hi, float scale,
                       const float* stats);
/// Its backward from the forward's y: dx[lo, hi) = scale * y (dy - sum(y dy)),
/// sums over [lo, hi); every other dx 0.
void softmax_row_backward(const float* y, const float* dy, float* dx, int64_t cols, int64_t lo, int64_t hi,
                          float scale);

/// A row of n logits' cross-entropy, lse - x[target], for lse = log sum e^x
/// computed from the row's maximum (`scratch`: room for n floats); lse goes
/// to *lse. NaN where the row holds NaN or +inf.
float cross_entropy_row_forward(const float* x, float* scratch, int64_t n, int64_t target, float* lse);
float cross_entropy_row_forward(const uint16_t* x, float* scratch, int64_t n, int64_t target, float* lse);
/// Its gradient, scaled by g, from the forward's lse:
/// dx[j] = g (e^(x[j] - lse) - [j == target]).
void cross_entropy_row_backward(const float* x, float* dx, int64_t n, float lse, float g, int64_t target);
void cross_entropy_row_backward(const uint16_t* x, uint16_t* dx, int64_t n, float lse, float g, int64_t target);

/// The instruction set the loops run with on this CPU: "avx512", "avx2" or
/// "baseline".
const char* activation_kernel_variant();

}  // namespace shardtrain::models::detail
