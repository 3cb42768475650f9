// The load balancer's arithmetic (src/train/balance.h), against counts
// worked out by hand: largest-remainder splits, micro-step sizes, the rows of
// a rank, re-planning from speeds, stragglers named and recovered, and the
// checkpoint round trip.
#include <gtest/gtest.h>

#include "shardtrain/core/error.h"
#include "train/balance.h"

namespace st = shardtrain;
using st::train::detail::BalanceOptions;
using st::train::detail::LoadBalancer;
using st::train::detail::micro_step_sizes;
using st::train::detail::split_counts;

namespace {

// Options for a step of `global` rows in `accumulate` micro-steps.
BalanceOptions step_of(int64_t global, int64_t accumulate) {
  BalanceOptions o;
  o.global = global;
  o.accumulate = accumulate;
  return o;
}

}  // namespace

TEST(LoadBalance, SplitCountsGiveTheLargestRemaindersTheRest) {
  // 8 x (2/3, 1/3) = 5.33, 2.67: floors 5 and 2, the larger remainder is rank 1's.
  EXPECT_EQ(split_counts({2, 1}, 8), (std::vector<int64_t>{5, 3}));
  // Ties go to the lower rank.
  EXPECT_EQ(split_counts({1, 1}, 5), (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(split_counts({1, 1, 1}, 2), (std::vector<int64_t>{1, 1, 0}));
  // 7 x (0.5, 0.3, 0.2) = 3.5, 2.1, 1.4: floors 3, 2, 1, one left, to rank 0.
  EXPECT_EQ(split_counts({5, 3, 2}, 7), (std::vector<int64_t>{4, 2, 1}));
  EXPECT_EQ(split_counts({3, 1}, 0), (std::vector<int64_t>{0, 0}));
  EXPECT_EQ(split_counts({0.25}, 9), (std::vector<int64_t>{9}));
  EXPECT_THROW(split_counts({}, 3), st::InvalidArgument);
  EXPECT_THROW(split_counts({0, 0}, 3), st::InvalidArgument);
}

TEST(LoadBalance, MicroStepSizesSpreadTheRemainderFirst) {
  EXPECT_EQ(micro_step_sizes(10, 3), (std::vector<int64_t>{4, 3, 3}));
  EXPECT_EQ(micro_step_sizes(8, 2), (std::vector<int64_t>{4, 4}));
  EXPECT_EQ(micro_step_sizes(1, 2), (std::vector<int64_t>{1, 0}));
  EXPECT_EQ(micro_step_sizes(0, 1), (std::vector<int64_t>{0}));
}

TEST(LoadBalance, EqualSharesAreTheEvenSplit) {
  // The even split: rank k's micro-step j is rows (j * W + k) * B .. + B.
  const LoadBalancer b({1, 1, 1}, step_of(12, 2));
  for (int64_t j = 0; j < 2; ++j) {
    for (int k = 0; k < 3; ++k) {
      EXPECT_EQ(b.rows(j, k), (std::pair<int64_t, int64_t>{(j * 3 + k) * 2, 2}));
    }
  }
}

TEST(LoadBalance, UnevenSharesTakeConsecutiveRowsOfEachMicroStep) {
  // 10 rows over 2 micro-steps of 5; shares 3:1 give 3.75, 1.25 -> 4, 1.
  const LoadBalancer b({3, 1}, step_of(10, 2));
  EXPECT_EQ(b.rows(0, 0), (std::pair<int64_t, int64_t>{0, 4}));
  EXPECT_EQ(b.rows(0, 1), (std::pair<int64_t, int64_t>{4, 1}));
  EXPECT_EQ(b.rows(1, 0), (std::pair<int64_t, int64_t>{5, 4}));
  EXPECT_EQ(b.rows(1, 1), (std::pair<int64_t, int64_t>{9, 1}));
  // A global batch smaller than the ranks: rank 1 gets an empty micro-step.
  const LoadBalancer small({1, 1}, step_of(1, 1));
  EXPECT_EQ(small.rows(0, 0), (std::pair<int64_t, int64_t>{0, 1}));
  EXPECT_EQ(small.rows(0, 1), (std::pair<int64_t, int64_t>{1, 0}));
}

TEST(LoadBalance, SharesFollowTheMeasuredSpeedsAtEachReplan) {
  BalanceOptions o = step_of(12, 1);
  o.rebalance_every = 2;
  LoadBalancer b({1, 1}, o);
  // Rank 1 takes twice as long for the same samples: speeds 4 and 2.
  EXPECT_FALSE(b.observe(1, {4, 4}, {1.0, 2.0}).replanned);  // not a re-plan step
  EXPECT_DOUBLE_EQ(b.shares()[0], 0.5);
  const auto events = b.observe(2, {4, 4}, {1.0, 2.0});
  ASSERT_TRUE(events.replanned);
  EXPECT_NEAR(b.shares()[0], 2.0 / 3.0, 1e-12);
  EXPECT_NEAR(b.shares()[1], 1.0 / 3.0, 1e-12);
  // Predicted step time in whole rows of 12: max(6/4, 6/2) = 3 before, max(8/4, 4/2) = 2 after.
  EXPECT_NEAR(events.predicted_gain, 1.5, 1e-12);
}

TEST(LoadBalance, EqualSpeedsKeepTheirShares) {
  BalanceOptions o = step_of(12, 1);
  o.rebalance_every = 1;
  o.min_gain = 0.05;
  LoadBalancer b({1, 1}, o);
  // 3% apart: shares 0.507 / 0.493 of 12 rows are still 6 / 6: nothing to gain.
  EXPECT_FALSE(b.observe(1, {4, 4}, {1.0, 1.03}).replanned);
  EXPECT_DOUBLE_EQ(b.shares()[1], 0.5);
}

TEST(LoadBalance, ARePlanThatMovesTooFewRowsIsNotMade) {
  BalanceOptions o;
  o.rebalance_every = 1;
  o.min_gain = 0.05;
  o.global = 32;  // 2 micro-steps of 16 rows
  o.accumulate = 2;
  // Rank 1 10% faster: shares 0.476 / 0.524 would give 7.6 / 8.4 of each
  // micro-step's 16 rows, 8 / 8 in whole rows, as now: nothing to gain.
  LoadBalancer b({1, 1}, o);
  EXPECT_FALSE(b.observe(1, {16, 16}, {16.0, 16.0 / 1.1}).replanned);
  EXPECT_DOUBLE_EQ(b.shares()[0], 0.5);
  // At twice the speed whole rows move: 5.3 / 10.7 -> 5 / 11 per micro-step.
  const auto e = b.observe(2, {16, 16}, {16.0, 8.0});
  EXPECT_TRUE(e.replanned);
  EXPECT_EQ(b.rows(0, 1), (std::pair<int64_t, int64_t>{5, 11}));
}

TEST(LoadBalance, SpeedsAreAveragedOverTheWindowAndIdleStepsAddNothing) {
  BalanceOptions o;
  o.rebalance_every = 2;
  LoadBalancer b({1, 1}, o);
  b.observe(1, {4, 2}, {1.0, 1.0});
  EXPECT_DOUBLE_EQ(b.speeds()[0], 0.0);  // not before the window's end
  b.observe(2, {8, 0}, {1.0, 0.5});      // rank 1 computed nothing in step 2
  EXPECT_DOUBLE_EQ(b.speeds()[0], 6.0);  // (4 + 8) / (1 + 1)
  EXPECT_DOUBLE_EQ(b.speeds()[1], 2.0);  // 2 / 1
  // A window in which rank 1 computed nothing keeps its last speed.
  b.observe(3, {6, 0}, {1.0, 0.1});
  b.observe(4, {6, 0}, {1.0, 0.1});
  EXPECT_DOUBLE_EQ(b.speeds()[0], 6.0);
  EXPECT_DOUBLE_EQ(b.speeds()[1], 2.0);
}

TEST(LoadBalance, StragglersAreNamedOnceAndTheirRecoveryToo) {
  BalanceOptions o;
  o.rebalance_every = 1;
  o.straggler_factor = 1.5;
  LoadBalancer b({1, 1, 1}, o);
  // Rank 2 at half the speed of the others: the median is 4, rank 2's 2.
  auto e = b.observe(1, {4, 4, 4}, {1.0, 1.0, 2.0});
  EXPECT_EQ(e.slowed, std::vector<int>{2});
  EXPECT_DOUBLE_EQ(b.slowdown(2), 2.0);
  e = b.observe(2, {4, 4, 4}, {1.0, 1.0, 2.0});
  EXPECT_TRUE(e.slowed.empty());  // named once
  // 1.3x: inside the factor but not yet within half its excess (1.25).
  e = b.observe(3, {4, 4, 4}, {1.0, 1.0, 1.3});
  EXPECT_TRUE(e.recovered.empty());
  e = b.observe(4, {4, 4, 4}, {1.0, 1.0, 1.1});
  EXPECT_EQ(e.recovered, std::vector<int>{2});
  // Two ranks: each against the other, so half as fast is 2x slower.
  LoadBalancer two({1, 1}, o);
  e = two.observe(1, {4, 4}, {1.0, 2.0});
  EXPECT_DOUBLE_EQ(two.slowdown(1), 2.0);
  EXPECT_DOUBLE_EQ(two.slowdown(0), 0.5);
  EXPECT_EQ(e.slowed, std::vector<int>{1});
}

TEST(LoadBalance, CheckpointRoundTripKeepsTheSharesExactly) {
  BalanceOptions o = step_of(12, 1);
  o.rebalance_every = 1;
  LoadBalancer b({1, 1}, o);
  b.observe(1, {3, 3}, {1.0, 7.0});
  LoadBalancer again({1, 1}, o);
  ASSERT_TRUE(again.restore(b.to_json()));
  EXPECT_EQ(again.shares(), b.shares());
  EXPECT_EQ(again.speeds(), b.speeds());
  LoadBalancer three({1, 1, 1}, o);
  EXPECT_FALSE(three.restore(b.to_json()));
  EXPECT_DOUBLE_EQ(three.shares()[0], 1.0 / 3.0);
}

TEST(LoadBalance, NonPositiveStartingSharesAreRefused) {
  EXPECT_THROW(LoadBalancer({1, 0}, {}), st::ConfigError);
  EXPECT_THROW(LoadBalancer({1, -2}, {}), st::ConfigError);
}
