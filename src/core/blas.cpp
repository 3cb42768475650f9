#include "shardtrain/core/blas.h"

#include <dlfcn.h>

#include <cstdlib>

#include "shardtrain/core/error.h"

namespace shardtrain {

namespace {

template <typename F>
F loaded_symbol(const char* name) {  // from any library this process has loaded
  return reinterpret_cast<F>(dlsym(RTLD_DEFAULT, name));
}

bool cpu_has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512cd") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vl");
}

bool cpu_has_avx512_bf16() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512bf16");
}

}  // namespace

std::string blas_core() {
  using CoreName = char* (*)();
  const auto name = loaded_symbol<CoreName>("openblas_get_corename");
  const char* core = name ? name() : nullptr;
  return core ? core : "";
}

void set_blas_threads(int threads) {
  using SetThreads = void (*)(int);
  if (const auto set = loaded_symbol<SetThreads>("openblas_set_num_threads")) set(threads);
}

std::string blas_coretype_warning() {
  const char* forced = std::getenv("OPENBLAS_CORETYPE");
  const std::string core = blas_core();
  if (forced == nullptr || !detail::blas_core_below_cpu(core, cpu_has_avx512())) return "";
  return "OPENBLAS_CORETYPE=" + std::string(forced) + " holds OpenBLAS to its " + core +
         " kernels on a CPU with AVX-512, where fp32 GEMMs run about half as fast; unset it to "
         "let OpenBLAS choose";
}

std::string blas_coretype_to_set() {
  const char* forced = std::getenv("OPENBLAS_CORETYPE");
  return detail::blas_coretype_to_set(blas_core(), cpu_has_avx512(), cpu_has_avx512_bf16(),
                                      forced != nullptr);
}

namespace detail {

void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
          int64_t ldb, float beta, float* c, int64_t ldc) {
  using Sgemm = void (*)(const char*, const char*, const int*, const int*, const int*, const float*,
                         const float*, const int*, const float*, const int*, const float*, float*, const int*);
  static const Sgemm sgemm = [] {
    const auto fn = loaded_symbol<Sgemm>("sgemm_");
    ST_CHECK(fn != nullptr, Error, "no BLAS sgemm_ is loaded beside LibTorch; "
             "install the BLAS LibTorch was built with (libopenblas0)");
    return fn;
  }();
  // Column-major BLAS sees each row-major matrix transposed: c^T = b^T a^T.
  const char transa = ta ? 'T' : 'N', transb = tb ? 'T' : 'N';
  const int cm = static_cast<int>(n), cn = static_cast<int>(m), ck = static_cast<int>(k);
  const int la = static_cast<int>(ldb), lb = static_cast<int>(lda), lc = static_cast<int>(ldc);
  const float one = 1.0f;
  sgemm(&transb, &transa, &cm, &cn, &ck, &one, b, &la, a, &lb, &beta, c, &lc);
}

bool gemm_bf16(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const uint16_t* a, int64_t lda,
               const uint16_t* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  // oneDNN's BLAS-like call takes row-major matrices and returns a status.
  using Gemm = int (*)(char, char, int64_t, int64_t, int64_t, float, const uint16_t*, int64_t,
                       const uint16_t*, int64_t, float, float*, int64_t);
  static const Gemm fn = loaded_symbol<Gemm>("dnnl_gemm_bf16bf16f32");
  if (fn == nullptr) return false;
  constexpr int kSuccess = 0;
  const int status = fn(ta ? 'T' : 'N', tb ? 'T' : 'N', m, n, k, 1.0f, a, lda, b, ldb, beta, c, ldc);
  ST_CHECK(status == kSuccess, Error, "oneDNN's bf16 GEMM failed (status ", status, ") for [", m, ", ",
           k, "] x [", k, ", ", n, "]");
  return true;
}

std::string blas_coretype_to_set(const std::string& core, bool cpu_has_avx512,
                                 bool cpu_has_avx512_bf16, bool coretype_set) {
  if (coretype_set || !blas_core_below_cpu(core, cpu_has_avx512)) return "";
  return cpu_has_avx512_bf16 ? "COOPERLAKE" : "SKYLAKEX";
}

bool blas_core_below_cpu(const std::string& core, bool cpu_has_avx512) {
  if (core.empty() || !cpu_has_avx512) return false;
  for (const char* avx512 : {"SkylakeX", "Cooperlake", "SapphireRapids"}) {
    if (core == avx512) return false;
  }
  return true;
}

}  // namespace detail

}  // namespace shardtrain
