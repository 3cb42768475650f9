// The data order's random permutations, the same on every platform and
// standard library (internal to src/data).
#pragma once

#include <cstdint>
#include <random>
#include <utility>
#include <vector>

namespace shardtrain::data::detail {

// splitmix64: turns (seed, epoch) into a well-mixed 64-bit seed.
inline uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Uniform integer in [0, bound) by rejection; unlike
// std::uniform_int_distribution, the result is the same on every standard
// library (mt19937_64's output sequence is fixed by the standard).
inline uint64_t uniform_below(std::mt19937_64& rng, uint64_t bound) {
  const uint64_t threshold = (0 - bound) % bound;  // 2^64 mod bound
  for (;;) {
    const uint64_t r = rng();
    if (r >= threshold) return r % bound;
  }
}

// Fisher–Yates permutation of 0..n-1 drawn from (seed, epoch).
inline std::vector<int64_t> permutation(int64_t n, uint64_t seed, int64_t epoch) {
  std::mt19937_64 rng(mix64(seed ^ mix64(static_cast<uint64_t>(epoch))));
  std::vector<int64_t> order(static_cast<size_t>(n));
  for (int64_t w = 0; w < n; ++w) order[static_cast<size_t>(w)] = w;
  for (int64_t w = n - 1; w > 0; --w) {
    const auto other = static_cast<int64_t>(uniform_below(rng, static_cast<uint64_t>(w + 1)));
    std::swap(order[static_cast<size_t>(w)], order[static_cast<size_t>(other)]);
  }
  return order;
}

}  // namespace shardtrain::data::detail
