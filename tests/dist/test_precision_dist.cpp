// fp16-mixed loss scaling across ranks, run by every rank under
// `shardtrain launch` at world sizes 2 and 3.
//
// The plugin is the test construction of fp16-mixed (the real plugin's code
// with autocast off), so real float16 gradients go through the real
// unscale_and_check: a local found-inf, then one MAX all-reduce. An inf or
// NaN injected on the last rank only must make every rank skip that step,
// and after every update() all ranks must hold the same scale. Separately,
// float16 gradients reduced with the communicator must carry an inf/NaN from
// one rank to all, so a found-inf check after the reduction agrees as well.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <map>

#include "precision/detail.h"
#include "shardtrain/comm/communicator.h"
#include "shardtrain/core/error.h"
#include "shardtrain/precision/precision.h"
#include "world.h"

using namespace shardtrain;
using namespace shardtrain::comm;
using namespace shardtrain::precision;

namespace {

std::shared_ptr<Communicator>& g_world = ::shardtrain::testing::world_ptr();
int rank() { return g_world->rank(); }
int world_size() { return g_world->size(); }
int last_rank() { return world_size() - 1; }

constexpr float kInf = std::numeric_limits<float>::infinity();

// Sizes: empty, one element, and sizes no world size divides.
const std::vector<int64_t> kSizes = {0, 1, 7, 1001, 40009};

// This rank's float16 gradients for `step`, as backward of a loss scaled by
// `scale` would leave them: unscaled values in [-4, 4] on a 1/64 grid times
// the scale (a power of two), so unscaling is exact.
std::vector<torch::Tensor> scaled_grads(int step, double scale, std::vector<torch::Tensor>* unscaled) {
  torch::manual_seed(1000 * step + rank());
  std::vector<torch::Tensor> grads;
  unscaled->clear();
  for (int64_t n : kSizes) {
    auto g = torch::randint(-256, 257, {n}).to(torch::kFloat) / 64;
    unscaled->push_back(g.to(torch::kHalf));
    grads.push_back((g * scale).to(torch::kHalf));
  }
  return grads;
}

// The scale on every rank, checked equal with a MAX and a MIN all-reduce.
void expect_same_scale_everywhere(double scale, int step) {
  auto hi = torch::full({1}, scale, torch::kDouble);
  auto lo = hi.clone();
  g_world->all_reduce(hi, AllReduceOptions().op(ReduceOp::Max)).wait();
  g_world->all_reduce(lo, AllReduceOptions().op(ReduceOp::Min)).wait();
  EXPECT_EQ(hi.item<double>(), scale) << "step " << step;
  EXPECT_EQ(lo.item<double>(), scale) << "step " << step;
}

}  // namespace

TEST(PrecisionDist, OverflowOnOneRankSkipsTheStepOnEveryRank) {
  LossScalerOptions o;
  o.initial_scale_power(10);  // 1024: scaled values stay inside float16
  o.loss_scale_window(3);
  o.hysteresis(2);
  auto plugin = precision::detail::make_fp16_mixed_for_tests(o);
  DynamicLossScaler reference(o);  // fed the expected outcomes locally

  // Step -> what the last rank injects: +inf, -inf, NaN (steps 6 and 7 in a
  // row exhaust the hysteresis, so the scale backs off).
  const std::map<int, float> injected = {{2, kInf}, {6, -kInf}, {7, std::nanf("")}, {12, kInf}};
  const int kSteps = 16;
  for (int step = 0; step < kSteps; ++step) {
    const double scale = plugin->loss_scale();
    std::vector<torch::Tensor> unscaled;
    auto grads = scaled_grads(step, scale, &unscaled);
    const auto it = injected.find(step);
    const bool overflow = it != injected.end();
    if (overflow && rank() == last_rank()) grads[3][500] = it->second;

    const auto seq = g_world->sequence_number();
    const bool skip = plugin->unscale_and_check(grads, *g_world);
    EXPECT_EQ(g_world->sequence_number(), seq + 1) << "one all-reduce per check";
    EXPECT_EQ(skip, overflow) << "step " << step << " rank " << rank();
    if (!overflow) {
      for (size_t i = 0; i < grads.size(); ++i) {
        EXPECT_TRUE(torch::equal(grads[i], unscaled[i])) << "step " << step << " tensor " << i;
      }
    }
    plugin->update(skip);
    reference.update(overflow);
    EXPECT_EQ(plugin->loss_scale(), reference.scale()) << "step " << step;
    expect_same_scale_everywhere(plugin->loss_scale(), step);
  }
  EXPECT_EQ(plugin->skipped_steps(), static_cast<int64_t>(injected.size()));
  // 1024: clean 0,1 -> 2 overflow (absorbed) -> clean 3,4,5 (grow at 5: 2048)
  // -> 6 absorbed, 7 backs off (1024) -> clean 8..11 (grow at 10: 2048)
  // -> 12 absorbed -> clean 13,14,15 (grow at 15: 4096).
  EXPECT_EQ(plugin->loss_scale(), 4096.0);
}

TEST(PrecisionDist, ReducedFloat16GradientsCarryInfAndNanToEveryRank) {
  const int64_t n = 1003;  // no world size divides it; the specials sit in different shards
  auto g = torch::full({n}, 0.5 * (rank() + 1), torch::kHalf);
  auto h = torch::full({n}, 1.0, torch::kHalf);
  if (rank() == last_rank()) {
    g[3] = kInf;
    g[n / 2] = std::nanf("");
    g[n - 1] = -kInf;
  }
  // +inf and -inf from different ranks sum to NaN.
  if (rank() == 0) h[10] = kInf;
  if (rank() == last_rank()) h[10] = -kInf;

  g_world->all_reduce(g).wait();
  g_world->all_reduce(h).wait();

  const double w = world_size();
  const double expected = 0.5 * w * (w + 1) / 2;  // sum of 0.5 * (r + 1)
  auto gf = g.to(torch::kFloat);
  EXPECT_TRUE(std::isinf(gf[3].item<float>()) && gf[3].item<float>() > 0);
  EXPECT_TRUE(std::isnan(gf[n / 2].item<float>()));
  EXPECT_TRUE(std::isinf(gf[n - 1].item<float>()) && gf[n - 1].item<float>() < 0);
  EXPECT_TRUE(std::isnan(h.to(torch::kFloat)[10].item<float>()));
  auto finite = torch::isfinite(gf);
  EXPECT_EQ(finite.logical_not().sum().item<int64_t>(), 3);
  EXPECT_TRUE(torch::all(gf.masked_select(finite) == expected).item<bool>());

  // A found-inf check after the reduction agrees on every rank: locally...
  EXPECT_TRUE(unscale_and_find_inf({g.clone()}, 1.0));
  EXPECT_TRUE(unscale_and_find_inf({h.clone()}, 1.0));
  // ...and through the plugin (whose all-reduce then changes nothing).
  auto plugin = precision::detail::make_fp16_mixed_for_tests();
  EXPECT_TRUE(plugin->unscale_and_check({g}, *g_world));
  auto clean = torch::ones({n}, torch::kHalf);
  g_world->all_reduce(clean).wait();
  EXPECT_FALSE(plugin->unscale_and_check({clean}, *g_world));
}
