// Strategies within one process: make_strategy, bucket planning, the single
// strategy's clipping and accumulation, and DDP on a world of one.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "shardtrain/comm/communicator.h"
#include "shardtrain/core/error.h"
#include "shardtrain/strategy/strategy.h"
#include "strategy/detail.h"

using namespace shardtrain;
using shardtrain::strategy::StrategyOptions;
namespace sd = shardtrain::strategy::detail;

namespace {

std::shared_ptr<comm::Communicator> world_of_one_rank() {
  return comm::Communicator::create(comm::CommOptions().rank(0).world_size(1));
}

StrategyOptions named(const std::string& name) {
  return StrategyOptions().strategy(enum_from_name<strategy::StrategyKind>(name, "strategy"));
}

torch::nn::Sequential make_mlp() {
  torch::manual_seed(3);
  return torch::nn::Sequential(torch::nn::Linear(6, 20), torch::nn::GELU(),
                               torch::nn::Linear(20, 3));
}

torch::nn::Sequential clone_mlp(const torch::nn::Sequential& m) {
  return torch::nn::Sequential(std::dynamic_pointer_cast<torch::nn::SequentialImpl>(m->clone()));
}

void give_grads(torch::nn::Sequential& m, double scale) {
  torch::manual_seed(11);
  auto x = torch::randn({8, 6});
  (m->forward(x).pow(2).sum() * scale).backward();
}

}  // namespace

TEST(MakeStrategy, BuildsSingleAndDdp) {
  EXPECT_EQ(strategy::make_strategy(named("single"))->name(), "single");
  EXPECT_EQ(strategy::make_strategy(named("ddp"))->name(), "ddp");
  EXPECT_EQ(strategy::make_strategy(StrategyOptions{})->name(), "ddp");
}

TEST(MakeStrategy, UnknownNameIsConfigErrorListingTheChoices) {
  try {
    named("fsdp3");
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("'fsdp3'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("single, ddp"), std::string::npos) << msg;
  }
}

TEST(MakeStrategy, RejectsNonPositiveBucketSizes) {
  auto o = named("ddp");
  o.bucket_cap_mb(0);
  EXPECT_THROW(strategy::make_strategy(o), ConfigError);
  o = named("ddp");
  o.first_bucket_mb(-1);
  EXPECT_THROW(strategy::make_strategy(o), ConfigError);
}

TEST(PlanBuckets, ReverseOrderGreedyByBytesSplitOnDtype) {
  const std::vector<at::Tensor> t = {
      torch::zeros({10}),                  // 0: 40 B
      torch::zeros({0}),                   // 1: 0 B
      torch::zeros({100}),                 // 2: 400 B, larger than the cap
      torch::zeros({5}, torch::kDouble),   // 3: 40 B, other dtype
      torch::zeros({4}),                   // 4: 16 B
      torch::zeros({6}),                   // 5: 24 B
  };
  // first bucket <= 32 B, then <= 128 B.
  const auto plan = sd::plan_buckets(t, 32, 128);
  using V = std::vector<size_t>;
  ASSERT_EQ(plan.size(), 5u);
  EXPECT_EQ(plan[0], (V{5}));     // 24 B; adding 16 would pass 32
  EXPECT_EQ(plan[1], (V{4}));     // then the dtype changes
  EXPECT_EQ(plan[2], (V{3}));     // double alone
  EXPECT_EQ(plan[3], (V{2}));     // larger than the cap: alone
  EXPECT_EQ(plan[4], (V{1, 0}));  // the empty one rides along
  EXPECT_TRUE(sd::plan_buckets({}, 32, 128).empty());
}

TEST(Single, ClipGradNormMatchesTorch) {
  for (double max_norm : {0.05, 1e6, 0.0}) {
    auto a = make_mlp();
    auto b = clone_mlp(a);
    give_grads(a, 1.0);
    give_grads(b, 1.0);
    auto s = strategy::make_strategy(named("single"));
    s->setup(*a, world_of_one_rank());
    const double got = s->clip_grad_norm(max_norm);
    // torch clips whenever called; max_norm 0 means "no clipping" for us.
    const double want = max_norm > 0 ? torch::nn::utils::clip_grad_norm_(b->parameters(), max_norm)
                                     : torch::nn::utils::clip_grad_norm_(b->parameters(), 1e30);
    EXPECT_NEAR(got, want, 1e-5 * want) << "max_norm " << max_norm;
    for (size_t i = 0; i < a->parameters().size(); ++i) {
      EXPECT_TRUE(torch::allclose(a->parameters()[i].grad(), b->parameters()[i].grad(), 1e-5, 1e-7))
          << "max_norm " << max_norm << " param " << i;
    }
    if (max_norm == 0.05) {
      EXPECT_GT(got, max_norm);  // the test really clipped
      EXPECT_NEAR(s->clip_grad_norm(0.0), max_norm, 1e-6);
    }
  }
}

TEST(Single, ClipWithoutGradientsIsZero) {
  auto m = make_mlp();
  auto s = strategy::make_strategy(named("single"));
  s->setup(*m, world_of_one_rank());
  EXPECT_EQ(s->clip_grad_norm(1.0), 0.0);
}

// k micro-steps of b rows, loss / k, equal one step over k*b rows; the
// single strategy never communicates.
TEST(Single, AccumulationEqualsLargeBatchWithoutCommunication) {
  constexpr int kMicro = 3;
  torch::manual_seed(5);
  auto x = torch::randn({kMicro * 4, 6});
  auto y = torch::randn({kMicro * 4, 3});
  auto model = make_mlp();
  auto ref = clone_mlp(model);
  auto world = world_of_one_rank();
  auto s = strategy::make_strategy(named("single"));
  s->setup(*model, world);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  const auto seq = world->sequence_number();
  for (int step = 0; step < 3; ++step) {
    ref_opt.zero_grad();
    torch::mse_loss(ref->forward(x), y).backward();
    ref_opt.step();
    opt.zero_grad();
    for (int j = 0; j < kMicro; ++j) {
      s->set_gradient_sync(j == kMicro - 1);
      (torch::mse_loss(model->forward(x.narrow(0, j * 4, 4)), y.narrow(0, j * 4, 4)) / kMicro)
          .backward();
    }
    s->finish_gradient_sync();
    s->optimizer_step(opt);
    for (size_t i = 0; i < ref->parameters().size(); ++i) {
      EXPECT_TRUE(torch::allclose(model->parameters()[i], ref->parameters()[i], 1e-4, 1e-5))
          << "step " << step << " param " << i;
    }
  }
  EXPECT_EQ(s->gradient_collectives(), 0);
  EXPECT_EQ(world->sequence_number(), seq);
}

TEST(DDPWorldOfOne, GradientsEqualLocalOnesAndSyncOffCommunicatesNothing) {
  auto model = make_mlp();
  auto ref = clone_mlp(model);
  auto s = strategy::make_strategy(named("ddp"));
  s->setup(*model, world_of_one_rank());
  s->set_gradient_sync(false);
  give_grads(model, 1.0);
  EXPECT_EQ(s->gradient_collectives(), 0);
  s->finish_gradient_sync();  // sync off: a no-op
  EXPECT_EQ(s->gradient_collectives(), 0);
  s->set_gradient_sync(true);
  give_grads(model, 1.0);
  s->finish_gradient_sync();
  EXPECT_EQ(s->gradient_collectives(), 1);
  give_grads(ref, 2.0);  // two backwards accumulated
  for (size_t i = 0; i < ref->parameters().size(); ++i) {
    EXPECT_TRUE(torch::allclose(model->parameters()[i].grad(), ref->parameters()[i].grad(), 1e-5,
                                1e-6));
  }
}

TEST(DDPWorldOfOne, SecondBackwardBeforeFinishIsAnError) {
  auto model = make_mlp();
  auto s = strategy::make_strategy(named("ddp"));
  s->setup(*model, world_of_one_rank());
  give_grads(model, 1.0);
  EXPECT_THROW(give_grads(model, 1.0), std::exception);
}

TEST(DDPWorldOfOne, CallsBeforeSetupAreErrors) {
  auto s = strategy::make_strategy(named("ddp"));
  EXPECT_THROW(s->finish_gradient_sync(), InvalidArgument);
  EXPECT_THROW(s->clip_grad_norm(1.0), InvalidArgument);
}

TEST(DDPWorldOfOne, DestroyedStrategyLeavesNoHooks) {
  auto model = make_mlp();
  {
    auto s = strategy::make_strategy(named("ddp"));
    s->setup(*model, world_of_one_rank());
  }
  // Two backwards without finish would be an error if the hooks remained.
  give_grads(model, 1.0);
  EXPECT_NO_THROW(give_grads(model, 1.0));
}

// Buckets reduce in distributed.reduce_dtype: with bf16 the gradients come
// back rounded to bfloat16 once (a world of one adds nothing), with fp32 they
// come back exact; an unknown dtype is a ConfigError.
TEST(DDPWorldOfOne, GradientsReduceInTheConfiguredDtype) {
  for (const std::string dtype : {"fp32", "bf16"}) {
    auto model = make_mlp();
    auto ref = clone_mlp(model);
    auto options = named("ddp");
    options.reduce_dtype(enum_from_name<strategy::DType>(dtype, "reduce_dtype"));
    auto s = strategy::make_strategy(options);
    s->setup(*model, world_of_one_rank());
    give_grads(model, 1.0);
    s->finish_gradient_sync();
    give_grads(ref, 1.0);
    for (size_t i = 0; i < ref->parameters().size(); ++i) {
      const auto got = model->parameters()[i].grad();
      EXPECT_EQ(got.scalar_type(), torch::kFloat);
      const auto local = ref->parameters()[i].grad();
      const auto want = dtype == "bf16" ? local.to(torch::kBFloat16).to(torch::kFloat) : local;
      EXPECT_TRUE(torch::equal(got, want)) << dtype << " param " << i;
    }
  }
  EXPECT_THROW(enum_from_name<strategy::DType>("fp8", "distributed.reduce_dtype"), ConfigError);
}

// chunk_runs against torch's own slicing: the chunk's elements, taken from
// the whole tensor by narrow + cat, sit where the runs say. Splits of dim 0
// (one run), of dim 1 (a run per row), three blocks of dim 0 (GPT's fused
// q|k|v), of a 3-D tensor's middle dimension, and partial runs that start
// and end inside rows, including empty and one-element ones.
TEST(ChunkRuns, PlaceEachElementWhereTorchSlicingDoes) {
  using shardtrain::strategy::TensorChunk;
  struct Case {
    std::vector<int64_t> shape;
    TensorChunk chunk;
  };
  const std::vector<Case> cases = {
      {{6, 5}, {0, {{2, 3}}}},
      {{6, 5}, {1, {{3, 2}}}},
      {{9, 4}, {0, {{1, 2}, {4, 2}, {7, 2}}}},
      {{3, 7, 2}, {1, {{0, 1}, {5, 2}}}},
      {{7}, {0, {{4, 3}}}},
      {{6, 5}, {-1, {}}},
  };
  for (const auto& c : cases) {
    const at::Tensor whole = at::arange(c10::multiply_integers(c.shape), at::kLong).view(c.shape);
    at::Tensor block = whole;
    if (!c.chunk.whole()) {
      std::vector<at::Tensor> parts;
      for (const auto& [start, length] : c.chunk.ranges) parts.push_back(whole.narrow(c.chunk.dim, start, length));
      block = at::cat(parts, c.chunk.dim);
    }
    EXPECT_EQ(c.chunk.shape(c.shape), block.sizes().vec());
    const at::Tensor flat = block.contiguous().view({-1});
    const int64_t n = flat.numel();
    for (int64_t first : {int64_t{0}, int64_t{1}, n / 2, n - 1, n}) {
      for (int64_t count : {int64_t{0}, int64_t{1}, n - first}) {
        if (first + count > n) continue;
        int64_t covered = 0, next_local = 0;
        for (const auto& run : shardtrain::strategy::chunk_runs(c.shape, c.chunk, first, count)) {
          EXPECT_EQ(run.local, next_local) << "runs are in order and contiguous in the chunk";
          EXPECT_TRUE(at::equal(whole.view({-1}).narrow(0, run.global, run.count),
                                flat.narrow(0, first + run.local, run.count)))
              << "shape " << at::IntArrayRef(c.shape) << " dim " << c.chunk.dim << " first " << first;
          next_local += run.count;
          covered += run.count;
        }
        EXPECT_EQ(covered, count);
      }
    }
  }
}
