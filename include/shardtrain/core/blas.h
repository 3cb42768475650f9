// The BLAS that LibTorch calls for fp32 GEMMs, as this process runs it.
//
// Debian's LibTorch calls a generic BLAS (libblas.so.3), usually OpenBLAS.
// Two of OpenBLAS's run-time choices matter for speed and LibTorch governs
// neither: its thread pool (sized to the machine, not to at::set_num_threads)
// and its kernel set, picked once at load time from the CPU, unless the
// environment variable OPENBLAS_CORETYPE names one. On an AVX-512 CPU the
// AVX2 (Haswell) kernels run fp32 GEMMs at about half the rate (measured on
// one Zen 5 core: 100 against 185 GFLOP/s).
#pragma once

#include <cstdint>
#include <string>

namespace shardtrain {

/// The kernel set OpenBLAS runs ("Haswell", "SkylakeX", ...), or "" when the
/// BLAS is not OpenBLAS.
std::string blas_core();

/// Sets OpenBLAS's own thread count (a no-op for other BLAS libraries).
void set_blas_threads(int threads);

/// A one-line warning when OPENBLAS_CORETYPE holds OpenBLAS to kernels below
/// what this CPU runs (AVX2 ones on an AVX-512 CPU), else "".
std::string blas_coretype_warning();

/// The OPENBLAS_CORETYPE this process should have started with, or "":
/// "COOPERLAKE" (AVX-512 BF16) or "SKYLAKEX" when OpenBLAS picked kernels
/// below this CPU on its own, because its detection predates the CPU
/// (Debian's 0.3.21 takes a Xeon with AVX-512 FP16 for a Prescott and runs
/// fp32 GEMMs at a fifth of the rate: 32 against 155 GFLOP/s on one core).
/// "" when the kernels fit, the BLAS is not OpenBLAS, or OPENBLAS_CORETYPE
/// is set already (blas_coretype_warning then speaks). OpenBLAS reads the
/// variable only when it is loaded, so a program applies it by running
/// itself again; the shardtrain tool does, before anything else.
std::string blas_coretype_to_set();

namespace detail {

/// c [m, n] = a b + beta c for row-major fp32 matrices with row strides
/// lda, ldb, ldc: a [m, k], or stored [k, m] when `ta`; b [k, n], or stored
/// [n, k] when `tb`. The BLAS LibTorch multiplies with (its sgemm_), called
/// on raw strided matrices: no tensor views, no dispatch, no copies. An Error
/// naming what to install when no sgemm_ is loaded.
void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
          int64_t ldb, float beta, float* c, int64_t ldc);

/// gemm's shape and strides for bf16 a and b (raw uint16_t bits) and an fp32
/// c: products summed in fp32, nothing rounded to bf16. The bf16 GEMM of the
/// oneDNN LibTorch runs its bf16 matmuls on (dnnl_gemm_bf16bf16f32). False,
/// with nothing written, when no such GEMM is loaded.
bool gemm_bf16(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const uint16_t* a, int64_t lda,
               const uint16_t* b, int64_t ldb, float beta, float* c, int64_t ldc);

/// blas_coretype_to_set for a given kernel set, CPU and environment.
std::string blas_coretype_to_set(const std::string& core, bool cpu_has_avx512,
                                 bool cpu_has_avx512_bf16, bool coretype_set);

/// Whether `core` is a kernel set below AVX-512 on a CPU with the AVX-512
/// subsets OpenBLAS's SkylakeX kernels use (F, CD, BW, DQ, VL). False when
/// the BLAS is not OpenBLAS ("").
bool blas_core_below_cpu(const std::string& core, bool cpu_has_avx512);

}  // namespace detail

}  // namespace shardtrain
