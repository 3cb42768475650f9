// Element-wise reduction kernels for the ring algorithms.
//
// Each kernel reads two inputs and writes one output in a single pass, so the
// cost of a reduce-scatter hop is one streaming pass over the chunk. bfloat16
// and float16 are widened to float32, combined, and rounded once.
#include <algorithm>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cstdint>

#include "comm/detail.h"
#include "shardtrain/core/error.h"

namespace shardtrain::comm::detail {
namespace {

// The type a storage type is combined in.
template <typename T> struct Compute { using type = T; };
template <> struct Compute<c10::BFloat16> { using type = float; };
template <> struct Compute<c10::Half> { using type = float; };

template <typename T, typename F>
void apply(T* dst, const T* a, const T* b, int64_t n, F f) {
  for (int64_t i = 0; i < n; ++i) {
    using C = typename Compute<T>::type;
    dst[i] = static_cast<T>(f(static_cast<C>(a[i]), static_cast<C>(b[i])));
  }
}

template <typename T>
void reduce_typed(T* dst, const T* a, const T* b, int64_t n, ReduceOp op, int avg_divisor) {
  using C = typename Compute<T>::type;
  switch (op) {
    case ReduceOp::Sum:
      apply(dst, a, b, n, [](C x, C y) { return x + y; });
      return;
    case ReduceOp::Avg:
      if (avg_divisor > 0) {
        const C d = static_cast<C>(avg_divisor);
        apply(dst, a, b, n, [d](C x, C y) { return (x + y) / d; });
      } else {
        apply(dst, a, b, n, [](C x, C y) { return x + y; });
      }
      return;
    case ReduceOp::Max:
      // NaN wins, as in torch.max, so a NaN on any rank is seen by all.
      apply(dst, a, b, n, [](C x, C y) { return (x != x || x > y) ? x : y; });
      return;
    case ReduceOp::Min:
      apply(dst, a, b, n, [](C x, C y) { return (x != x || x < y) ? x : y; });
      return;
  }
}

template <typename T>
void divide_typed(T* dst, const T* a, int64_t n, int divisor) {
  using C = typename Compute<T>::type;
  const C d = static_cast<C>(divisor);
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(static_cast<C>(a[i]) / d);
}

// Calls f with a typed null pointer for the storage type of `dtype`.
template <typename F>
void dispatch(DType dtype, F f) {
  switch (dtype) {
    case DType::Float32: return f(static_cast<float*>(nullptr));
    case DType::Float64: return f(static_cast<double*>(nullptr));
    case DType::BFloat16: return f(static_cast<c10::BFloat16*>(nullptr));
    case DType::Float16: return f(static_cast<c10::Half*>(nullptr));
    case DType::Int32: return f(static_cast<int32_t*>(nullptr));
    case DType::Int64: return f(static_cast<int64_t*>(nullptr));
  }
  ST_ASSERT(false, "unknown dtype");
}

}  // namespace

const char* to_string(DType dtype) {
  switch (dtype) {
    case DType::Float32: return "float32";
    case DType::Float64: return "float64";
    case DType::BFloat16: return "bfloat16";
    case DType::Float16: return "float16";
    case DType::Int32: return "int32";
    case DType::Int64: return "int64";
  }
  return "?";
}

size_t element_size(DType dtype) {
  size_t size = 0;
  dispatch(dtype, [&](auto* p) { size = sizeof(*p); });
  return size;
}

void reduce(void* dst, const void* a, const void* b, int64_t n, DType dtype, ReduceOp op,
            int avg_divisor) {
  dispatch(dtype, [&](auto* p) {
    using T = std::remove_pointer_t<decltype(p)>;
    reduce_typed(static_cast<T*>(dst), static_cast<const T*>(a), static_cast<const T*>(b), n,
                 op, avg_divisor);
  });
}

void divide(void* dst, const void* a, int64_t n, DType dtype, int divisor) {
  dispatch(dtype, [&](auto* p) {
    using T = std::remove_pointer_t<decltype(p)>;
    divide_typed(static_cast<T*>(dst), static_cast<const T*>(a), n, divisor);
  });
}

}  // namespace shardtrain::comm::detail
