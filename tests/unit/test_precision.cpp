// Precision plugins in one process: the dynamic loss scaler's state machine,
// the fused unscale + found-inf pass on real float32/bfloat16/float16
// gradients, the plugin factory, the autocast scope and bf16-true's cast.
#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "precision/detail.h"
#include "shardtrain/comm/communicator.h"
#include "shardtrain/core/error.h"
#include "shardtrain/precision/precision.h"

using namespace shardtrain;
using namespace shardtrain::precision;

namespace {

std::shared_ptr<comm::Communicator> world_of_one() {
  return comm::Communicator::create(comm::CommOptions().rank(0).world_size(1));
}

LossScalerOptions small_window(int64_t window = 4, int hysteresis = 2) {
  LossScalerOptions o;
  o.loss_scale_window(window);
  o.hysteresis(hysteresis);
  return o;
}

void expect_same_state(const LossScalerState& a, const LossScalerState& b) {
  EXPECT_EQ(a.scale, b.scale);
  EXPECT_EQ(a.iteration, b.iteration);
  EXPECT_EQ(a.last_overflow_iteration, b.last_overflow_iteration);
  EXPECT_EQ(a.hysteresis_left, b.hysteresis_left);
  EXPECT_EQ(a.skips_at_min, b.skips_at_min);
  EXPECT_EQ(a.skipped_steps, b.skipped_steps);
}

const std::vector<at::ScalarType> kGradDtypes = {at::kFloat, at::kBFloat16, at::kHalf};

}  // namespace

// ---- DynamicLossScaler --------------------------------------------------------------

TEST(LossScaler, StartsWithDeepSpeedDefaults) {
  DynamicLossScaler s;
  EXPECT_EQ(s.scale(), 65536.0);
  EXPECT_EQ(s.state().iteration, 0);
  EXPECT_EQ(s.state().last_overflow_iteration, -1);
  EXPECT_EQ(s.state().hysteresis_left, 2);
  EXPECT_EQ(s.state().skipped_steps, 0);
  LossScalerOptions o;
  EXPECT_EQ(o.loss_scale_window(), 1000);
  EXPECT_EQ(o.min_loss_scale(), 1.0);
}

TEST(LossScaler, GrowsAfterExactlyWindowCleanSteps) {
  DynamicLossScaler s(small_window(4));
  for (int i = 0; i < 3; ++i) {
    s.update(false);
    EXPECT_EQ(s.scale(), 65536.0) << "clean step " << i + 1;
  }
  s.update(false);  // the 4th clean step
  EXPECT_EQ(s.scale(), 131072.0);
  for (int i = 0; i < 3; ++i) s.update(false);
  EXPECT_EQ(s.scale(), 131072.0);
  s.update(false);  // the 8th
  EXPECT_EQ(s.scale(), 262144.0);
  EXPECT_EQ(s.state().skipped_steps, 0);
}

TEST(LossScaler, WindowOfOneGrowsEveryCleanStep) {
  DynamicLossScaler s(small_window(1));
  s.update(false);
  EXPECT_EQ(s.scale(), 131072.0);
  s.update(false);
  EXPECT_EQ(s.scale(), 262144.0);
}

TEST(LossScaler, BacksOffOnlyAfterHysteresisOverflows) {
  DynamicLossScaler s(small_window(1000, 2));
  s.update(true);  // first overflow: absorbed by hysteresis
  EXPECT_EQ(s.scale(), 65536.0);
  EXPECT_EQ(s.state().hysteresis_left, 1);
  s.update(true);  // second in a row: halves
  EXPECT_EQ(s.scale(), 32768.0);
  s.update(true);  // hysteresis stays used up: halves again
  EXPECT_EQ(s.scale(), 16384.0);
  EXPECT_EQ(s.state().hysteresis_left, 1);
  EXPECT_EQ(s.state().skipped_steps, 3);
}

TEST(LossScaler, CleanStepRefillsHysteresis) {
  DynamicLossScaler s(small_window(1000, 3));
  s.update(true);
  s.update(true);
  EXPECT_EQ(s.state().hysteresis_left, 1);
  EXPECT_EQ(s.scale(), 65536.0);
  s.update(false);
  EXPECT_EQ(s.state().hysteresis_left, 3);
  s.update(true);  // absorbed again
  s.update(true);
  EXPECT_EQ(s.scale(), 65536.0);
  s.update(true);  // the third in a row backs off
  EXPECT_EQ(s.scale(), 32768.0);
}

TEST(LossScaler, HysteresisOfOneBacksOffOnEveryOverflow) {
  DynamicLossScaler s(small_window(1000, 1));
  s.update(true);
  EXPECT_EQ(s.scale(), 32768.0);
  s.update(false);
  s.update(true);
  EXPECT_EQ(s.scale(), 16384.0);
}

TEST(LossScaler, GrowthWindowRestartsAtTheLastOverflow) {
  DynamicLossScaler s(small_window(4, 2));
  s.update(false);
  s.update(false);
  s.update(true);  // absorbed, but the window restarts here
  EXPECT_EQ(s.state().last_overflow_iteration, 2);
  for (int i = 0; i < 3; ++i) s.update(false);
  EXPECT_EQ(s.scale(), 65536.0);
  s.update(false);  // 4th clean step after the overflow
  EXPECT_EQ(s.scale(), 131072.0);
}

TEST(LossScaler, NeverGoesBelowTheMinimum) {
  LossScalerOptions o = small_window(1000, 1);
  o.initial_scale_power(2);  // 4
  o.min_loss_scale(1.5);
  o.max_skips_at_min(0);  // never fail
  DynamicLossScaler s(o);
  ::testing::internal::CaptureStderr();
  s.update(true);
  EXPECT_EQ(s.scale(), 2.0);
  s.update(true);
  EXPECT_EQ(s.scale(), 1.5);
  for (int i = 0; i < 100; ++i) s.update(true);
  EXPECT_EQ(s.scale(), 1.5);
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(s.state().skips_at_min, 100);
  EXPECT_NE(err.find("100 consecutive"), std::string::npos) << err;
}

TEST(LossScaler, WarnsAtTheMinimumThenFails) {
  LossScalerOptions o = small_window(1000, 1);
  o.initial_scale_power(1);  // 2
  o.min_loss_scale(1.0);
  o.max_skips_at_min(3);
  DynamicLossScaler s(o);
  ::testing::internal::CaptureStderr();
  s.update(true);  // 2 -> 1: not yet a skip at the minimum
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
  EXPECT_EQ(s.scale(), 1.0);

  ::testing::internal::CaptureStderr();
  s.update(true);
  s.update(true);
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(s.state().skips_at_min, 2);
  EXPECT_NE(err.find("minimum loss scale 1"), std::string::npos) << err;
  EXPECT_NE(err.find("2 consecutive"), std::string::npos) << err;
  EXPECT_NE(err.find("bf16-mixed"), std::string::npos) << err;
  EXPECT_NE(err.find("learning rate"), std::string::npos) << err;

  try {
    s.update(true);
    FAIL() << "expected an Error after 3 skips at the minimum scale";
  } catch (const ConfigError&) {
    FAIL() << "must be a plain Error, not a ConfigError";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("3 consecutive"), std::string::npos) << what;
    EXPECT_NE(what.find("bf16-mixed"), std::string::npos) << what;
  }
}

TEST(LossScaler, CleanStepResetsTheSkipsAtMinimum) {
  LossScalerOptions o = small_window(1000, 1);
  o.initial_scale_power(0);  // already at the minimum
  o.max_skips_at_min(3);
  DynamicLossScaler s(o);
  ::testing::internal::CaptureStderr();
  s.update(true);
  s.update(true);
  s.update(false);
  EXPECT_EQ(s.state().skips_at_min, 0);
  s.update(true);
  s.update(true);
  ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(s.state().skips_at_min, 2);
  EXPECT_EQ(s.state().skipped_steps, 4);
}

TEST(LossScaler, StateRoundTrips) {
  DynamicLossScaler a(small_window(3, 2));
  const std::vector<bool> history = {false, true, true, false, false, true, false, false, false};
  for (bool f : history) a.update(f);
  DynamicLossScaler b(small_window(3, 2));
  b.load_state(a.state());
  expect_same_state(a.state(), b.state());
  for (bool f : {false, false, true, true, true, false, false, false, false}) {
    a.update(f);
    b.update(f);
    expect_same_state(a.state(), b.state());
  }
}

TEST(LossScaler, RejectsBadOptions) {
  auto with = [](auto edit) {
    LossScalerOptions o;
    edit(o);
    return o;
  };
  EXPECT_THROW(DynamicLossScaler(with([](auto& o) { o.loss_scale_window(0); })), ConfigError);
  EXPECT_THROW(DynamicLossScaler(with([](auto& o) { o.hysteresis(0); })), ConfigError);
  EXPECT_THROW(DynamicLossScaler(with([](auto& o) { o.min_loss_scale(0); })), ConfigError);
  EXPECT_THROW(DynamicLossScaler(with([](auto& o) { o.max_skips_at_min(-1); })), ConfigError);
  EXPECT_THROW(DynamicLossScaler(with([](auto& o) { o.initial_scale_power(2000); })), ConfigError);
  EXPECT_THROW(DynamicLossScaler(with([](auto& o) {
                 o.initial_scale_power(0);
                 o.min_loss_scale(2);
               })),
               ConfigError);
}

// ---- unscale_and_find_inf -------------------------------------------------------------

namespace {

// Gradients of several sizes (empty, one element, odd, larger than one
// parallel chunk), finite, with magnitudes around 1e3.
std::vector<at::Tensor> make_grads(at::ScalarType dtype) {
  torch::manual_seed(7);
  std::vector<at::Tensor> grads;
  for (int64_t n : {0, 1, 7, 1000, 100003}) grads.push_back((torch::randn({n}) * 1000).to(dtype));
  grads.push_back(at::Tensor());  // a parameter without a gradient
  grads.push_back((torch::randn({3, 5}) * 1000).to(dtype));
  return grads;
}

std::vector<at::Tensor> clone_all(const std::vector<at::Tensor>& v) {
  std::vector<at::Tensor> out;
  for (const auto& t : v) out.push_back(t.defined() ? t.clone() : t);
  return out;
}

}  // namespace

// Scaling happens in float32 with a float32 inv_scale and one rounding to
// the gradient's dtype (as CUDA's fused AMP kernel does). ATen's CPU
// mul_(Scalar) on half/bfloat16 rounds the scalar to the tensor's dtype
// first, so it agrees exactly only for powers of two; those are the scales
// the loss scaler produces.
TEST(UnscaleAndFindInf, FiniteGradientsAreScaledInFloat32) {
  for (auto dtype : kGradDtypes) {
    for (double inv_scale : {1.0 / 1024, 1.0 / 3, 1.0, 1.0 / 65536}) {
      auto grads = make_grads(dtype);
      auto orig = clone_all(grads);
      EXPECT_FALSE(unscale_and_find_inf(grads, inv_scale)) << dtype;
      for (size_t i = 0; i < grads.size(); ++i) {
        if (!grads[i].defined()) continue;
        EXPECT_EQ(grads[i].scalar_type(), dtype);
        auto ref = (orig[i].to(at::kFloat) * inv_scale).to(dtype);
        EXPECT_TRUE(torch::equal(grads[i], ref)) << dtype << " tensor " << i << " inv " << inv_scale;
        if (inv_scale != 1.0 / 3) {
          // Power of two: exactly ATen's own CPU mul_, which works for float16 too.
          EXPECT_TRUE(torch::equal(grads[i], orig[i].clone().mul_(inv_scale))) << dtype << " tensor " << i;
        }
      }
    }
  }
}

TEST(UnscaleAndFindInf, FindsInfAndNanInEveryDtype) {
  const double kInf = std::numeric_limits<double>::infinity();
  for (auto dtype : kGradDtypes) {
    for (double bad : {kInf, -kInf, std::nan("")}) {
      for (size_t which : {1u, 4u, 6u}) {
        for (int64_t where : {0, -1, 2}) {
          auto grads = make_grads(dtype);
          const int64_t idx = where < 0 ? grads[which].numel() - 1 : std::min<int64_t>(where, grads[which].numel() - 1);
          grads[which].view(-1)[idx] = bad;
          auto ref = clone_all(grads);
          EXPECT_TRUE(unscale_and_find_inf(grads, 0.5))
              << dtype << " value " << bad << " tensor " << which << " index " << idx;
          // Every other element is still scaled.
          for (size_t i = 0; i < grads.size(); ++i) {
            if (grads[i].defined()) {
              EXPECT_TRUE(torch::equal(grads[i], ref[i].mul_(0.5)) || i == which);
            }
          }
          auto flat = grads[which].view(-1);
          EXPECT_FALSE(std::isfinite(flat[idx].item<double>()));
        }
      }
    }
  }
}

TEST(UnscaleAndFindInf, LargeFiniteValuesAreNotOverflow) {
  // A sum-based check would overflow float16 here (1000 x 60000 > 65504).
  auto g = torch::full({1000}, 60000.0, at::kHalf);
  EXPECT_FALSE(unscale_and_find_inf({g}, 1.0));
  auto b = torch::full({1000}, 3e38, at::kBFloat16);
  EXPECT_FALSE(unscale_and_find_inf({b}, 1.0));
  auto f = torch::full({1000}, 3e38, at::kFloat);
  EXPECT_FALSE(unscale_and_find_inf({f}, 1.0));
}

TEST(UnscaleAndFindInf, StridedViewsTakeTheSlowPathWithTheSameResult) {
  for (auto dtype : kGradDtypes) {
    auto base = (torch::randn({64, 33}) * 100).to(dtype);
    auto view = base.t();  // not contiguous
    ASSERT_FALSE(view.is_contiguous());
    auto ref = view.clone();
    EXPECT_FALSE(unscale_and_find_inf({view}, 0.25));
    EXPECT_TRUE(torch::equal(view, ref.mul_(0.25))) << dtype;
    view[5][7] = std::nan("");
    EXPECT_TRUE(unscale_and_find_inf({view}, 0.25)) << dtype;
  }
}

TEST(UnscaleAndFindInf, RejectsIntegerGradients) {
  EXPECT_THROW(unscale_and_find_inf({torch::ones({3}, at::kLong)}, 0.5), InvalidArgument);
}

TEST(UnscaleAndFindInf, EmptyListFindsNothing) { EXPECT_FALSE(unscale_and_find_inf({}, 0.5)); }

// ---- Precision::create ----------------------------------------------------------------

TEST(PrecisionCreate, UnscaledPluginsPassTheLossThroughAndNeverCommunicate) {
  auto comm = world_of_one();
  for (std::string name : {"fp32", "bf16-mixed", "bf16-true"}) {
    auto p = Precision::create(name);
    ASSERT_TRUE(p);
    EXPECT_EQ(p->name(), name);
    EXPECT_EQ(p->loss_scale(), 1.0);
    EXPECT_EQ(p->scaler(), nullptr);
    auto loss = torch::tensor(3.5);
    EXPECT_TRUE(p->scale_loss(loss).is_same(loss));
    auto g = torch::tensor({1.0f, std::numeric_limits<float>::infinity()});
    const auto seq = comm->sequence_number();
    EXPECT_FALSE(p->unscale_and_check({g}, *comm)) << name;
    EXPECT_EQ(comm->sequence_number(), seq) << name << " must not communicate";
    EXPECT_EQ(g[0].item<float>(), 1.0f);  // untouched
    p->update(false);
    EXPECT_EQ(p->skipped_steps(), 0);
    EXPECT_EQ(p->loss_scale(), 1.0);
  }
}

TEST(PrecisionCreate, Fp16MixedOnCpuIsAConfigErrorSuggestingBf16) {
  try {
    Precision::create("fp16-mixed");
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("bf16-mixed"), std::string::npos) << what;
    EXPECT_NE(what.find("CPU"), std::string::npos) << what;
    EXPECT_NE(what.find("float16"), std::string::npos) << what;
  }
}

TEST(PrecisionCreate, Fp16MixedWithCudaHasAScaler) {
  LossScalerOptions o;
  o.initial_scale_power(10);
  auto p = Precision::create("fp16-mixed", o, /*cuda_available=*/true);
  EXPECT_EQ(p->name(), "fp16-mixed");
  ASSERT_NE(p->scaler(), nullptr);
  EXPECT_EQ(p->loss_scale(), 1024.0);
}

TEST(PrecisionCreate, UnknownNameListsTheFour) {
  for (std::string bad : {"fp16", "bf16", "", "FP32"}) {
    try {
      Precision::create(bad);
      FAIL() << "expected ConfigError for '" << bad << "'";
    } catch (const ConfigError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("'" + bad + "'"), std::string::npos) << what;
      for (const char* n : {"fp32", "bf16-mixed", "fp16-mixed", "bf16-true"}) {
        EXPECT_NE(what.find(n), std::string::npos) << what;
      }
    }
  }
}

// ---- fp16-mixed through the test construction -------------------------------------------

TEST(Fp16Mixed, ScalesUnscalesChecksAndUpdates) {
  auto comm = world_of_one();
  LossScalerOptions o = small_window(2, 1);
  o.initial_scale_power(8);  // 256
  auto p = precision::detail::make_fp16_mixed_for_tests(o);
  EXPECT_EQ(p->name(), "fp16-mixed");
  ASSERT_NE(p->scaler(), nullptr);

  // Scaling the loss scales the float16 gradients; unscaling recovers them.
  torch::manual_seed(3);
  auto w = torch::randn({16}).to(at::kHalf).requires_grad_();
  auto x = torch::randn({16}).to(at::kHalf);
  auto loss = (w * x).sum();
  auto scaled = p->scale_loss(loss);
  EXPECT_EQ(scaled.item<float>(), (loss * 256).item<float>());
  scaled.backward();
  ASSERT_EQ(w.grad().scalar_type(), at::kHalf);
  const auto seq = comm->sequence_number();
  EXPECT_FALSE(p->unscale_and_check({w.grad()}, *comm));
  EXPECT_EQ(comm->sequence_number(), seq + 1) << "exactly one all-reduce";
  EXPECT_TRUE(torch::equal(w.grad(), x)) << "d(sum w*x)/dw = x after unscaling";
  p->update(false);
  EXPECT_EQ(p->loss_scale(), 256.0);
  p->update(false);  // second clean step with window 2
  EXPECT_EQ(p->loss_scale(), 512.0);

  auto g = torch::ones({5}, at::kHalf);
  g[2] = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(p->unscale_and_check({g}, *comm));
  p->update(true);
  EXPECT_EQ(p->loss_scale(), 256.0);
  EXPECT_EQ(p->skipped_steps(), 1);
  EXPECT_EQ(p->scaler()->state().skipped_steps, 1);
}

TEST(Fp16Mixed, TestConstructionHasNoAutocast) {
  auto p = precision::detail::make_fp16_mixed_for_tests();
  auto a = torch::randn({4, 4});
  {
    auto scope = p->autocast();
    EXPECT_FALSE(at::autocast::is_cpu_enabled());
    EXPECT_EQ(torch::matmul(a, a).scalar_type(), at::kFloat);
  }
}

// ---- AutocastScope ----------------------------------------------------------------------

TEST(Autocast, Bf16MixedRunsMatmulInBfloat16InsideOnly) {
  auto p = Precision::create("bf16-mixed");
  auto a = torch::randn({8, 8});
  auto b = torch::randn({8, 8});
  EXPECT_FALSE(at::autocast::is_cpu_enabled());
  {
    auto scope = p->autocast();
    EXPECT_TRUE(at::autocast::is_cpu_enabled());
    EXPECT_EQ(torch::matmul(a, b).scalar_type(), at::kBFloat16);
    torch::nn::Linear lin(8, 3);
    EXPECT_EQ(lin->forward(a).scalar_type(), at::kBFloat16);
    EXPECT_EQ(lin->weight.scalar_type(), at::kFloat) << "master weights stay float32";
    EXPECT_EQ(torch::softmax(a, 1).scalar_type(), at::kFloat) << "ops autocast does not list";
  }
  EXPECT_FALSE(at::autocast::is_cpu_enabled());
  EXPECT_EQ(torch::matmul(a, b).scalar_type(), at::kFloat);
}

TEST(Autocast, Fp32ScopeDoesNothing) {
  auto p = Precision::create("fp32");
  auto a = torch::randn({4, 4});
  auto scope = p->autocast();
  EXPECT_FALSE(at::autocast::is_cpu_enabled());
  EXPECT_EQ(torch::matmul(a, a).scalar_type(), at::kFloat);
}

TEST(Autocast, NestingRestoresThePriorState) {
  auto a = torch::randn({4, 4});
  {
    AutocastScope outer(true, false, true);
    {
      AutocastScope inner(true, false, true);
      EXPECT_EQ(torch::matmul(a, a).scalar_type(), at::kBFloat16);
      {
        AutocastScope off(false, false, true);  // disabled: leaves the state alone
        EXPECT_TRUE(at::autocast::is_cpu_enabled());
      }
    }
    EXPECT_TRUE(at::autocast::is_cpu_enabled()) << "the inner scope restored the outer's state";
    EXPECT_EQ(torch::matmul(a, a).scalar_type(), at::kBFloat16);
  }
  EXPECT_FALSE(at::autocast::is_cpu_enabled());
  EXPECT_EQ(torch::matmul(a, a).scalar_type(), at::kFloat);

  // A state set by hand before the scope comes back too. (LibTorch 1.13
  // refuses any CPU autocast dtype but bfloat16, so only `enabled` varies.)
  at::autocast::set_cpu_enabled(true);
  { AutocastScope s(true, false, true); EXPECT_TRUE(at::autocast::is_cpu_enabled()); }
  EXPECT_TRUE(at::autocast::is_cpu_enabled());
  EXPECT_EQ(at::autocast::get_autocast_cpu_dtype(), at::kBFloat16);
  at::autocast::set_cpu_enabled(false);
}

// The CUDA path (fp16-mixed's real scope) only sets thread-local state, so
// its set-and-restore runs here too; CPU ops are untouched by it.
TEST(Autocast, CudaScopeSetsAndRestoresCudaState) {
  ASSERT_FALSE(at::autocast::is_enabled());
  const auto before = at::autocast::get_autocast_gpu_dtype();
  auto a = torch::randn({4, 4});
  {
    AutocastScope fp16(true, /*cuda=*/true, /*bf16=*/false);
    EXPECT_TRUE(at::autocast::is_enabled());
    EXPECT_EQ(at::autocast::get_autocast_gpu_dtype(), at::kHalf);
    EXPECT_FALSE(at::autocast::is_cpu_enabled());
    EXPECT_EQ(torch::matmul(a, a).scalar_type(), at::kFloat);
    {
      AutocastScope bf16(true, /*cuda=*/true, /*bf16=*/true);
      EXPECT_EQ(at::autocast::get_autocast_gpu_dtype(), at::kBFloat16);
    }
    EXPECT_EQ(at::autocast::get_autocast_gpu_dtype(), at::kHalf);
  }
  EXPECT_FALSE(at::autocast::is_enabled());
  EXPECT_EQ(at::autocast::get_autocast_gpu_dtype(), before);
}

TEST(Autocast, CpuFloat16IsRejected) {
  EXPECT_THROW(AutocastScope(true, /*cuda=*/false, /*bf16=*/false), InvalidArgument);
  EXPECT_FALSE(at::autocast::is_cpu_enabled());
}

// ---- bf16-true ------------------------------------------------------------------------------

TEST(Bf16True, PrepareModelCastsEveryFloatingTensor) {
  torch::nn::Sequential model(torch::nn::Linear(6, 4), torch::nn::BatchNorm1d(4), torch::nn::ReLU(),
                              torch::nn::Linear(4, 2));
  auto p = Precision::create("bf16-true");
  p->prepare_model(*model);
  for (const auto& kv : model->named_parameters()) {
    EXPECT_EQ(kv.value().scalar_type(), at::kBFloat16) << kv.key();
    EXPECT_TRUE(kv.value().requires_grad()) << kv.key();
  }
  for (const auto& kv : model->named_buffers()) {
    if (kv.key().find("num_batches_tracked") != std::string::npos) {
      EXPECT_EQ(kv.value().scalar_type(), at::kLong) << "integer buffers keep their dtype";
    } else {
      EXPECT_EQ(kv.value().scalar_type(), at::kBFloat16) << kv.key();
    }
  }
  // Forward and backward run in bfloat16, gradients included.
  auto out = model->forward(torch::randn({5, 6}).to(at::kBFloat16));
  EXPECT_EQ(out.scalar_type(), at::kBFloat16);
  out.sum().backward();
  for (const auto& param : model->parameters()) EXPECT_EQ(param.grad().scalar_type(), at::kBFloat16);

  // The other plugins leave the model alone.
  torch::nn::Linear lin(3, 3);
  Precision::create("bf16-mixed")->prepare_model(*lin);
  EXPECT_EQ(lin->weight.scalar_type(), at::kFloat);
}

// ---- precision: auto ----------------------------------------------------------------

TEST(PrecisionAuto, Bf16MixedOnlyWhereBf16IsNative) {
  const ResolvedPrecision cpu = resolve_precision(PrecisionKind::Auto, /*cuda_available=*/false);
  EXPECT_EQ(cpu.kind, cpu_has_native_bf16() ? PrecisionKind::Bf16Mixed : PrecisionKind::Fp32);
  EXPECT_EQ(cpu.reason.rfind("auto: ", 0), 0u) << cpu.reason;
  EXPECT_NE(cpu.reason.find("bf16"), std::string::npos) << cpu.reason;
  const ResolvedPrecision gpu = resolve_precision(PrecisionKind::Auto, /*cuda_available=*/true);
  EXPECT_EQ(gpu.kind, PrecisionKind::Bf16Mixed);
  EXPECT_FALSE(gpu.reason.empty());
  // The plugin built from `auto` is the resolved one.
  EXPECT_EQ(Precision::create("auto")->name(), enum_name(cpu.kind));
}

// Native bf16 does not make bf16 GEMMs fast: on this project's Xeon,
// OpenBLAS's bf16 kernels run at 84 GFLOP/s against 159 for fp32, and
// bf16-mixed trained at 0.6-0.7x fp32's speed. Measured rates decide.
TEST(PrecisionAuto, MeasuredGemmRatesDecideOnACpuWithNativeBf16) {
  const GemmRates slow_bf16{159.0, 84.0}, fast_bf16{190.0, 397.0};
  const ResolvedPrecision slow = precision::detail::auto_on_cpu(true, &slow_bf16);
  EXPECT_EQ(slow.kind, PrecisionKind::Fp32);
  EXPECT_NE(slow.reason.find("84 against 159 GFLOP/s"), std::string::npos) << slow.reason;
  const ResolvedPrecision fast = precision::detail::auto_on_cpu(true, &fast_bf16);
  EXPECT_EQ(fast.kind, PrecisionKind::Bf16Mixed);
  EXPECT_NE(fast.reason.find("397 against 190 GFLOP/s"), std::string::npos) << fast.reason;
  EXPECT_EQ(precision::detail::auto_on_cpu(true, nullptr).kind, PrecisionKind::Bf16Mixed);  // flags alone
  EXPECT_EQ(precision::detail::auto_on_cpu(false, &fast_bf16).kind, PrecisionKind::Fp32);   // emulated bf16
  // A CUDA device decides alone, and other kinds stay as given.
  EXPECT_EQ(resolve_precision(PrecisionKind::Auto, true, &slow_bf16).kind, PrecisionKind::Bf16Mixed);
  EXPECT_EQ(resolve_precision(PrecisionKind::Bf16Mixed, false, &slow_bf16).kind, PrecisionKind::Bf16Mixed);
}

TEST(PrecisionAuto, TheProbeMeasuresBothGemms) {
  const GemmRates rates = measure_gemm_rates();
  EXPECT_GT(rates.fp32_gflops, 0.5);
  EXPECT_GT(rates.bf16_gflops, 0.0);
}

TEST(PrecisionAuto, OtherKindsStayAsGiven) {
  for (PrecisionKind kind : {PrecisionKind::Fp32, PrecisionKind::Bf16Mixed, PrecisionKind::Fp16Mixed,
                             PrecisionKind::Bf16True}) {
    const ResolvedPrecision r = resolve_precision(kind, /*cuda_available=*/false);
    EXPECT_EQ(r.kind, kind);
    EXPECT_TRUE(r.reason.empty());
  }
}
