// DDP against the single-process reference, run by every rank under
// `shardtrain launch` at world sizes 1, 2 and 3.
//
// Every rank builds the same model from the same seed, then ranks != 0
// perturb their copy, so matching the reference also proves setup's
// broadcast. The data set is generated from a fixed seed, identical on every
// rank; of a global batch of G rows rank k takes rows [k*G/W, (k+1)*G/W) and
// its loss is the mean over its rows, so DDP's average over ranks is the mean
// over the global batch. Every rank also trains the reference locally (a
// separate copy, full batch, no strategy) and compares after each step.
//
// Tolerance (fp32): |ddp - ref| <= 1e-5 + 1e-4 * |ref| for every parameter,
// gradient and loss. The only differences are the order of float32
// additions (the ring all-reduce sums per-rank partial gradients; the
// reference sums over the whole batch at once).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "shardtrain/comm/communicator.h"
#include "shardtrain/core/error.h"
#include "shardtrain/strategy/strategy.h"
#include "world.h"
#include "strategy/detail.h"

using namespace shardtrain;
using namespace shardtrain::comm;
using shardtrain::strategy::StrategyOptions;
using shardtrain::strategy::detail::DDPStrategy;

namespace {

constexpr double kAtol = 1e-5;
constexpr double kRtol = 1e-4;

std::shared_ptr<Communicator>& g_world = ::shardtrain::testing::world_ptr();
int rank() { return g_world->rank(); }
int world_size() { return g_world->size(); }

// 16 -> 48 -> 48 -> 5: 3413 parameters, not divisible by 2 or 3. Every
// step reduces all of them once, in fp32.
constexpr int64_t kIn = 16, kHidden = 48, kOut = 5;
constexpr int64_t kParamBytes = 3413 * 4;
torch::nn::Sequential make_mlp() {
  torch::manual_seed(42);
  return torch::nn::Sequential(torch::nn::Linear(kIn, kHidden), torch::nn::GELU(),
                               torch::nn::Linear(kHidden, kHidden), torch::nn::GELU(),
                               torch::nn::Linear(kHidden, kOut));
}

torch::nn::Sequential clone_mlp(const torch::nn::Sequential& m) {
  return torch::nn::Sequential(std::dynamic_pointer_cast<torch::nn::SequentialImpl>(m->clone()));
}

// Ranks other than 0 start from different weights; setup must undo that.
void perturb_unless_rank0(torch::nn::Module& m) {
  if (rank() == 0) return;
  torch::NoGradGuard no_grad;
  for (auto& p : m.parameters()) p.add_(0.25 * rank());
}

// Small caps: first bucket 1 KB, others 4 KB -> 4 buckets for the MLP:
// {4.bias, 4.weight}, {2.bias}, {2.weight (9 KB, alone)}, {0.bias, 0.weight}.
StrategyOptions small_buckets() {
  // 1 KiB and 4 KiB, in the options' MiB.
  StrategyOptions o;
  o.strategy(strategy::StrategyKind::Ddp).first_bucket_mb(1024.0 / (1 << 20)).bucket_cap_mb(4096.0 / (1 << 20));
  return o;
}

struct Data {
  torch::Tensor x, y;  // [steps, rows, features]
};
Data make_data(int64_t steps, int64_t rows) {
  torch::manual_seed(1234);
  return {torch::randn({steps, rows, kIn}), torch::randn({steps, rows, kOut})};
}

// This rank's rows of a global batch.
torch::Tensor my_rows(const torch::Tensor& batch) {
  const int64_t g = batch.size(0);
  EXPECT_EQ(g % world_size(), 0) << "test batch must divide by the world size";
  const int64_t per = g / world_size();
  return batch.narrow(0, rank() * per, per);
}

void expect_close(const torch::Tensor& got, const torch::Tensor& want, const std::string& what) {
  ASSERT_TRUE(got.defined()) << what << ": undefined";
  ASSERT_TRUE(want.defined()) << what << ": reference undefined";
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const bool ok = torch::allclose(got, want, kRtol, kAtol);
  EXPECT_TRUE(ok) << what << " (rank " << rank() << "): max |diff| "
                  << (got - want).abs().max().item<double>();
}

void expect_params_close(torch::nn::Module& got, torch::nn::Module& want, const std::string& what) {
  auto a = got.named_parameters();
  auto b = want.named_parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    expect_close(a[i].value(), b[i].value(), what + " " + a[i].key());
  }
}

void expect_grads_close(torch::nn::Module& got, torch::nn::Module& want, const std::string& what) {
  auto a = got.named_parameters();
  auto b = want.named_parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    expect_close(a[i].value().grad(), b[i].value().grad(), what + " grad " + a[i].key());
  }
}

// Global mean of a per-rank value (the ranks' losses are means over equal
// row counts, so this is the loss over the whole global batch).
double global_mean(const torch::Tensor& local) {
  auto t = local.detach().to(torch::kDouble).reshape({1}).contiguous();
  g_world->all_reduce(t, AllReduceOptions().op(ReduceOp::Avg));
  return t.item<double>();
}

DDPStrategy& as_ddp(strategy::Strategy& s) { return dynamic_cast<DDPStrategy&>(s); }

enum class Opt { SgdMomentum, AdamW };

std::unique_ptr<torch::optim::Optimizer> make_optimizer(Opt which, std::vector<torch::Tensor> p) {
  if (which == Opt::SgdMomentum) {
    return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.05).momentum(0.9));
  }
  return std::make_unique<torch::optim::AdamW>(
      p, torch::optim::AdamWOptions(1e-3).weight_decay(0.01));
}

// ≥ 10 steps of DDP and of the reference, compared after every step.
void run_parity(Opt which, const StrategyOptions& options, double max_norm, size_t want_buckets) {
  constexpr int64_t kSteps = 10, kBatch = 12;
  auto data = make_data(kSteps, kBatch);
  auto model = make_mlp();
  auto ref = clone_mlp(model);
  perturb_unless_rank0(*model);

  auto strategy = strategy::make_strategy(options);
  strategy->setup(*model, g_world);
  // Broadcast: bit-identical to rank 0's (= the reference's) weights.
  for (size_t i = 0; i < model->parameters().size(); ++i) {
    ASSERT_TRUE(torch::equal(model->parameters()[i], ref->parameters()[i])) << "after setup";
  }
  auto& ddp = as_ddp(*strategy);
  ASSERT_EQ(ddp.num_buckets(), want_buckets);

  auto opt = make_optimizer(which, model->parameters());
  auto ref_opt = make_optimizer(which, ref->parameters());
  for (int64_t s = 0; s < kSteps; ++s) {
    const std::string step = "step " + std::to_string(s);
    // Reference: the whole global batch in one process.
    ref_opt->zero_grad();
    auto ref_loss = torch::mse_loss(ref->forward(data.x[s]), data.y[s]);
    ref_loss.backward();
    double ref_norm = 0.0;
    if (max_norm > 0) {
      ref_norm = torch::nn::utils::clip_grad_norm_(ref->parameters(), max_norm);
      EXPECT_GT(ref_norm, 4 * max_norm) << step << ": the clip must fire hard";
    }
    ref_opt->step();

    // DDP: this rank's rows.
    const int64_t before = strategy->gradient_collectives();
    opt->zero_grad();
    auto loss = torch::mse_loss(model->forward(my_rows(data.x[s])), my_rows(data.y[s]));
    loss.backward();
    strategy->finish_gradient_sync();
    EXPECT_EQ(strategy->gradient_collectives() - before, static_cast<int64_t>(want_buckets));
    EXPECT_EQ(strategy->comm_stats().reduced_bytes, kParamBytes) << step;
    if (max_norm > 0) {
      const double norm = strategy->clip_grad_norm(max_norm);
      EXPECT_NEAR(norm, ref_norm, kAtol + kRtol * ref_norm) << step;
    }
    strategy->optimizer_step(*opt);

    const double got_loss = global_mean(loss);
    EXPECT_NEAR(got_loss, ref_loss.item<double>(), kAtol + kRtol * std::abs(ref_loss.item<double>()))
        << step;
    expect_params_close(*model, *ref, step);
    if (::testing::Test::HasFailure()) return;
  }
}

}  // namespace

TEST(DDP, BucketPlanIsReverseRegistrationOrderPackedByBytes) {
  auto model = make_mlp();
  auto strategy = strategy::make_strategy(small_buckets());
  strategy->setup(*model, g_world);
  auto& ddp = as_ddp(*strategy);
  ASSERT_EQ(ddp.num_buckets(), 4u);
  using V = std::vector<std::string>;
  EXPECT_EQ(ddp.bucket_parameter_names(0), (V{"4.bias", "4.weight"}));
  EXPECT_EQ(ddp.bucket_parameter_names(1), (V{"2.bias"}));
  EXPECT_EQ(ddp.bucket_parameter_names(2), (V{"2.weight"}));
  EXPECT_EQ(ddp.bucket_parameter_names(3), (V{"0.bias", "0.weight"}));

  auto one = strategy::make_strategy(StrategyOptions{});  // defaults: 1 MB first bucket
  one->setup(*make_mlp(), g_world);
  EXPECT_EQ(as_ddp(*one).num_buckets(), 1u);
}

TEST(DDP, ParitySgdMomentumOneBucket) {
  run_parity(Opt::SgdMomentum, StrategyOptions{}, /*max_norm=*/0.0, 1);
}

// Gradient norms here are 0.35 or more: a limit of 0.05 scales every step's
// gradient by a seventh or less, so a clip computed but not applied fails.
TEST(DDP, ParitySgdMomentumSmallBucketsClipped) {
  run_parity(Opt::SgdMomentum, small_buckets(), /*max_norm=*/0.05, 4);
}

TEST(DDP, ParityAdamWClipped) {
  run_parity(Opt::AdamW, StrategyOptions{}, /*max_norm=*/0.05, 1);
}

TEST(DDP, ParityAdamWSmallBuckets) {
  run_parity(Opt::AdamW, small_buckets(), /*max_norm=*/0.0, 4);
}

// k micro-steps of b rows each (sync only on the last, loss / k) equal one
// step over k*b rows; communication happens once per optimizer step.
TEST(DDP, AccumulationEqualsLargeBatchAndReducesOncePerStep) {
  constexpr int64_t kSteps = 3, kMicro = 3, kMicroRows = 6;  // 6 divides by 1, 2, 3
  auto data = make_data(kSteps, kMicro * kMicroRows);
  auto model = make_mlp();
  auto ref = clone_mlp(model);
  perturb_unless_rank0(*model);
  auto strategy = strategy::make_strategy(small_buckets());
  strategy->setup(*model, g_world);
  const int64_t buckets = static_cast<int64_t>(as_ddp(*strategy).num_buckets());

  auto opt = make_optimizer(Opt::SgdMomentum, model->parameters());
  auto ref_opt = make_optimizer(Opt::SgdMomentum, ref->parameters());
  for (int64_t s = 0; s < kSteps; ++s) {
    const std::string step = "step " + std::to_string(s);
    ref_opt->zero_grad();
    torch::mse_loss(ref->forward(data.x[s]), data.y[s]).backward();
    ref_opt->step();

    const int64_t collectives = strategy->gradient_collectives();
    const uint64_t sequence = g_world->sequence_number();
    opt->zero_grad();
    for (int64_t j = 0; j < kMicro; ++j) {
      strategy->set_gradient_sync(j == kMicro - 1);
      auto x = my_rows(data.x[s].narrow(0, j * kMicroRows, kMicroRows));
      auto y = my_rows(data.y[s].narrow(0, j * kMicroRows, kMicroRows));
      (torch::mse_loss(model->forward(x), y) / kMicro).backward();
      if (j < kMicro - 1) {
        EXPECT_EQ(strategy->gradient_collectives(), collectives) << step << " micro " << j;
      }
    }
    strategy->finish_gradient_sync();
    // Exactly one all-reduce per bucket per optimizer step, as the
    // communicator itself counts too.
    EXPECT_EQ(strategy->gradient_collectives() - collectives, buckets) << step;
    EXPECT_EQ(static_cast<int64_t>(g_world->sequence_number() - sequence), buckets) << step;
    EXPECT_EQ(strategy->comm_stats().reduced_bytes, kParamBytes) << step;
    strategy->optimizer_step(*opt);
    expect_params_close(*model, *ref, step);
    if (::testing::Test::HasFailure()) return;
  }
}

// The all-reduces of the last layers start while backward still works on the
// first layer: a hook on the first layer's output gradient (which runs only
// after the later layers' gradients are done) already sees launched buckets.
TEST(DDP, BucketsLaunchDuringBackward) {
  auto data = make_data(1, 12);
  auto model = make_mlp();
  auto strategy = strategy::make_strategy(small_buckets());
  strategy->setup(*model, g_world);
  auto& ddp = as_ddp(*strategy);
  ASSERT_GE(ddp.num_buckets(), 2u);

  int64_t launched_when_first_layer_reached = -1;
  auto h = model->at<torch::nn::LinearImpl>(0).forward(my_rows(data.x[0]));
  h.register_hook([&](torch::Tensor) { launched_when_first_layer_reached = ddp.buckets_launched_in_backward(); });
  h = model->at<torch::nn::GELUImpl>(1).forward(h);
  h = model->at<torch::nn::LinearImpl>(2).forward(h);
  h = model->at<torch::nn::GELUImpl>(3).forward(h);
  h = model->at<torch::nn::LinearImpl>(4).forward(h);
  torch::mse_loss(h, my_rows(data.y[0])).backward();
  // Buckets 0-2 hold the parameters of layers 4 and 2.
  EXPECT_GE(launched_when_first_layer_reached, 1);
  // Every parameter was used, so every bucket started from a hook.
  EXPECT_EQ(ddp.buckets_launched_in_backward(), static_cast<int64_t>(ddp.num_buckets()));
  strategy->finish_gradient_sync();
  EXPECT_EQ(strategy->gradient_collectives(), static_cast<int64_t>(ddp.num_buckets()));
}

namespace {

// fc1 -> fc2 always; `extra` only when asked; `unused` never.
struct TwoBranchImpl : torch::nn::Module {
  TwoBranchImpl() {
    torch::manual_seed(7);
    fc1 = register_module("fc1", torch::nn::Linear(kIn, 10));
    fc2 = register_module("fc2", torch::nn::Linear(10, kOut));
    extra = register_module("extra", torch::nn::Linear(10, kOut));
    unused = register_parameter("unused", torch::randn({7}));
  }
  torch::Tensor forward(const torch::Tensor& x, bool use_extra) {
    auto h = torch::gelu(fc1->forward(x));
    auto y = fc2->forward(h);
    return use_extra ? y + extra->forward(h) : y;
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, extra{nullptr};
  torch::Tensor unused;
};
TORCH_MODULE(TwoBranch);

StrategyOptions tiny_buckets(bool find_unused) {
  StrategyOptions o;
  o.first_bucket_mb(64.0 / (1 << 20)).bucket_cap_mb(256.0 / (1 << 20)).find_unused_parameters(find_unused);
  return o;
}

// After finish_gradient_sync: `unused` got zeros on every rank (the
// reference never gives it a gradient, so it gets zeros for the
// comparison), the gradients agree, and after one step on each so do the
// parameters.
void step_both_and_compare(TwoBranch& model, TwoBranch& ref, strategy::Strategy& strategy,
                           torch::optim::SGD& opt, torch::optim::SGD& ref_opt, const std::string& step) {
  ASSERT_TRUE(model->unused.grad().defined()) << step;
  EXPECT_TRUE(torch::equal(model->unused.grad(), torch::zeros({7}))) << step;
  ref->unused.mutable_grad() = torch::zeros({7});
  expect_grads_close(*model, *ref, step);
  strategy.optimizer_step(opt);
  ref_opt.step();
  expect_params_close(*model, *ref, step);
}

}  // namespace

TEST(DDP, UnusedParameterIsAnErrorThatNamesIt) {
  auto data = make_data(1, 12);
  TwoBranch model;
  auto strategy = strategy::make_strategy(tiny_buckets(false));
  strategy->setup(*model, g_world);
  torch::mse_loss(model->forward(my_rows(data.x[0]), /*use_extra=*/false), my_rows(data.y[0]))
      .backward();
  try {
    strategy->finish_gradient_sync();
    FAIL() << "expected an error naming the unused parameters";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("'unused'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("'extra.weight'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("'extra.bias'"), std::string::npos) << msg;
    EXPECT_EQ(msg.find("'fc1.weight'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("find_unused_parameters: true"), std::string::npos) << msg;
  }
  // The buckets that did start were drained: the ranks are still in step.
  g_world->barrier();
  auto t = torch::full({3}, static_cast<float>(rank()));
  g_world->all_reduce(t, AllReduceOptions().op(ReduceOp::Max));
  EXPECT_TRUE(torch::equal(t, torch::full({3}, static_cast<float>(world_size() - 1))));
}

// With find_unused_parameters, a parameter nobody used gets a zero gradient
// on every rank, and one that only rank 0 used gets rank 0's gradient / W,
// exactly what the single-process reference computes for the global loss
// (1/W) * sum_r loss_r.
TEST(DDP, FindUnusedParametersReducesZerosAndPartialUse) {
  constexpr int64_t kSteps = 3, kBatch = 12;
  auto data = make_data(kSteps, kBatch);
  TwoBranch model, ref;  // same seed: same weights
  perturb_unless_rank0(*model);
  auto strategy = strategy::make_strategy(tiny_buckets(true));
  strategy->setup(*model, g_world);
  const int64_t buckets = static_cast<int64_t>(as_ddp(*strategy).num_buckets());
  ASSERT_GE(buckets, 3);

  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1));
  const auto unused_before = model->unused.detach().clone();
  const int64_t per = kBatch / world_size();
  for (int64_t s = 0; s < kSteps; ++s) {
    const std::string step = "step " + std::to_string(s);
    ref_opt.zero_grad();
    torch::Tensor ref_loss = torch::zeros({});
    for (int r = 0; r < world_size(); ++r) {
      auto x = data.x[s].narrow(0, r * per, per);
      auto y = data.y[s].narrow(0, r * per, per);
      ref_loss = ref_loss + torch::mse_loss(ref->forward(x, r == 0), y);
    }
    (ref_loss / world_size()).backward();

    const int64_t before = strategy->gradient_collectives();
    opt.zero_grad();
    torch::mse_loss(model->forward(my_rows(data.x[s]), rank() == 0), my_rows(data.y[s]))
        .backward();
    strategy->finish_gradient_sync();
    EXPECT_EQ(strategy->gradient_collectives() - before, buckets) << step;

    if (s == 0) ASSERT_FALSE(ref->unused.grad().defined());
    step_both_and_compare(model, ref, *strategy, opt, ref_opt, step);
    if (::testing::Test::HasFailure()) return;
  }
  EXPECT_TRUE(torch::equal(model->unused.detach(), unused_before));
}

// With find_unused_parameters and accumulation, a parameter only an earlier
// micro-step used (`extra`, in micro-step 0 of 2) already holds its gradient
// when the last micro-step finds it unused: that gradient is reduced like
// any other, not replaced by zeros; `unused` still gets zeros.
TEST(DDP, FindUnusedParametersKeepsAGradientFromAnEarlierMicroStep) {
  constexpr int64_t kSteps = 3, kMicro = 2, kMicroRows = 6;  // 6 divides by 1, 2, 3
  auto data = make_data(kSteps, kMicro * kMicroRows);
  TwoBranch model, ref;  // same seed: same weights
  perturb_unless_rank0(*model);
  auto strategy = strategy::make_strategy(tiny_buckets(true));
  strategy->setup(*model, g_world);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1));
  const int64_t per = kMicroRows / world_size();
  for (int64_t s = 0; s < kSteps; ++s) {
    const std::string step = "step " + std::to_string(s);
    const auto micro_x = [&](int64_t j) { return data.x[s].narrow(0, j * kMicroRows, kMicroRows); };
    const auto micro_y = [&](int64_t j) { return data.y[s].narrow(0, j * kMicroRows, kMicroRows); };
    ref_opt.zero_grad();
    torch::Tensor ref_loss = torch::zeros({});
    for (int64_t j = 0; j < kMicro; ++j) {
      for (int r = 0; r < world_size(); ++r) {
        ref_loss = ref_loss + torch::mse_loss(ref->forward(micro_x(j).narrow(0, r * per, per), j == 0),
                                              micro_y(j).narrow(0, r * per, per));
      }
    }
    (ref_loss / (world_size() * kMicro)).backward();

    opt.zero_grad();
    for (int64_t j = 0; j < kMicro; ++j) {
      strategy->set_gradient_sync(j == kMicro - 1);
      (torch::mse_loss(model->forward(my_rows(micro_x(j)), j == 0), my_rows(micro_y(j))) / kMicro).backward();
    }
    strategy->finish_gradient_sync();
    ASSERT_TRUE(model->extra->weight.grad().defined()) << step;
    EXPECT_GT(model->extra->weight.grad().abs().max().item<double>(), 0.0) << step;
    step_both_and_compare(model, ref, *strategy, opt, ref_opt, step);
    if (::testing::Test::HasFailure()) return;
  }
}

namespace {

struct WithBuffersImpl : torch::nn::Module {
  WithBuffersImpl() {
    fc = register_module("fc", torch::nn::Linear(4, 3));
    const int r = rank();
    steps = register_buffer("steps", torch::full({5}, 100 + r, torch::kLong));
    mask = register_buffer("mask", torch::arange(6).remainder(r + 2).eq(0));  // bool
    codes = register_buffer("codes", torch::full({4}, 10 + r, torch::kUInt8));
    frozen = register_parameter("frozen", torch::full({3}, 1.0f + r), /*requires_grad=*/false);
  }
  torch::nn::Linear fc{nullptr};
  torch::Tensor steps, mask, codes, frozen;
};
TORCH_MODULE(WithBuffers);

}  // namespace

// Integer buffers are broadcast as they are; bool and uint8 buffers (which
// the communicator cannot carry) travel through an int32 copy, so they end
// equal to rank 0's too. Frozen parameters are broadcast but not bucketed.
TEST(DDP, IntegerAndBoolBuffersAreBroadcastFromRank0) {
  WithBuffers m;
  auto strategy = strategy::make_strategy(StrategyOptions{});
  ASSERT_NO_THROW(strategy->setup(*m, g_world));
  EXPECT_TRUE(torch::equal(m->steps, torch::full({5}, 100, torch::kLong)));
  EXPECT_EQ(m->mask.scalar_type(), torch::kBool);
  EXPECT_TRUE(torch::equal(m->mask, torch::arange(6).remainder(2).eq(0)));
  EXPECT_TRUE(torch::equal(m->codes, torch::full({4}, 10, torch::kUInt8)));
  EXPECT_TRUE(torch::equal(m->frozen, torch::full({3}, 1.0f)));
  auto& ddp = as_ddp(*strategy);
  ASSERT_EQ(ddp.num_buckets(), 1u);
  EXPECT_EQ(ddp.bucket_parameter_names(0), (std::vector<std::string>{"fc.bias", "fc.weight"}));
}
