#include "shardtrain/core/blas.h"

#include <dlfcn.h>

#include <cstdlib>

namespace shardtrain {

namespace {

template <typename F>
F openblas_symbol(const char* name) {
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
  const auto name = openblas_symbol<CoreName>("openblas_get_corename");
  const char* core = name ? name() : nullptr;
  return core ? core : "";
}

void set_blas_threads(int threads) {
  using SetThreads = void (*)(int);
  if (const auto set = openblas_symbol<SetThreads>("openblas_set_num_threads")) set(threads);
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
