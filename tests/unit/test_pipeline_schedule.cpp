// The pipeline schedules against hand-written tables of the papers' figures
// (GPipe; PipeDream-Flush's 1F1B, Narayanan et al. 2021 fig. 4; Megatron's
// interleaved schedule, ibid.; ZB-H1, Qi et al. 2024 fig. 3), and every
// schedule, at every small shape, run through the simulator: each receive
// has its send, nothing waits on itself, and the bubble and the activations
// held are what the papers derive.
#include <gtest/gtest.h>

#include <limits>
#include <random>
#include <sstream>

#include "shardtrain/core/error.h"
#include "shardtrain/parallel/pipeline_schedule.h"

using namespace shardtrain;
using parallel::PipeAction;
using parallel::PipelineSchedule;

namespace {

// "F0 F1 B0 ..." of one rank (stages left out when each rank has one).
std::string order(const std::vector<PipeAction>& actions, bool with_stage = false) {
  std::string out;
  for (const auto& a : actions) out += (out.empty() ? "" : " ") + parallel::to_string(a, with_stage);
  return out;
}

std::vector<std::string> orders(PipelineSchedule s, int p, int m, int v = 1) {
  std::vector<std::string> out;
  for (const auto& rank : parallel::pipeline_schedule(s, p, m, v)) out.push_back(order(rank, v > 1));
  return out;
}

}  // namespace

TEST(PipelineSchedule, GPipeRunsEveryForwardThenEveryBackward) {
  EXPECT_EQ(orders(PipelineSchedule::GPipe, 2, 4),
            (std::vector<std::string>{"F0 F1 F2 F3 B0 B1 B2 B3", "F0 F1 F2 F3 B0 B1 B2 B3"}));
}

// PipeDream-Flush, 4 devices and 8 micro-batches: device r warms up with
// p - r - 1 forwards.
TEST(PipelineSchedule, OneFOneBIsPipeDreamFlush) {
  EXPECT_EQ(orders(PipelineSchedule::OneFOneB, 4, 8),
            (std::vector<std::string>{
                "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7",
                "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7",
                "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7",
                "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7",
            }));
  EXPECT_EQ(orders(PipelineSchedule::OneFOneB, 2, 4),
            (std::vector<std::string>{"F0 F1 B0 F2 B1 F3 B2 B3", "F0 B0 F1 B1 F2 B2 F3 B3"}));
  // Fewer micro-batches than ranks: the warm-up stops at what there is.
  EXPECT_EQ(orders(PipelineSchedule::OneFOneB, 4, 2),
            (std::vector<std::string>{"F0 F1 B0 B1", "F0 F1 B0 B1", "F0 F1 B0 B1", "F0 B0 F1 B1"}));
}

// Megatron's virtual pipeline, 2 ranks of 2 stages each (rank 0: stages 0
// and 2), 4 micro-batches in rounds of 2: forwards through stage 0, then
// stage 2, round by round; backwards through the stages in reverse.
TEST(PipelineSchedule, InterleavedTakesRoundsThroughEachStage) {
  EXPECT_EQ(orders(PipelineSchedule::Interleaved1F1B, 2, 4, 2),
            (std::vector<std::string>{
                "F0@s0 F1@s0 F0@s2 F1@s2 F2@s0 B0@s2 F3@s0 B1@s2 F2@s2 B0@s0 F3@s2 B1@s0 B2@s2 B3@s2 B2@s0 B3@s0",
                "F0@s1 F1@s1 F0@s3 B0@s3 F1@s3 B1@s3 F2@s1 B0@s1 F3@s1 B1@s1 F2@s3 B2@s3 F3@s3 B3@s3 B2@s1 B3@s1",
            }));
  // One stage per rank is 1f1b.
  EXPECT_EQ(orders(PipelineSchedule::Interleaved1F1B, 4, 8, 1), orders(PipelineSchedule::OneFOneB, 4, 8));
}

// ZB-H1 (I: input-gradient half, W: weight-gradient half): 1f1b's slots,
// rank r deferring the weight halves of its first r backwards to the end.
TEST(PipelineSchedule, ZeroBubbleIsZbH1) {
  EXPECT_EQ(orders(PipelineSchedule::ZeroBubble, 4, 8),
            (std::vector<std::string>{
                "F0 F1 F2 F3 I0 W0 F4 I1 W1 F5 I2 W2 F6 I3 W3 F7 I4 W4 I5 W5 I6 W6 I7 W7",
                "F0 F1 F2 I0 F3 I1 W0 F4 I2 W1 F5 I3 W2 F6 I4 W3 F7 I5 W4 I6 W5 I7 W6 W7",
                "F0 F1 I0 F2 I1 F3 I2 W0 F4 I3 W1 F5 I4 W2 F6 I5 W3 F7 I6 W4 I7 W5 W6 W7",
                "F0 I0 F1 I1 F2 I2 F3 I3 W0 F4 I4 W1 F5 I5 W2 F6 I6 W3 F7 I7 W4 W5 W6 W7",
            }));
  EXPECT_EQ(orders(PipelineSchedule::ZeroBubble, 2, 4),
            (std::vector<std::string>{"F0 F1 I0 W0 F2 I1 W1 F3 I2 W2 I3 W3", "F0 I0 F1 I1 W0 F2 I2 W1 F3 I3 W2 W3"}));
  EXPECT_EQ(orders(PipelineSchedule::ZeroBubble, 4, 2),
            (std::vector<std::string>{"F0 F1 I0 W0 I1 W1", "F0 F1 I0 I1 W0 W1", "F0 F1 I0 I1 W0 W1",
                                      "F0 I0 F1 I1 W0 W1"}));
}

TEST(PipelineSchedule, EveryScheduleRunsWithoutWaitingOnItself) {
  for (const auto s : {PipelineSchedule::GPipe, PipelineSchedule::OneFOneB, PipelineSchedule::Interleaved1F1B,
                       PipelineSchedule::ZeroBubble}) {
    for (int p : {1, 2, 3, 4, 8}) {
      for (int m = 1; m <= 17; ++m) {
        for (int v : {1, 2, 3}) {
          if (v > 1 && s != PipelineSchedule::Interleaved1F1B) continue;
          if (v > 1 && m % std::max(1, m / p) != 0) continue;  // uneven rounds: refused, see below
          const auto schedule = parallel::pipeline_schedule(s, p, m, v);
          const std::string what = std::string(enum_name(s)) + " p=" + std::to_string(p) + " m=" +
                                   std::to_string(m) + " v=" + std::to_string(v);
          ASSERT_NO_THROW(parallel::simulate(schedule, v, m)) << what;
        }
      }
    }
  }
}

// The bubble (idle over busy time) with a backward twice a forward: GPipe
// and 1f1b (p - 1) / m, interleaved (p - 1) / (v m), zero bubble a third
// of 1f1b's; 1f1b holds at most p - r micro-batches' activations on rank r
// where GPipe holds all m.
TEST(PipelineSchedule, BubblesAndActivationsAreThePapers) {
  for (int p : {2, 4}) {
    for (int m : {4, 8, 16}) {
      const auto gpipe = parallel::simulate(parallel::pipeline_schedule(PipelineSchedule::GPipe, p, m), 1, m);
      const auto fb = parallel::simulate(parallel::pipeline_schedule(PipelineSchedule::OneFOneB, p, m), 1, m);
      EXPECT_NEAR(gpipe.bubble, (p - 1.0) / m, 1e-12) << p << " " << m;
      EXPECT_NEAR(fb.bubble, (p - 1.0) / m, 1e-12) << p << " " << m;
      for (int r = 0; r < p; ++r) {
        EXPECT_EQ(gpipe.peak_in_flight[r], m);
        EXPECT_EQ(fb.peak_in_flight[r], std::min(p - r, m)) << "rank " << r;
      }
      // Zero bubble, every half of equal cost: 3m + p - 1 units against
      // 1f1b's 3(m + p - 1), a third of the bubble, at 1f1b's peak of p.
      const auto zb = parallel::simulate(parallel::pipeline_schedule(PipelineSchedule::ZeroBubble, p, m), 1, m);
      EXPECT_DOUBLE_EQ(zb.makespan, 3.0 * m + p - 1);
      EXPECT_DOUBLE_EQ(fb.makespan, 3.0 * (m + p - 1));
      EXPECT_NEAR(zb.bubble, (p - 1.0) / (3.0 * m), 1e-12);
      for (int r = 0; r < p; ++r) EXPECT_EQ(zb.peak_in_flight[r], p) << "rank " << r;
      // Each of v stages costs 1/v of a rank's share of the layers.
      for (int v : {2, 4}) {
        const double c = 1.0 / v;
        const auto il = parallel::simulate(parallel::pipeline_schedule(PipelineSchedule::Interleaved1F1B, p, m, v),
                                           v, m, parallel::PipeCosts{c, c, c});
        EXPECT_NEAR(il.bubble, (p - 1.0) / (v * m), 1e-12) << "p=" << p << " m=" << m << " v=" << v;
      }
    }
  }
}

TEST(PipelineSchedule, BadShapesAreConfigErrors) {
  EXPECT_THROW(parallel::pipeline_schedule(PipelineSchedule::OneFOneB, 0, 4), ConfigError);
  EXPECT_THROW(parallel::pipeline_schedule(PipelineSchedule::OneFOneB, 2, 0), ConfigError);
  EXPECT_THROW(parallel::pipeline_schedule(PipelineSchedule::OneFOneB, 2, 4, 2), ConfigError);
  // 9 micro-batches over 4 ranks make 2 rounds, of 4 and 5: refused. (6
  // make one round of 6, and 8 two rounds of 4.)
  try {
    parallel::pipeline_schedule(PipelineSchedule::Interleaved1F1B, 4, 9, 2);
    FAIL() << "9 micro-batches in 2 rounds";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("9 micro-batches (batch.accumulate) do not make 2 equal rounds"),
              std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(parallel::pipeline_schedule(PipelineSchedule::Interleaved1F1B, 4, 6, 2));
}

// The simulator is what proves a schedule: an order that waits on itself,
// an action missing or on the wrong rank are refused, naming them.
TEST(PipelineSchedule, SimulatorRefusesOrdersThatHang) {
  auto schedule = parallel::pipeline_schedule(PipelineSchedule::OneFOneB, 2, 2);
  // Rank 1 runs its backward of micro-batch 1 before its forward of it.
  std::swap(schedule[1][2], schedule[1][3]);
  try {
    parallel::simulate(schedule, 1, 2);
    FAIL() << "a backward before its forward";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("hangs"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("rank 1 at B1@s1"), std::string::npos) << e.what();
  }
  schedule = parallel::pipeline_schedule(PipelineSchedule::OneFOneB, 2, 2);
  schedule[0].pop_back();
  EXPECT_THROW(parallel::simulate(schedule, 1, 2), ConfigError);
  schedule = parallel::pipeline_schedule(PipelineSchedule::OneFOneB, 2, 2);
  schedule[0][0].stage = 1;
  EXPECT_THROW(parallel::simulate(schedule, 1, 2), ConfigError);
}

// The stage cut against every cut (brute force): its largest stage is the
// least possible; hand cases for the ties and the explicit split.
TEST(PipelineStages, TheLargestStageIsTheLeastPossible) {
  std::mt19937 gen(7);
  for (int n = 1; n <= 9; ++n) {
    for (int stages = 1; stages <= n; ++stages) {
      std::vector<int64_t> units(static_cast<size_t>(n));
      for (auto& u : units) u = 1 + static_cast<int64_t>(gen() % 50);
      // Every cut: the stages - 1 boundaries among the n - 1 gaps.
      int64_t least = std::numeric_limits<int64_t>::max();
      for (uint32_t mask = 0; mask < (1u << (n - 1)); ++mask) {
        if (__builtin_popcount(mask) != stages - 1) continue;
        int64_t largest = 0, sum = 0;
        for (int i = 0; i < n; ++i) {
          sum += units[static_cast<size_t>(i)];
          if (i == n - 1 || (mask >> i & 1u)) {
            largest = std::max(largest, sum);
            sum = 0;
          }
        }
        least = std::min(least, largest);
      }
      const auto cut = parallel::split_stages(units, stages);
      ASSERT_EQ(static_cast<int>(cut.size()), stages);
      int64_t largest = 0;
      int at = 0;
      for (const auto& s : cut) {
        ASSERT_EQ(s.first, at);
        ASSERT_LT(s.first, s.end);
        int64_t sum = 0;
        for (int i = s.first; i < s.end; ++i) sum += units[static_cast<size_t>(i)];
        largest = std::max(largest, sum);
        at = s.end;
      }
      EXPECT_EQ(at, n);
      EXPECT_EQ(largest, least) << n << " units into " << stages;
    }
  }
  using R = parallel::StageRange;
  // An embedding as large as two layers, four layers, a head of one: 2+1 | 1+1+1 ... cuts of at most 3.
  EXPECT_EQ(parallel::split_stages({2, 1, 1, 1, 1, 1}, 2), (std::vector<R>{{0, 3}, {3, 6}}));
  EXPECT_EQ(parallel::split_stages({1, 1, 1, 1}, 4), (std::vector<R>{{0, 1}, {1, 2}, {2, 3}, {3, 4}}));
  // Explicit: stages start at decoder layers 2 and 3 of 4 (units 3 and 4).
  EXPECT_EQ(parallel::split_stages({5, 1, 1, 1, 1, 5}, 3, {2, 3}), (std::vector<R>{{0, 3}, {3, 4}, {4, 6}}));
  EXPECT_EQ(parallel::split_stages({5, 1, 1, 5}, 3, {0, 2}), (std::vector<R>{{0, 1}, {1, 3}, {3, 4}}));
  EXPECT_THROW(parallel::split_stages({1, 1, 1}, 4), ConfigError);
  EXPECT_THROW(parallel::split_stages({5, 1, 1, 5}, 3, {1}), ConfigError);     // too few entries
  EXPECT_THROW(parallel::split_stages({5, 1, 1, 5}, 3, {1, 1}), ConfigError);  // not increasing
  EXPECT_THROW(parallel::split_stages({5, 1, 1, 5}, 2, {3}), ConfigError);     // beyond the 2 layers
}
