// GEMM peak of one core, as LibTorch reaches it: at::mm on one thread, fp32
// and bf16, over square shapes and the shapes of a gpt-25m micro-batch (512
// token rows against 512/1536/2048-wide weights). Each shape is warmed up,
// then timed --reps times; a dtype's figure is its best GFLOP/s (2*M*N*K per
// mm) over all shapes and reps. Prints one JSON line:
//
//   {"blas_core":"SkylakeX","threads":1,"fp32_gflops":...,"bf16_gflops":...,
//    "shapes":[{"dtype":"fp32","m":..,"n":..,"k":..,"gflops":..},...]}
//
// bench/train.sh builds it with g++ against Debian's LibTorch (as
// bench/checkpoint.sh builds its benchmark) and runs it once alone and as two
// concurrent copies: two training ranks share the machine the same way.
//
//   gemm_peak [--reps N] [--seconds S]   (S: minimum timed seconds per shape)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "bench_flags.h"

namespace {

// One BLAS thread, as shardtrain's ranks run (src/train/trainer.cpp's
// set_blas_threads): OpenBLAS keeps its own pool apart from OpenMP's.
void set_blas_threads(int threads) {
  using SetThreads = void (*)(int);
  if (auto set = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) {
    set(threads);
  }
}

// The OpenBLAS kernel set in use ("SkylakeX", "Haswell", ...); "" when the
// BLAS is not OpenBLAS.
std::string blas_core() {
  using CoreName = char* (*)();
  if (auto name = reinterpret_cast<CoreName>(dlsym(RTLD_DEFAULT, "openblas_get_corename"))) {
    return name();
  }
  return "";
}

struct Shape {
  int64_t m, n, k;
};

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Best GFLOP/s of `reps` timed runs of at::mm for one shape; each run repeats
// the mm until at least `min_s` seconds have passed.
double best_gflops(const Shape& s, at::ScalarType dtype, int reps, double min_s) {
  const at::Tensor a = at::randn({s.m, s.k}).to(dtype);
  const at::Tensor b = at::randn({s.k, s.n}).to(dtype);
  at::Tensor c = at::mm(a, b);  // warm-up: first-call dispatch, packing buffers
  const double w0 = now_s();
  at::mm_out(c, a, b);
  // A slow path (bf16 without native support: a few GFLOP/s) gets one timed
  // run, so the whole program stays within seconds.
  if (now_s() - w0 > min_s) reps = 1;
  const double flops = 2.0 * static_cast<double>(s.m) * s.n * s.k;
  double best = 0.0;
  for (int r = 0; r < reps; ++r) {
    int iters = 0;
    const double t0 = now_s();
    double dt = 0.0;
    do {
      at::mm_out(c, a, b);
      ++iters;
      dt = now_s() - t0;
    } while (dt < min_s);
    best = std::max(best, flops * iters / dt / 1e9);
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 5;
  double min_s = 0.2;
  CLI::App app("GEMM peak of one core (at::mm, fp32 and bf16)", "bench_gemm_peak");
  app.add_option("--reps", reps, "timed repetitions per shape")->check(CLI::Range(1, 1000));
  app.add_option("--seconds", min_s, "minimum timed seconds per shape")
      ->check(CLI::Range(0.0, 3600.0));
  bench::parse_flags(app, argc, argv);
  at::set_num_threads(1);
  set_blas_threads(1);

  const std::vector<Shape> shapes = {
      {1024, 1024, 1024}, {2048, 2048, 2048},  // square
      {512, 1536, 512},                         // c_attn: 512 tokens x n_embd -> 3 n_embd
      {512, 2048, 512},                         // c_fc
      {512, 512, 2048},                         // mlp c_proj
  };
  const std::vector<std::pair<const char*, at::ScalarType>> dtypes = {
      {"fp32", at::kFloat}, {"bf16", at::kBFloat16}};

  std::string rows;
  std::string peaks;
  for (const auto& [name, dtype] : dtypes) {
    double peak = 0.0;
    for (const Shape& s : shapes) {
      const double g = best_gflops(s, dtype, reps, min_s);
      peak = std::max(peak, g);
      char buf[160];
      std::snprintf(buf, sizeof buf, "%s{\"dtype\":\"%s\",\"m\":%lld,\"n\":%lld,\"k\":%lld,\"gflops\":%.2f}",
                    rows.empty() ? "" : ",", name, static_cast<long long>(s.m),
                    static_cast<long long>(s.n), static_cast<long long>(s.k), g);
      rows += buf;
    }
    char buf[64];
    std::snprintf(buf, sizeof buf, ",\"%s_gflops\":%.2f", name, peak);
    peaks += buf;
  }
  std::printf("{\"blas_core\":\"%s\",\"threads\":%d%s,\"reps\":%d,\"min_seconds\":%.3f,\"shapes\":[%s]}\n",
              blas_core().c_str(), at::get_num_threads(), peaks.c_str(), reps, min_s, rows.c_str());
  return 0;
}
