// Flat-parameter arithmetic of the sharded strategies, without a
// communicator: padding, shard bounds and each parameter's part of a shard,
// for empty, single-element and not-divisible sizes.
#include <gtest/gtest.h>

#include <numeric>

#include "strategy/flat_param.h"

namespace sd = shardtrain::strategy::detail;

namespace {

// Every element of every parameter is held by exactly one rank, at the place
// its slot says, and nothing else lies in a shard but padding.
void expect_partition(const std::vector<int64_t>& numels, int shards) {
  const int64_t total = std::accumulate(numels.begin(), numels.end(), int64_t{0});
  std::vector<int> holders(static_cast<size_t>(total), 0);
  for (int r = 0; r < shards; ++r) {
    const sd::FlatLayout l = sd::plan_flat(numels, shards, r);
    ASSERT_EQ(l.numel, total);
    EXPECT_EQ(l.padded % shards, 0);
    EXPECT_GE(l.padded, total);
    EXPECT_LT(l.padded - total, shards);
    EXPECT_EQ(l.shard_numel * shards, l.padded);
    EXPECT_EQ(l.shard_offset, r * l.shard_numel);
    ASSERT_EQ(l.slots.size(), numels.size());
    for (const auto& s : l.slots) {
      EXPECT_GE(s.shard_begin, 0);
      EXPECT_LE(s.shard_begin + s.shard_count, l.shard_numel);
      EXPECT_LE(s.param_offset + s.shard_count, s.numel);
      for (int64_t k = 0; k < s.shard_count; ++k) {
        // The element the shard holds here is the parameter's element param_offset + k.
        EXPECT_EQ(l.shard_offset + s.shard_begin + k, s.offset + s.param_offset + k);
        ++holders[static_cast<size_t>(s.offset + s.param_offset + k)];
      }
    }
  }
  for (int h : holders) EXPECT_EQ(h, 1);
}

TEST(FlatLayout, PartitionsEveryElementOnceForAnySizes) {
  for (int shards : {1, 2, 3, 4, 7}) {
    SCOPED_TRACE(shards);
    expect_partition({}, shards);
    expect_partition({0}, shards);
    expect_partition({1}, shards);
    expect_partition({0, 1, 0}, shards);
    expect_partition({5, 3}, shards);
    expect_partition({6, 1, 13, 2}, shards);
  }
}

TEST(FlatLayout, EmptyFlatHasEmptyShards) {
  const sd::FlatLayout l = sd::plan_flat({0, 0}, 4, 3);
  EXPECT_EQ(l.padded, 0);
  EXPECT_EQ(l.shard_numel, 0);
  EXPECT_EQ(l.slots[1].shard_count, 0);
}

TEST(FlatLayout, OneElementOverFourRanksLiesOnRankZero) {
  const sd::FlatLayout r0 = sd::plan_flat({1}, 4, 0);
  EXPECT_EQ(r0.padded, 4);
  EXPECT_EQ(r0.shard_numel, 1);
  EXPECT_EQ(r0.slots[0].shard_count, 1);
  for (int r = 1; r < 4; ++r) EXPECT_EQ(sd::plan_flat({1}, 4, r).slots[0].shard_count, 0);
}

TEST(FlatLayout, NotDivisibleSplitsAParameterAcrossRanks) {
  // 5 + 3 = 8 elements over 3 ranks: padded to 9, shards of 3.
  const sd::FlatLayout r1 = sd::plan_flat({5, 3}, 3, 1);
  EXPECT_EQ(r1.padded, 9);
  EXPECT_EQ(r1.shard_offset, 3);
  // Rank 1 holds elements 3..5: the first parameter's 3 and 4, the second's 0.
  EXPECT_EQ(r1.slots[0].shard_begin, 0);
  EXPECT_EQ(r1.slots[0].shard_count, 2);
  EXPECT_EQ(r1.slots[0].param_offset, 3);
  EXPECT_EQ(r1.slots[1].shard_begin, 2);
  EXPECT_EQ(r1.slots[1].shard_count, 1);
  EXPECT_EQ(r1.slots[1].param_offset, 0);
  // Rank 2 holds the second parameter's 1 and 2, then one element of padding.
  const sd::FlatLayout r2 = sd::plan_flat({5, 3}, 3, 2);
  EXPECT_EQ(r2.slots[0].shard_count, 0);
  EXPECT_EQ(r2.slots[1].shard_begin, 0);
  EXPECT_EQ(r2.slots[1].shard_count, 2);
  EXPECT_EQ(r2.slots[1].param_offset, 1);
}

}  // namespace
