// Single-thread memcpy bandwidth: the ceiling for anything that moves bytes
// between processes on one machine (loopback TCP copies each byte at least
// twice, user -> kernel -> user). Built by bench/comm.sh, not by CMake:
//
//   g++ -O2 -o build/bench_memcpy bench/memcpy_bw.cpp
//   build/bench_memcpy [--json FILE] [BYTES...]      (default 1024 1048576 67108864)
//
// For each size: copy src -> dst repeatedly for about 0.2 s, 5 times; report the
// median trial. GB/s = bytes copied / time (1 GB = 1e9 bytes), as in bench-comm.
// Prints one line per size and appends one JSON line {"impl":"memcpy",...}.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "bench_flags.h"

namespace {

// Keeps the compiler from dropping or merging the copies.
inline void clobber() { asm volatile("" ::: "memory"); }

double seconds_per_copy(char* dst, const char* src, size_t bytes, long reps) {
  const auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < reps; ++i) {
    std::memcpy(dst, src, bytes);
    clobber();
  }
  const auto t1 = std::chrono::steady_clock::now();
  return std::chrono::duration<double>(t1 - t0).count() / static_cast<double>(reps);
}

}  // namespace

int main(int argc, char** argv) {
  std::string json;
  std::vector<size_t> sizes;
  CLI::App app("Single-thread memcpy bandwidth", "bench_memcpy");
  app.add_option("--json", json, "append one JSON line per size to FILE");
  app.add_option("BYTES", sizes, "buffer sizes (default 1024 1048576 67108864)")
      ->check(CLI::Range(size_t{1}, size_t{1} << 40));
  bench::parse_flags(app, argc, argv);
  if (sizes.empty()) sizes = {size_t{1} << 10, size_t{1} << 20, size_t{64} << 20};

  FILE* out = nullptr;
  if (!json.empty()) {
    out = std::fopen(json.c_str(), "a");
    if (!out) {
      std::fprintf(stderr, "bench_memcpy: cannot append to '%s'\n", json.c_str());
      return 1;
    }
  }

  for (const size_t bytes : sizes) {
    // Separate, page-touched buffers so no page faults land in the timing.
    std::vector<char> src(bytes, 1), dst(bytes, 0);
    // Calibrate the repeat count to about 0.2 s per trial.
    long reps = 1;
    for (;;) {
      const double s = seconds_per_copy(dst.data(), src.data(), bytes, reps);
      if (s * static_cast<double>(reps) > 0.05 || reps > (1L << 30)) {
        reps = std::max(1L, static_cast<long>(0.2 / s));
        break;
      }
      reps *= 4;
    }
    std::vector<double> trials;
    for (int t = 0; t < 5; ++t) trials.push_back(seconds_per_copy(dst.data(), src.data(), bytes, reps));
    std::sort(trials.begin(), trials.end());
    const double s = trials[trials.size() / 2];
    const double gbps = static_cast<double>(bytes) / s / 1e9;
    if (dst[bytes - 1] != 1) {  // also keeps dst live
      std::fprintf(stderr, "bench_memcpy: copy check failed\n");
      return 1;
    }
    std::printf("memcpy          %12zu bytes  1 thread   %10.3f us  %8.3f GB/s  (%ld copies x 5, median)\n",
                bytes, s * 1e6, gbps, reps);
    if (out)
      std::fprintf(out,
                   "{\"impl\":\"memcpy\",\"op\":\"memcpy\",\"bytes\":%zu,\"threads\":1,\"iters\":%ld,"
                   "\"time_us\":%.6g,\"gbps\":%.6g}\n",
                   bytes, reps * 5, s * 1e6, gbps);
  }
  if (out) std::fclose(out);
  return 0;
}
