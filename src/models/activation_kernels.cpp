// Built with -O3 -fno-math-errno -fno-trapping-math (CMakeLists.txt) so the
// loops vectorise (selects instead of branches; the exponential computed here,
// not called from libm), and each entry point is compiled for the instruction
// set it names. LibTorch's own GELU and SiLU make a pass per operation, and in
// bf16 round their intermediates (45% of its bf16 GELU results are not the
// exact value rounded once; some left-tail values come out 0) and cost several
// times their fp32 time; these loops make one pass, forward and backward, in
// either dtype.
#include "models/activation_kernels.h"

#include <cmath>
#include <cstring>

namespace shardtrain::models::detail {

namespace {

#define ST_INLINE inline __attribute__((always_inline))

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kCubic = 0.044715f;

ST_INLINE float as_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

ST_INLINE uint32_t as_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
}

struct F32 {
  using T = float;
  static ST_INLINE float load(float v) { return v; }
  static ST_INLINE float store(float v) { return v; }
};

// bf16 is the upper half of an fp32; fp32 -> bf16 rounds to nearest, ties to
// even, and keeps NaN a (quiet) NaN.
struct Bf16 {
  using T = uint16_t;
  static ST_INLINE float load(uint16_t v) { return as_float(static_cast<uint32_t>(v) << 16); }
  static ST_INLINE uint16_t store(float v) {
    const uint32_t bits = as_bits(v);
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    return static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded);
  }
};

// e^z as 2^k e^r for k the integer nearest z / ln2: r = z - k ln2 with
// |r| <= ln2 / 2 (ln2 in two parts, so k ln2 is exact), e^r from its Taylor
// polynomial to r^7 (relative error under 1e-8), 2^k from the exponent bits
// (k from -126 to 127).
ST_INLINE float exp_split(float z, int32_t ki) {
  const float k = static_cast<float>(ki);
  const float r = (z - k * 0.693145751953125f) - k * 1.4286068203094173e-6f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  return p * as_float(static_cast<uint32_t>(ki + 127) << 23);
}

// e^|a|, for |a| up to 88 (larger |a|, and NaN, count as 88: e^88 is near the
// top of fp32, and whatever divides by it comes out under 1e-38, which stands
// for 0).
ST_INLINE float exp_abs(float a) {
  const float abs = std::fabs(a);
  const float z = abs < 88.0f ? abs : 88.0f;
  return exp_split(z, static_cast<int32_t>(z * 1.4426950408889634f + 0.5f));  // z >= 0: truncation rounds
}

// ---- GELU ------------------------------------------------------------------------------

// With u = sqrt(2/pi) (x + 0.044715 x^3) and s = 1 - tanh(|u|) =
// 2 / (e^(2|u|) + 1), computed without cancellation: 1 + tanh(u) is s where u
// < 0 and 2 - s elsewhere, so GELU keeps its relative precision in the left
// tail (1e-15 and less), and 1 - tanh(u)^2 = s (2 - s).
struct Gelu {
  float u, s, one_plus_tanh;
  ST_INLINE explicit Gelu(float v, float v2) {
    u = kSqrt2OverPi * v * (1.0f + kCubic * v2);
    s = 2.0f / (exp_abs(2.0f * u) + 1.0f);
    one_plus_tanh = u < 0.0f ? s : 2.0f - s;
  }
};

template <typename D>
ST_INLINE void gelu_forward(const typename D::T* __restrict x, typename D::T* __restrict y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = D::load(x[i]);
    const Gelu g(v, v * v);
    y[i] = D::store(0.5f * v * g.one_plus_tanh);
  }
}

// d/dx: 0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2).
template <typename D>
ST_INLINE void gelu_backward(const typename D::T* __restrict x, const typename D::T* __restrict dy,
                             typename D::T* __restrict dx, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = D::load(x[i]);
    const float v2 = v * v;
    const Gelu g(v, v2);
    const float slope =
        0.5f * g.one_plus_tanh + 0.5f * v * (g.s * (2.0f - g.s)) * kSqrt2OverPi * (1.0f + 3.0f * kCubic * v2);
    dx[i] = D::store(D::load(dy[i]) * slope);
  }
}

// ---- SwiGLU ----------------------------------------------------------------------------

// sigmoid(g) from E = e^|g|: E / (1 + E) where g >= 0, 1 / (1 + E) where g < 0
// (no cancellation on either side).
ST_INLINE float sigmoid(float g) {
  const float e = exp_abs(g);
  const float inv = 1.0f / (1.0f + e);
  return g < 0.0f ? inv : e * inv;
}

template <typename D>
ST_INLINE void swiglu_fwd(const typename D::T* __restrict g, const typename D::T* __restrict u,
                          typename D::T* __restrict y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float gv = D::load(g[i]);
    y[i] = D::store(gv * sigmoid(gv) * D::load(u[i]));
  }
}

// silu'(g) = sigmoid(g) (1 + g (1 - sigmoid(g))).
template <typename D>
ST_INLINE void swiglu_bwd(const typename D::T* __restrict g, const typename D::T* __restrict u,
                          const typename D::T* __restrict dy, typename D::T* __restrict dg,
                          typename D::T* __restrict du, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float gv = D::load(g[i]), uv = D::load(u[i]), d = D::load(dy[i]);
    const float sg = sigmoid(gv);
    const float silu = gv * sg;
    du[i] = D::store(d * silu);
    dg[i] = D::store(d * uv * (sg * (1.0f + gv * (1.0f - sg))));
  }
}

// ---- softmax over a row's visible range --------------------------------------------------

// e^z for z <= 0: 0 below -87 (where e^z < 2e-38, under fp32's normal range),
// NaN for NaN.
ST_INLINE float exp_nonpositive(float z) {
  const float c = z < -87.0f ? -87.0f : z;  // NaN stays NaN
  const float e = exp_split(c, static_cast<int32_t>(c * 1.4426950408889634f - 0.5f));  // c <= 0: truncation rounds
  return z >= -87.0f ? e : 0.0f * e;  // with 0.0f alone the loop stays scalar
}

// The reductions (maximum, sums) over 16 lanes of GCC's generic vectors,
// which each variant compiles to its own registers: the compiler vectorises
// no float reduction itself without reassociating it. The lanes combine in
// a fixed order.
using Lanes = float __attribute__((vector_size(64)));
constexpr int64_t kLanes = 16;

ST_INLINE Lanes load_lanes(const float* p) {
  Lanes v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

ST_INLINE Lanes load_lanes(const uint16_t* p) {
  using Half = uint16_t __attribute__((vector_size(32)));
  using Wide = uint32_t __attribute__((vector_size(64)));
  Half h;
  std::memcpy(&h, p, sizeof h);
  return reinterpret_cast<Lanes>(__builtin_convertvector(h, Wide) << 16);
}

ST_INLINE float lane_sum(Lanes v) {
  float sum = 0.0f;
  for (int64_t l = 0; l < kLanes; ++l) sum += v[l];
  return sum;
}

// The largest of x[0, n), NaN ignored.
template <typename D>
ST_INLINE float row_max(const typename D::T* x, int64_t n) {
  Lanes lanes = Lanes{} - __builtin_inff();
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const Lanes v = load_lanes(x + j);
    lanes = v > lanes ? v : lanes;
  }
  float m = -__builtin_inff();
  for (int64_t l = 0; l < kLanes; ++l) m = lanes[l] > m ? lanes[l] : m;
  for (; j < n; ++j) m = D::load(x[j]) > m ? D::load(x[j]) : m;
  return m;
}

// The sum of e[0, n).
ST_INLINE float row_sum(const float* e, int64_t n) {
  Lanes lanes = Lanes{};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) lanes += load_lanes(e + j);
  float sum = lane_sum(lanes);
  for (; j < n; ++j) sum += e[j];
  return sum;
}

// The sum of a[j] * b[j] over [0, n).
ST_INLINE float row_dot(const float* a, const float* b, int64_t n) {
  Lanes lanes = Lanes{};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) lanes += load_lanes(a + j) * load_lanes(b + j);
  float sum = lane_sum(lanes);
  for (; j < n; ++j) sum += a[j] * b[j];
  return sum;
}

// y[lo, hi) = softmax(scale x[lo, hi)), the rest of the row's `cols` 0;
// stats gets the row's maximum and 1 / sum. A NaN or +inf score makes the
// row NaN: its difference from the maximum is NaN, so is its exponential
// and the sum.
ST_INLINE void softmax_fwd(const float* __restrict x, float* __restrict y, int64_t cols, int64_t lo, int64_t hi,
                           float scale, float* stats) {
  const int64_t n = hi - lo;
  const float m = row_max<F32>(x + lo, n);
  for (int64_t i = lo; i < hi; ++i) y[i] = exp_nonpositive((x[i] - m) * scale);
  const float inv = 1.0f / row_sum(y + lo, n);
  for (int64_t i = 0; i < lo; ++i) y[i] = 0.0f;
  for (int64_t i = lo; i < hi; ++i) y[i] *= inv;
  for (int64_t i = hi; i < cols; ++i) y[i] = 0.0f;
  stats[0] = m;
  stats[1] = inv;
}

// The forward's y again from x and the forward's stats, the same arithmetic
// element by element.
ST_INLINE void softmax_again(const float* __restrict x, float* __restrict y, int64_t cols, int64_t lo,
                             int64_t hi, float scale, const float* stats) {
  const float m = stats[0], inv = stats[1];
  for (int64_t i = 0; i < lo; ++i) y[i] = 0.0f;
  for (int64_t i = lo; i < hi; ++i) y[i] = exp_nonpositive((x[i] - m) * scale) * inv;
  for (int64_t i = hi; i < cols; ++i) y[i] = 0.0f;
}

// dx[lo, hi) = scale y (dy - sum(y dy)) over [lo, hi), the rest 0.
ST_INLINE void softmax_bwd(const float* __restrict y, const float* __restrict dy, float* __restrict dx,
                           int64_t cols, int64_t lo, int64_t hi, float scale) {
  const float dot = row_dot(y + lo, dy + lo, hi - lo);
  for (int64_t i = 0; i < lo; ++i) dx[i] = 0.0f;
  for (int64_t i = lo; i < hi; ++i) dx[i] = scale * y[i] * (dy[i] - dot);
  for (int64_t i = hi; i < cols; ++i) dx[i] = 0.0f;
}

// ---- cross-entropy over a row of logits ---------------------------------------------

// A row's loss, lse - x[target], for lse = log sum e^x over x[0, n), taken
// from the row's maximum m: m + log sum e^(x - m) (the exponentials go to
// `e`); lse to *lse. NaN where the row holds NaN or +inf, or is all -inf.
template <typename D>
ST_INLINE float cross_entropy_fwd(const typename D::T* __restrict x, float* __restrict e, int64_t n,
                                  int64_t target, float* lse) {
  const float m = row_max<D>(x, n);
  for (int64_t j = 0; j < n; ++j) e[j] = exp_nonpositive(D::load(x[j]) - m);
  *lse = m + std::log(row_sum(e, n));
  return *lse - D::load(x[target]);
}

// The gradient of g (lse - x[target]) over x[0, n) for lse as above:
// dx[j] = g (e^(x[j] - lse) - [j == target]). (x - lse <= 0: lse is at
// least the maximum, the sum of exponentials at least the maximum's 1.)
template <typename D>
ST_INLINE void cross_entropy_bwd(const typename D::T* __restrict x, typename D::T* __restrict dx, int64_t n,
                                 float lse, float g, int64_t target) {
  for (int64_t j = 0; j < n; ++j) dx[j] = D::store(g * exp_nonpositive(D::load(x[j]) - lse));
  dx[target] = D::store(g * (exp_nonpositive(D::load(x[target]) - lse) - 1.0f));
}

// ---- one entry point per instruction set and element type ---------------------------

#define ST_ACTIVATION_VARIANT(NAME, TARGET)                                                          \
  TARGET void gelu_fwd_f32_##NAME(const float* x, float* y, int64_t n) { gelu_forward<F32>(x, y, n); } \
  TARGET void gelu_fwd_bf16_##NAME(const uint16_t* x, uint16_t* y, int64_t n) {                      \
    gelu_forward<Bf16>(x, y, n);                                                                     \
  }                                                                                                  \
  TARGET void gelu_bwd_f32_##NAME(const float* x, const float* dy, float* dx, int64_t n) {           \
    gelu_backward<F32>(x, dy, dx, n);                                                                \
  }                                                                                                  \
  TARGET void gelu_bwd_bf16_##NAME(const uint16_t* x, const uint16_t* dy, uint16_t* dx, int64_t n) { \
    gelu_backward<Bf16>(x, dy, dx, n);                                                               \
  }                                                                                                  \
  TARGET void swiglu_fwd_f32_##NAME(const float* g, const float* u, float* y, int64_t n) {           \
    swiglu_fwd<F32>(g, u, y, n);                                                                     \
  }                                                                                                  \
  TARGET void swiglu_fwd_bf16_##NAME(const uint16_t* g, const uint16_t* u, uint16_t* y, int64_t n) { \
    swiglu_fwd<Bf16>(g, u, y, n);                                                                    \
  }                                                                                                  \
  TARGET void swiglu_bwd_f32_##NAME(const float* g, const float* u, const float* dy, float* dg,      \
                                    float* du, int64_t n) {                                          \
    swiglu_bwd<F32>(g, u, dy, dg, du, n);                                                            \
  }                                                                                                  \
  TARGET void swiglu_bwd_bf16_##NAME(const uint16_t* g, const uint16_t* u, const uint16_t* dy,       \
                                     uint16_t* dg, uint16_t* du, int64_t n) {                        \
    swiglu_bwd<Bf16>(g, u, dy, dg, du, n);                                                           \
  }                                                                                                  \
  TARGET void softmax_fwd_f32_##NAME(const float* x, float* y, int64_t c, int64_t lo, int64_t hi, float s, \
                                     float* st) {                                                    \
    softmax_fwd(x, y, c, lo, hi, s, st);                                                             \
  }                                                                                                  \
  TARGET void softmax_again_f32_##NAME(const float* x, float* y, int64_t c, int64_t lo, int64_t hi, float s, \
                                       const float* st) {                                            \
    softmax_again(x, y, c, lo, hi, s, st);                                                           \
  }                                                                                                  \
  TARGET void softmax_bwd_f32_##NAME(const float* y, const float* dy, float* dx, int64_t c, int64_t lo, \
                                     int64_t hi, float s) {                                          \
    softmax_bwd(y, dy, dx, c, lo, hi, s);                                                            \
  }                                                                                                  \
  TARGET float xent_fwd_f32_##NAME(const float* x, float* e, int64_t n, int64_t t, float* lse) {     \
    return cross_entropy_fwd<F32>(x, e, n, t, lse);                                                  \
  }                                                                                                  \
  TARGET float xent_fwd_bf16_##NAME(const uint16_t* x, float* e, int64_t n, int64_t t, float* lse) { \
    return cross_entropy_fwd<Bf16>(x, e, n, t, lse);                                                 \
  }                                                                                                  \
  TARGET void xent_bwd_f32_##NAME(const float* x, float* dx, int64_t n, float lse, float g, int64_t t) { \
    cross_entropy_bwd<F32>(x, dx, n, lse, g, t);                                                     \
  }                                                                                                  \
  TARGET void xent_bwd_bf16_##NAME(const uint16_t* x, uint16_t* dx, int64_t n, float lse, float g,   \
                                   int64_t t) {                                                      \
    cross_entropy_bwd<Bf16>(x, dx, n, lse, g, t);                                                    \
  }

ST_ACTIVATION_VARIANT(avx512, __attribute__((target("avx512f,avx512vl,avx512bw,fma"))))
ST_ACTIVATION_VARIANT(avx2, __attribute__((target("avx2,fma"))))
ST_ACTIVATION_VARIANT(baseline, )
#undef ST_ACTIVATION_VARIANT

struct Kernels {
  const char* name;
  void (*gelu_fwd_f32)(const float*, float*, int64_t);
  void (*gelu_fwd_bf16)(const uint16_t*, uint16_t*, int64_t);
  void (*gelu_bwd_f32)(const float*, const float*, float*, int64_t);
  void (*gelu_bwd_bf16)(const uint16_t*, const uint16_t*, uint16_t*, int64_t);
  void (*swiglu_fwd_f32)(const float*, const float*, float*, int64_t);
  void (*swiglu_fwd_bf16)(const uint16_t*, const uint16_t*, uint16_t*, int64_t);
  void (*swiglu_bwd_f32)(const float*, const float*, const float*, float*, float*, int64_t);
  void (*swiglu_bwd_bf16)(const uint16_t*, const uint16_t*, const uint16_t*, uint16_t*, uint16_t*, int64_t);
  void (*softmax_fwd_f32)(const float*, float*, int64_t, int64_t, int64_t, float, float*);
  void (*softmax_again_f32)(const float*, float*, int64_t, int64_t, int64_t, float, const float*);
  void (*softmax_bwd_f32)(const float*, const float*, float*, int64_t, int64_t, int64_t, float);
  float (*xent_fwd_f32)(const float*, float*, int64_t, int64_t, float*);
  float (*xent_fwd_bf16)(const uint16_t*, float*, int64_t, int64_t, float*);
  void (*xent_bwd_f32)(const float*, float*, int64_t, float, float, int64_t);
  void (*xent_bwd_bf16)(const uint16_t*, uint16_t*, int64_t, float, float, int64_t);
};

#define ST_KERNELS(NAME)                                                                                 \
  Kernels {                                                                                              \
    #NAME, gelu_fwd_f32_##NAME, gelu_fwd_bf16_##NAME, gelu_bwd_f32_##NAME, gelu_bwd_bf16_##NAME,         \
        swiglu_fwd_f32_##NAME, swiglu_fwd_bf16_##NAME, swiglu_bwd_f32_##NAME, swiglu_bwd_bf16_##NAME,   \
        softmax_fwd_f32_##NAME, softmax_again_f32_##NAME, softmax_bwd_f32_##NAME,                       \
        xent_fwd_f32_##NAME, xent_fwd_bf16_##NAME, xent_bwd_f32_##NAME, xent_bwd_bf16_##NAME            \
  }

// The best variant this CPU runs, chosen by its features once.
const Kernels& kernels() {
  static const Kernels chosen = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("fma")) {
      return ST_KERNELS(avx512);
    }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return ST_KERNELS(avx2);
    return ST_KERNELS(baseline);
  }();
  return chosen;
}
#undef ST_KERNELS

}  // namespace

void gelu_tanh_forward(const float* x, float* y, int64_t n) { kernels().gelu_fwd_f32(x, y, n); }
void gelu_tanh_forward(const uint16_t* x, uint16_t* y, int64_t n) { kernels().gelu_fwd_bf16(x, y, n); }
void gelu_tanh_backward(const float* x, const float* dy, float* dx, int64_t n) {
  kernels().gelu_bwd_f32(x, dy, dx, n);
}
void gelu_tanh_backward(const uint16_t* x, const uint16_t* dy, uint16_t* dx, int64_t n) {
  kernels().gelu_bwd_bf16(x, dy, dx, n);
}
void swiglu_forward(const float* g, const float* u, float* y, int64_t n) { kernels().swiglu_fwd_f32(g, u, y, n); }
void swiglu_forward(const uint16_t* g, const uint16_t* u, uint16_t* y, int64_t n) {
  kernels().swiglu_fwd_bf16(g, u, y, n);
}
void swiglu_backward(const float* g, const float* u, const float* dy, float* dg, float* du, int64_t n) {
  kernels().swiglu_bwd_f32(g, u, dy, dg, du, n);
}
void swiglu_backward(const uint16_t* g, const uint16_t* u, const uint16_t* dy, uint16_t* dg, uint16_t* du,
                     int64_t n) {
  kernels().swiglu_bwd_bf16(g, u, dy, dg, du, n);
}
void softmax_row_forward(const float* x, float* y, int64_t cols, int64_t lo, int64_t hi, float scale,
                         float* stats) {
  kernels().softmax_fwd_f32(x, y, cols, lo, hi, scale, stats);
}
void softmax_row_again(const float* x, float* y, int64_t cols, int64_t lo, int64_t hi, float scale,
                       const float* stats) {
  kernels().softmax_again_f32(x, y, cols, lo, hi, scale, stats);
}
void softmax_row_backward(const float* y, const float* dy, float* dx, int64_t cols, int64_t lo, int64_t hi,
                          float scale) {
  kernels().softmax_bwd_f32(y, dy, dx, cols, lo, hi, scale);
}
float cross_entropy_row_forward(const float* x, float* scratch, int64_t n, int64_t target, float* lse) {
  return kernels().xent_fwd_f32(x, scratch, n, target, lse);
}
float cross_entropy_row_forward(const uint16_t* x, float* scratch, int64_t n, int64_t target, float* lse) {
  return kernels().xent_fwd_bf16(x, scratch, n, target, lse);
}
void cross_entropy_row_backward(const float* x, float* dx, int64_t n, float lse, float g, int64_t target) {
  kernels().xent_bwd_f32(x, dx, n, lse, g, target);
}
void cross_entropy_row_backward(const uint16_t* x, uint16_t* dx, int64_t n, float lse, float g, int64_t target) {
  kernels().xent_bwd_bf16(x, dx, n, lse, g, target);
}
const char* activation_kernel_variant() { return kernels().name; }

#undef ST_INLINE

}  // namespace shardtrain::models::detail
