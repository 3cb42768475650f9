// Synthetic sharded state for the checkpoint tests: a fixed list of tensors
// (0 and 1 elements, a scalar, sizes no world size divides, several dtypes),
// each laid out over the ranks in one of three ways chosen by a salt, so a
// save and a later load slice every tensor differently. Values depend only
// on the tensor and the element index, so a loader at any world size knows
// what every element must be. Used by tests/unit/test_sharded_checkpoint.cpp
// and tests/dist/test_checkpoint_dist.cpp.
#pragma once

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "shardtrain/comm/communicator.h"
#include "shardtrain/strategy/strategy.h"

namespace shardtrain::testing::synthetic {

using strategy::ShardedTensor;

struct Spec {
  std::string name;
  std::vector<int64_t> shape;
  at::ScalarType dtype;
  bool is_parameter = true;
};

inline std::vector<Spec> specs() {
  return {
      {"wte.weight", {7, 5}, at::kFloat},
      {"empty.weight", {0}, at::kFloat},
      {"empty2d.weight", {3, 0}, at::kFloat},
      {"one.bias", {1}, at::kDouble},
      {"scalar.gain", {}, at::kFloat},
      {"h.0.attn.c_attn.weight", {13}, at::kBFloat16},
      {"h.0.mlp.c_fc.weight", {3, 4, 5}, at::kLong},
      {"big.weight", {1001}, at::kFloat},  // many checksum pieces at small piece sizes
      {"half.weight", {17}, at::kHalf},
      {"mask", {11}, at::kBool, /*is_parameter=*/false},
      {"counts", {6}, at::kInt, /*is_parameter=*/false},
  };
}

/// Every element of tensor `k`, deterministic and exact in its dtype.
inline at::Tensor full_value(size_t k, const Spec& s) {
  int64_t numel = 1;
  for (int64_t d : s.shape) numel *= d;
  auto idx = at::arange(numel, at::kDouble);
  at::Tensor v;
  if (s.dtype == at::kBool) {
    v = idx.remainder(3).eq(static_cast<double>(k % 3));
  } else if (at::isIntegralType(s.dtype, false)) {
    v = idx.mul(37).add(static_cast<double>(k) * 1000).remainder(100003).sub(50000);
  } else {
    v = idx.mul(0.37).add(static_cast<double>(k)).sin().mul(100);
  }
  return v.to(s.dtype).reshape(s.shape);
}

enum class Layout { Sharded, WholeOnRank0, Uneven };

inline Layout layout_for(size_t k, int salt) { return static_cast<Layout>((k + salt) % 3); }

/// A split unlike shard_range: rank r holds [n r^2 / w^2, n (r+1)^2 / w^2),
/// so rank 0 often holds nothing and the last rank the most.
inline std::pair<int64_t, int64_t> uneven_range(int64_t numel, int world, int rank) {
  const auto bound = [&](int r) { return numel * r * r / (int64_t{world} * world); };
  return {bound(rank), bound(rank + 1) - bound(rank)};
}

/// What rank `rank` of `world` holds of every tensor. fill: the true values
/// (to save); otherwise NaN/garbage placeholders of the right shape (to load
/// into).
inline std::vector<ShardedTensor> rank_tensors(int world, int rank, int salt, bool fill) {
  std::vector<ShardedTensor> out;
  const auto all = specs();
  for (size_t k = 0; k < all.size(); ++k) {
    const Spec& s = all[k];
    at::Tensor full = full_value(k, s);
    ShardedTensor t;
    t.name = s.name;
    t.global_shape = s.shape;
    t.is_parameter = s.is_parameter;
    const int64_t numel = full.numel();
    switch (layout_for(k, salt)) {
      case Layout::WholeOnRank0:
        t.offset = 0;
        t.local = full.clone();
        t.primary = rank == 0;
        break;
      case Layout::Sharded: {
        const auto r = comm::shard_range(numel, world, rank);
        t.offset = r.offset;
        t.local = full.reshape({-1}).narrow(0, r.offset, r.count).clone();
        break;
      }
      case Layout::Uneven: {
        const auto [off, count] = uneven_range(numel, world, rank);
        t.offset = off;
        t.local = full.reshape({-1}).narrow(0, off, count).clone();
        break;
      }
    }
    if (!fill && t.local.numel() > 0) {
      // Something no load can leave behind by accident.
      if (t.local.is_floating_point()) t.local.fill_(std::numeric_limits<double>::quiet_NaN());
      else if (t.local.scalar_type() == at::kBool) t.local.logical_not_();
      else t.local.fill_(-777);
    }
    out.push_back(std::move(t));
  }
  return out;
}

/// Every loaded element equals the original.
inline void expect_values(const std::vector<ShardedTensor>& loaded, const std::string& where) {
  const auto all = specs();
  for (const auto& t : loaded) {
    size_t k = 0;
    while (k < all.size() && all[k].name != t.name) ++k;
    ASSERT_LT(k, all.size()) << t.name;
    const at::Tensor want = full_value(k, all[k])
                                .reshape({-1})
                                .narrow(0, t.offset, t.local.numel())
                                .to(t.local.scalar_type());
    EXPECT_TRUE(at::equal(t.local.reshape({-1}), want))
        << where << ": tensor " << t.name << " offset " << t.offset << " count "
        << t.local.numel();
  }
}

}  // namespace shardtrain::testing::synthetic
