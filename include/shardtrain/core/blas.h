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

/// blas_coretype_to_set for a given kernel set, CPU and environment.
std::string blas_coretype_to_set(const std::string& core, bool cpu_has_avx512,
                                 bool cpu_has_avx512_bf16, bool coretype_set);

/// Whether `core` is a kernel set below AVX-512 on a CPU with the AVX-512
/// subsets OpenBLAS's SkylakeX kernels use (F, CD, BW, DQ, VL). False when
/// the BLAS is not OpenBLAS ("").
bool blas_core_below_cpu(const std::string& core, bool cpu_has_avx512);

}  // namespace detail

}  // namespace shardtrain
