// ZeRO-1 and FSDP (every sharding mode) against the single-process
// reference, run by every rank under `shardtrain launch` at world sizes 1-4.
//
// The model has three Linear units called through unit_forward plus root
// parameters of 2 and 0 elements: 3415 parameters, not divisible by 2, 3 or
// 4, and its last unit (245) neither. Every rank builds it from one seed;
// ranks != 0 perturb their copy, so matching the reference also proves the
// broadcast. Of a global batch of G rows rank k takes rows [k*G/W, (k+1)*G/W);
// each rank trains the reference itself and compares after every step: the
// loss, the clipped global norm, and every parameter (full_state_dict).
//
// Tolerances. fp32: as DDP's tests (1e-5 + 1e-4 |ref|); only the order of
// float32 sums differs. bf16-mixed: the ranks' bf16 GEMMs round partial
// gradients over their own rows, which one GEMM over the whole batch would
// not, so the bf16 reference runs the ranks' micro-batches one by one and
// averages their fp32 gradients: every bf16 rounding is then the same, and
// what is left is the order of fp32 sums (measured 6e-8 relative), hence
// 1e-7 + 2e-6 |ref|. Reducing in bf16 instead of fp32 moves the gradient
// norm by about 1e-4 relative and fails. With a bf16 gathered copy
// (param_dtype bf16) the root's gain multiplies the output in bf16 where the
// reference multiplies in fp32: one more rounding (2^-8 relative) of the
// output and so of each step's gradient. Clipped to norm 0.05, SGD with
// momentum 0.9 moves a parameter by at most lr / (1 - 0.9) * 0.05 = 0.025
// per step, so six steps differ by at most 6 * 0.025 * 2^-8 = 6e-5
// (measured 1.6e-5); the norm and the loss by 2^-8 relative. Reducing in
// bf16 (reduce_dtype bf16) rounds each step's averaged gradient once more:
// the same bound again.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <torch/torch.h>

#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <fstream>
#include <numeric>

#include "shardtrain/comm/communicator.h"
#include "shardtrain/core/error.h"
#include "shardtrain/models/gpt.h"
#include "shardtrain/precision/precision.h"
#include "shardtrain/strategy/strategy.h"
#include "shardtrain/strategy/unit.h"
#include "strategy/flat_memory.h"
#include "strategy/fsdp.h"
#include "world.h"

using namespace shardtrain;
using namespace shardtrain::comm;
using shardtrain::strategy::StrategyOptions;
using shardtrain::strategy::unit_forward;
using shardtrain::strategy::detail::ShardedStrategy;

namespace {

std::shared_ptr<Communicator>& g_world = ::shardtrain::testing::world_ptr();
int rank() { return g_world->rank(); }
int world_size() { return g_world->size(); }

constexpr int64_t kIn = 16, kHidden = 48, kOut = 5;

struct NetImpl : torch::nn::Module {
  NetImpl() {
    l1 = register_module("l1", torch::nn::Linear(kIn, kHidden));
    l2 = register_module("l2", torch::nn::Linear(kHidden, kHidden));
    l3 = register_module("l3", torch::nn::Linear(kHidden, kOut));
    gain = register_parameter("gain", torch::ones({2}));
    empty = register_parameter("empty", torch::zeros({0}));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = unit_forward(l1, [&] { return torch::gelu(l1(x)); });
    h = unit_forward(l2, [&] { return torch::gelu(l2(h)); });
    auto y = unit_forward(l3, [&] { return l3(h); });
    return y * gain.sum() / 2 + empty.sum();
  }
  torch::nn::Linear l1{nullptr}, l2{nullptr}, l3{nullptr};
  torch::Tensor gain, empty;
};
TORCH_MODULE(Net);

Net make_net(bool freeze_l2) {
  torch::manual_seed(42);
  Net net;
  if (freeze_l2) {
    for (auto& p : net->l2->parameters()) p.requires_grad_(false);
  }
  return net;
}

void perturb_unless_rank0(torch::nn::Module& m) {
  if (rank() == 0) return;
  torch::NoGradGuard no_grad;
  for (auto& p : m.parameters()) p.add_(0.25 * rank());
}

struct Case {
  std::string name = "fsdp";
  std::string sharding = "full_shard";
  bool bf16 = false;
  std::string param_dtype;
  std::string accumulation = "sharded";
  int accumulate = 1;
  bool freeze = false;
  std::string prefetch = "backward_pre";
  bool forward_prefetch = false;
  int limit_all_gathers = 2;
  std::string reduce_dtype = "fp32";
  int local_world_size = 0;
  std::string label() const {
    return name + "/" + sharding + (bf16 ? " bf16-mixed" : " fp32") +
           (param_dtype.empty() ? "" : " param_dtype=" + param_dtype) + " acc=" +
           std::to_string(accumulate) + "(" + accumulation + ")" + (freeze ? " frozen-l2" : "") +
           " prefetch=" + prefetch + (forward_prefetch ? "+fwd" : "") +
           " limit_all_gathers=" + std::to_string(limit_all_gathers) + " reduce=" + reduce_dtype +
           (local_world_size > 0 ? " ranks_per_node=" + std::to_string(local_world_size) : "");
  }
};

StrategyOptions options_for(const Case& c) {
  using namespace strategy;
  return StrategyOptions()
      .strategy(enum_from_name<StrategyKind>(c.name, "strategy"))
      .sharding(enum_from_name<Sharding>(c.sharding, "sharding"))
      .param_dtype(c.param_dtype.empty() ? DType::Auto : enum_from_name<DType>(c.param_dtype, "param_dtype"))
      .accumulation(enum_from_name<Accumulation>(c.accumulation, "accumulation"))
      .backward_prefetch(enum_from_name<BackwardPrefetch>(c.prefetch, "backward_prefetch"))
      .forward_prefetch(c.forward_prefetch)
      .limit_all_gathers(c.limit_all_gathers)
      .reduce_dtype(enum_from_name<DType>(c.reduce_dtype, "reduce_dtype"))
      .auto_wrap_policy(AutoWrapPolicy::ModuleType)
      .wrap_module_types({"LinearImpl"})
      .local_world_size(c.local_world_size);
}

// AdamW (weight decay on matrices) in fp32. Under bf16 SGD with momentum:
// AdamW's first steps move every element by about lr times the sign of its
// gradient, so a near-zero bf16 gradient whose sign differs between the
// reference and the sharded run moves by 2 lr either way.
std::unique_ptr<torch::optim::Optimizer> make_optimizer(
    const std::vector<strategy::ShardedTensor>& params, bool bf16) {
  std::vector<torch::Tensor> decay, no_decay;
  for (const auto& p : params) (p.global_shape.size() >= 2 ? decay : no_decay).push_back(p.local);
  if (bf16) {
    decay.insert(decay.end(), no_decay.begin(), no_decay.end());
    return std::make_unique<torch::optim::SGD>(decay, torch::optim::SGDOptions(0.05).momentum(0.9));
  }
  std::vector<torch::optim::OptimizerParamGroup> groups;
  if (!decay.empty()) {
    groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(
                                   torch::optim::AdamWOptions(3e-3).weight_decay(0.1)));
  }
  if (!no_decay.empty()) {
    groups.emplace_back(no_decay, std::make_unique<torch::optim::AdamWOptions>(
                                      torch::optim::AdamWOptions(3e-3).weight_decay(0.0)));
  }
  return std::make_unique<torch::optim::AdamW>(groups, torch::optim::AdamWOptions(3e-3));
}

std::vector<strategy::ShardedTensor> whole(torch::nn::Module& m) {
  std::vector<strategy::ShardedTensor> out;
  for (const auto& p : m.named_parameters()) {
    if (!p.value().requires_grad()) continue;
    strategy::ShardedTensor s;
    s.name = p.key();
    s.global_shape = p.value().sizes().vec();
    s.local = p.value();
    out.push_back(s);
  }
  return out;
}

double global_sum(double local) {
  auto t = torch::tensor({local}, torch::kDouble);
  g_world->all_reduce(t);
  return t.item<double>();
}

// What one optimizer step sends, by the design of each mode. Every
// trainable flat (one per unit: root 2, l1 816, l2 2352, l3 245 elements,
// each padded to a multiple of the shard count) is reduced in reduce_dtype once per
// step, or once per micro-step where gradients are reduce-scattered and
// accumulated sharded (full_shard, shard_grad_op with accumulation:
// sharded); frozen flats never. Gathers fill whole flats in the compute
// dtype, frozen ones too: full_shard gathers the Linear units in forward and
// again in backward of every micro-step (but l3, the last in forward order,
// stays gathered for its backward once the order is known, after step 0),
// shard_grad_op once per micro-step,
// zero1 every flat after the optimizer step (at world size 2 and more),
// no_shard nothing; the root unit stays gathered
// until the optimizer step changes it. Setup leaves every unit gathered, so
// step 0 gathers less.
struct StepComm {
  int64_t reductions = 0;
  int64_t reduced_bytes = 0;
  int64_t gathered_bytes = 0;
};

// Ranks per node of a hybrid_shard case: the case's own, else the
// launcher's LOCAL_WORLD_SIZE.
int ranks_per_node(const Case& c) {
  if (c.local_world_size > 0) return c.local_world_size;
  const char* local = std::getenv("LOCAL_WORLD_SIZE");
  return local != nullptr ? std::atoi(local) : 1;
}

StepComm expected_comm(const Case& c, int n, int64_t step) {
  const bool no_shard = c.name == "fsdp" && c.sharding == "no_shard";
  const bool hybrid = c.sharding == "hybrid_shard";  // shards within a node, replicas across
  const int shards = no_shard ? 1 : hybrid ? ranks_per_node(c) : n;
  const auto padded = [shards](int64_t numel) { return (numel + shards - 1) / shards * shards; };
  const bool sharded_grads = c.name == "fsdp" && !no_shard;
  const int64_t times = sharded_grads && c.accumulation == "sharded" ? c.accumulate : 1;
  const int64_t reduce_bytes = c.reduce_dtype == "bf16" ? 2 : 4;
  StepComm e;
  for (const auto& [numel, frozen] : {std::pair<int64_t, bool>{2, false}, {816, false}, {2352, c.freeze},
                                      {245, false}}) {
    if (frozen) continue;
    e.reductions += times;
    e.reduced_bytes += times * padded(numel) * reduce_bytes;
    // hybrid_shard then averages each node's shard across the nodes.
    if (hybrid) e.reduced_bytes += times * padded(numel) / shards * reduce_bytes;
  }
  // The root's shard is its whole flat on one rank: nothing to gather.
  const int64_t root = shards > 1 ? padded(2) : 0;
  const int64_t units = padded(816) + padded(2352) + padded(245);
  const int64_t acc = c.accumulate;
  int64_t gathered = 0;  // elements
  if (c.name == "zero1") {  // alone, its shard is the whole model
    gathered = step == 0 || n == 1 ? 0 : root + units;
  } else if (c.sharding == "full_shard" || hybrid) {
    gathered = step == 0 ? (2 * acc - 1) * units : root + 2 * acc * units - acc * padded(245);
  } else if (c.sharding == "shard_grad_op") {
    gathered = step == 0 ? (acc - 1) * units : root + acc * units;
  }
  e.gathered_bytes = gathered * (c.param_dtype == "bf16" ? 2 : 4);
  return e;
}

void run_parity(const Case& c) {
  SCOPED_TRACE(c.label());
  constexpr int64_t kSteps = 6;
  const int64_t rows = 12 * c.accumulate;  // divisible by 1..4 and the accumulation
  torch::manual_seed(1234);
  const auto xs = torch::randn({kSteps, rows, kIn});
  const auto ys = torch::randn({kSteps, rows, kOut});
  // Tolerances (the file's header says why): fp32, and bf16 against the
  // reference that rounds alike, differ only in the order of fp32 sums; a
  // bf16 gathered copy and a bf16 reduction each add one bf16 rounding of
  // every step's gradient.
  const int extra_roundings = (c.bf16 && c.param_dtype == "bf16" ? 1 : 0) + (c.reduce_dtype == "bf16" ? 1 : 0);
  const double atol = extra_roundings > 0 ? 6e-5 * extra_roundings : c.bf16 ? 1e-7 : 1e-5;
  const double rtol = extra_roundings > 0 ? 0.0 : c.bf16 ? 2e-6 : 1e-4;
  const double norm_rtol = extra_roundings > 0 ? extra_roundings / 256.0 : rtol;
  const double loss_rtol = extra_roundings > 0 ? extra_roundings / 256.0 : c.bf16 ? 2e-6 : 1e-4;
  // Gradient norms here are 0.25-0.55: clipping scales every step's
  // gradient by a fifth to a tenth, so a clip computed but not applied
  // cannot pass.
  constexpr double kMaxNorm = 0.05;

  auto model = make_net(c.freeze);
  auto ref = make_net(c.freeze);
  perturb_unless_rank0(*model);
  auto strategy = strategy::make_strategy(options_for(c));
  strategy->setup(*model, g_world);
  auto opt = make_optimizer(strategy->optimizer_parameters(), c.bf16);
  auto ref_opt = make_optimizer(whole(*ref), c.bf16);

  const int n = world_size();
  const int64_t per_rank = rows / n;
  const int64_t micro = per_rank / c.accumulate;
  for (int64_t s = 0; s < kSteps; ++s) {
    const std::string step = "step " + std::to_string(s);
    // Reference, fp32: the whole global batch at once. bf16: the ranks'
    // micro-batches one after another, their fp32 gradients summed and
    // averaged, so that it rounds every bf16 GEMM exactly as the ranks do.
    ref_opt->zero_grad();
    torch::Tensor ref_loss;
    if (!c.bf16) {
      ref_loss = torch::mse_loss(ref->forward(xs[s]), ys[s]);
      ref_loss.backward();
    } else {
      ref_loss = torch::zeros({});
      for (int64_t r = 0; r < n; ++r) {
        for (int j = 0; j < c.accumulate; ++j) {
          const int64_t first = r * per_rank + j * micro;
          torch::Tensor loss;
          {
            precision::AutocastScope autocast(true, false, true);
            loss = torch::mse_loss(ref->forward(xs[s].narrow(0, first, micro)), ys[s].narrow(0, first, micro))
                       .to(torch::kFloat);
          }
          (loss / c.accumulate).backward();
          ref_loss = ref_loss + loss.detach() / c.accumulate;
        }
      }
      ref_loss = ref_loss / n;
      torch::NoGradGuard no_grad;
      for (auto& p : ref->parameters()) {
        if (p.grad().defined()) p.grad().div_(n);
      }
    }
    const double ref_norm = torch::nn::utils::clip_grad_norm_(ref->parameters(), kMaxNorm);
    EXPECT_GT(ref_norm, 4 * kMaxNorm) << step << ": the clip must fire hard";
    ref_opt->step();

    // Sharded: this rank's rows in `accumulate` micro-batches; the mean over
    // all rows is the average over ranks of (sum of micro means / accumulate).
    const int64_t collectives_before = strategy->gradient_collectives();
    double loss_sum = 0.0;
    for (int j = 0; j < c.accumulate; ++j) {
      strategy->set_gradient_sync(j == c.accumulate - 1);
      const int64_t first = rank() * per_rank + j * micro;
      torch::Tensor loss;
      {
        precision::AutocastScope autocast(c.bf16, false, true);
        loss = torch::mse_loss(model->forward(xs[s].narrow(0, first, micro)),
                               ys[s].narrow(0, first, micro))
                   .to(torch::kFloat);
      }
      (loss / c.accumulate).backward();
      loss_sum += loss.item<double>() / c.accumulate;
    }
    strategy->finish_gradient_sync();
    const StepComm want = expected_comm(c, n, s);
    const auto stats = strategy->comm_stats();
    EXPECT_EQ(strategy->gradient_collectives() - collectives_before, want.reductions) << step;
    EXPECT_EQ(stats.reduced_bytes, want.reduced_bytes) << step;
    EXPECT_EQ(stats.gathered_bytes, want.gathered_bytes) << step;
    const double norm = strategy->clip_grad_norm(kMaxNorm);
    strategy->optimizer_step(*opt);
    opt->zero_grad();

    EXPECT_NEAR(global_sum(loss_sum) / n, ref_loss.item<double>(),
                1e-5 + loss_rtol * std::abs(ref_loss.item<double>()))
        << step;
    EXPECT_NEAR(norm, ref_norm, atol + norm_rtol * ref_norm) << step;
    const auto state = strategy->full_state_dict();
    if (rank() == 0) {
      const auto want = ref->named_parameters();
      ASSERT_EQ(state.size(), want.size());
      for (const auto& [name, value] : state) {
        const auto& w = want[name];
        ASSERT_EQ(value.sizes(), w.sizes()) << name;
        EXPECT_TRUE(torch::allclose(value, w, rtol, atol))
            << step << " " << name << " max |diff| " << (value - w).abs().max().item<double>();
      }
    }
    // Every rank stops at the same step, or the others would wait for it.
    if (global_sum(::testing::Test::HasFailure() ? 1.0 : 0.0) > 0) return;
  }
}

std::vector<Case> modes() {
  std::vector<Case> out;
  Case c;
  c.name = "zero1";
  out.push_back(c);
  c.name = "fsdp";
  for (const char* s : {"full_shard", "shard_grad_op", "no_shard"}) {
    c.sharding = s;
    out.push_back(c);
  }
  return out;
}

}  // namespace

TEST(Sharded, EveryModeMatchesSingleProcessFp32) {
  for (const auto& c : modes()) run_parity(c);
}

TEST(Sharded, EveryModeMatchesSingleProcessBf16Mixed) {
  for (auto c : modes()) {
    c.bf16 = true;
    run_parity(c);
  }
}

TEST(Sharded, GatheredCopyInBf16MatchesBf16Mixed) {
  for (auto c : modes()) {
    c.bf16 = true;
    c.param_dtype = "bf16";
    run_parity(c);
  }
}

// reduce_dtype bf16 sends half the bytes (the counts in run_parity) and
// stays within one more bf16 rounding of the reference.
TEST(Sharded, Bf16ReductionMatchesWithinOneRounding) {
  for (auto c : modes()) {
    c.bf16 = true;
    c.reduce_dtype = "bf16";
    run_parity(c);
  }
}

TEST(Sharded, FrozenLayerIsNeverReduced) {
  for (auto c : modes()) {
    c.freeze = true;
    run_parity(c);
  }
}

TEST(Sharded, AccumulationInBothModesMatchesOneBigBatch) {
  for (auto c : modes()) {
    c.accumulate = 2;
    for (const char* mode : {"sharded", "unsharded"}) {
      c.accumulation = mode;
      run_parity(c);
    }
  }
}

TEST(Sharded, UserWrapPredicate) {
  Case c;
  auto o = options_for(c);
  o.wrap_policy([](const std::string& name, const torch::nn::Module&, int64_t) {
    return name == "l1" || name == "l3";  // l2 stays in the root unit
  });
  auto model = make_net(false);
  auto strategy = strategy::make_strategy(o);
  strategy->setup(*model, g_world);
  const auto units = dynamic_cast<ShardedStrategy&>(*strategy).units();
  ASSERT_EQ(units.size(), 3u);
  EXPECT_EQ(units[0].first, "");
  EXPECT_EQ(units[0].second, 48 * 48 + 48 + 2);  // l2 and the root's own parameters
  EXPECT_EQ(units[1].first, "l1");
  EXPECT_EQ(units[2].first, "l3");
}

namespace {

// Two Linear(256, 256) units: 65,792 parameters (263,168 bytes) each, above
// the 256 KB from which shared-memory collectives ask for the in-place path.
struct WideImpl : torch::nn::Module {
  WideImpl() {
    a = register_module("a", torch::nn::Linear(256, 256));
    b = register_module("b", torch::nn::Linear(256, 256));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = unit_forward(a, [&] { return torch::tanh(a(x)); });
    return unit_forward(b, [&] { return b(h); });
  }
  torch::nn::Linear a{nullptr}, b{nullptr};
};
TORCH_MODULE(Wide);

}  // namespace

// ZeRO-1 and NO_SHARD keep their flats whole for the run, in memory every
// data-parallel rank maps (Communicator::allocate). Where the ranks share
// memory, a step's gradient all-reduces (and ZeRO-1's parameter all-gathers
// after the step before) read the peers' buffers in place and none is
// staged: the strategy's comm_stats count them. Elsewhere (a world of one,
// mpirun) both counts stay zero. Either way the parameters are, to the
// bit, those of a reference that all-reduces ordinary gradient tensors
// (in a group of their own: the staged path) and takes the same SGD steps,
// up to the order of the sums (which rank adds first follows the shards).
TEST(Sharded, WholeFlatsOfZero1AndNoShardReduceAndGatherInPlace) {
  const bool shared = g_world->endpoint().find("through shared memory") != std::string::npos;
  std::vector<int> everyone(static_cast<size_t>(world_size()));
  std::iota(everyone.begin(), everyone.end(), 0);
  const auto ref_group = g_world->new_group(everyone);
  for (const char* mode : {"zero1", "no_shard"}) {
    Case c;
    c.name = std::string(mode) == "zero1" ? "zero1" : "fsdp";
    c.sharding = std::string(mode) == "zero1" ? "full_shard" : mode;
    torch::manual_seed(7);
    Wide model, ref;
    {
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < model->parameters().size(); ++i) ref->parameters()[i].copy_(model->parameters()[i]);
    }
    auto strategy = strategy::make_strategy(options_for(c));
    strategy->setup(*model, g_world);
    std::vector<torch::Tensor> shards;
    for (const auto& p : strategy->optimizer_parameters()) shards.push_back(p.local);
    torch::optim::SGD opt(shards, torch::optim::SGDOptions(0.1));
    torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1));
    for (int step = 0; step < 3; ++step) {
      torch::manual_seed(100 + 10 * step + rank());
      const torch::Tensor x = torch::randn({4, 256});
      model->forward(x).square().mean().backward();
      strategy->finish_gradient_sync();
      const strategy::CommStats stats = strategy->comm_stats();
      // Two flats reduced; from the second step on ZeRO-1 also gathered both.
      const int64_t ops = 2 + (c.name == "zero1" && step > 0 && world_size() > 1 ? 2 : 0);
      EXPECT_EQ(stats.in_place_ops, shared ? ops : 0) << mode << " step " << step;
      EXPECT_EQ(stats.staged_ops, 0) << mode << " step " << step;
      strategy->optimizer_step(opt);
      opt.zero_grad();

      ref->forward(x).square().mean().backward();
      for (auto& p : ref->parameters()) ref_group->all_reduce(p.grad(), AllReduceOptions().op(ReduceOp::Avg));
      ref_opt.step();
      ref_opt.zero_grad();
    }
    // After the steps: full_state_dict's own gathers would count in a step.
    for (const auto& [name, value] : strategy->full_state_dict()) {
      if (rank() == 0) {
        EXPECT_TRUE(torch::allclose(value, ref->named_parameters()[name], 1e-6, 1e-7)) << mode << " " << name;
      }
    }
  }
}

namespace {

// Every backward prefetch mode, with and without forward prefetch, under
// limit_all_gathers 1, 2 and 3.
std::vector<Case> prefetch_cases() {
  std::vector<Case> out;
  for (const int limit : {1, 2, 3}) {
    for (const char* p : {"backward_pre", "backward_post", "none"}) {
      for (bool fwd : {false, true}) {
        Case c;
        c.prefetch = p;
        c.forward_prefetch = fwd;
        c.limit_all_gathers = limit;
        out.push_back(c);
      }
    }
  }
  return out;
}

}  // namespace

TEST(Sharded, PrefetchVariantsUnderEveryGatherLimitMatch) {
  for (const auto& c : prefetch_cases()) run_parity(c);
}

TEST(Sharded, HybridShardTwoNodesOfTwo) {
  if (world_size() != 4) GTEST_SKIP() << "hybrid_shard is tested with 2 nodes x 2 ranks";
  Case c;
  c.sharding = "hybrid_shard";
  // Started as two launcher nodes of 2, the node size comes from
  // LOCAL_WORLD_SIZE; started as one node of 4, it is set to 2 here.
  const char* local = std::getenv("LOCAL_WORLD_SIZE");
  c.local_world_size = local != nullptr && std::string(local) == "2" ? 0 : 2;
  run_parity(c);
  c.bf16 = true;
  run_parity(c);
  c.bf16 = false;
  c.accumulate = 2;
  run_parity(c);
}

// Meshes where the node count and the ranks per node differ, 2 x 3 and
// 3 x 2 (nodes x ranks per node) on 6 ranks: a shard group is one node's
// ranks (0-2 and 3-5; or 0-1, 2-3, 4-5), a replica group the ranks holding
// the same shard on every node (0,3 1,4 2,5; or 0,2,4 1,3,5). Groups built
// with nodes and ranks per node swapped would average different shards,
// which a 2 x 2 mesh cannot show.
TEST(Sharded, HybridShardOnMeshesThatAreNotSquare) {
  if (world_size() != 6) GTEST_SKIP() << "the uneven meshes are tested on 6 ranks";
  for (const int per_node : {3, 2}) {
    Case c;
    c.sharding = "hybrid_shard";
    c.local_world_size = per_node;
    run_parity(c);
    c.accumulate = 2;
    run_parity(c);
  }
}

// ---- memory --------------------------------------------------------------------------------

namespace {

// Counts the bytes of every CPU tensor allocated while it is installed.
class CountingAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) const override {
    void* data = c10::alloc_cpu(n);
    add(static_cast<int64_t>(n));
    return {data, new Block{data, n}, &release, c10::Device(c10::kCPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }

  static int64_t live() { return live_.load(); }
  static int64_t peak() { return peak_.load(); }
  static void reset_peak() { peak_ = live_.load(); }

 private:
  struct Block {
    void* data;
    size_t bytes;
  };
  static void add(int64_t n) {
    const int64_t now = live_ += n;
    int64_t p = peak_.load();
    while (now > p && !peak_.compare_exchange_weak(p, now)) {
    }
  }
  static void release(void* ctx) {
    auto* b = static_cast<Block*>(ctx);
    c10::free_cpu(b->data);
    live_ -= static_cast<int64_t>(b->bytes);
    delete b;
  }
  static inline std::atomic<int64_t> live_{0};
  static inline std::atomic<int64_t> peak_{0};
};

// 16 units of 65,792 parameters and no root parameters; activations of a
// 2-row batch are a few KB.
struct StackImpl : torch::nn::Module {
  StackImpl() {
    for (int i = 0; i < 16; ++i) layers.push_back(register_module("l" + std::to_string(i), torch::nn::Linear(256, 256)));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& l : layers) x = unit_forward(l, [&] { return torch::tanh(l(x)); });
    return x;
  }
  std::vector<torch::nn::Linear> layers;
};
TORCH_MODULE(Stack);

}  // namespace

// Model state per rank under FULL_SHARD at world size 4: the ZeRO-3 formula
// 16Ψ/N (fp32 master shard 4, gradient shard 4, Adam 8) plus the two
// largest gathered units (parameters 4 and gradients 4 bytes per element).
// Measured: the peak of every CPU tensor allocation plus the flat buffers
// (mmap) over steps 2-3, an upper bound of their joint peak.
TEST(Sharded, FullShardModelStateMemoryMatchesTheFormula) {
  if (world_size() != 4) GTEST_SKIP() << "measured at world size 4";
  static CountingAllocator counting;
  c10::SetCPUAllocator(&counting, /*priority=*/100);
  int64_t psi = 0, unit = 0;
  {
    torch::manual_seed(7);
    Stack model;
    for (const auto& p : model->parameters()) psi += p.numel();
    unit = psi / 16;
    const auto o = StrategyOptions()
                       .strategy(strategy::StrategyKind::Fsdp)
                       .sharding(strategy::Sharding::FullShard)
                       .wrap_module_types({"LinearImpl"});
    auto strategy = strategy::make_strategy(o);
    strategy->setup(*model, g_world);
    auto opt = make_optimizer(strategy->optimizer_parameters(), false);
    const auto x = torch::randn({2, 256});
    const auto step = [&] {
      model->forward(x).square().mean().backward();
      strategy->finish_gradient_sync();
      strategy->clip_grad_norm(1.0);
      strategy->optimizer_step(*opt);
      opt->zero_grad();
    };
    step();  // Adam state exists from here on
    // Between steps no unit is gathered: every flat buffer went back.
    EXPECT_EQ(strategy::detail::flat_memory_stats().live_bytes, 0);
    CountingAllocator::reset_peak();
    strategy::detail::reset_flat_memory_peak();
    step();
    step();
    const double measured = static_cast<double>(CountingAllocator::peak()) +
                            static_cast<double>(strategy::detail::flat_memory_stats().peak_bytes);
    const double shard = std::ceil(static_cast<double>(psi) / 4.0);
    const double expected = 16.0 * shard + 2.0 * 8.0 * static_cast<double>(unit);
    std::printf("[memory] rank %d: measured %.2f MB, formula 16*Psi/N + 2 units %.2f MB (%.1f%%)\n", rank(),
                measured / 1e6, expected / 1e6, 100.0 * (measured - expected) / expected);
    EXPECT_NEAR(measured, expected, 0.15 * expected);
    EXPECT_EQ(strategy::detail::flat_memory_stats().live_bytes, 0);
  }
  c10::SetCPUAllocator(c10::GetDefaultCPUAllocator(), /*priority=*/101);
}

// ---- errors --------------------------------------------------------------------------------

namespace {

// l2 is a unit by policy but its forward bypasses unit_forward.
struct BypassImpl : torch::nn::Module {
  BypassImpl() {
    l1 = register_module("l1", torch::nn::Linear(4, 4));
    l2 = register_module("l2", torch::nn::Linear(4, 4));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = unit_forward(l1, [&] { return l1(x); });
    return l2(h);
  }
  torch::nn::Linear l1{nullptr}, l2{nullptr};
};
TORCH_MODULE(Bypass);

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "(no ConfigError)";
}

}  // namespace

TEST(Sharded, UnitNotCalledThroughUnitForwardIsAnErrorNamingIt) {
  Bypass model;
  const auto o =
      StrategyOptions().strategy(strategy::StrategyKind::Fsdp).wrap_module_types({"LinearImpl"});
  auto strategy = strategy::make_strategy(o);
  strategy->setup(*model, g_world);
  const std::string msg = error_of([&] {
    model->forward(torch::randn({2, 4})).sum().backward();
    strategy->finish_gradient_sync();
  });
  EXPECT_NE(msg.find("'l2'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("unit_forward"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("'l1'"), std::string::npos) << msg;
}

// Two units registering one tensor (weight tying across units).
struct HolderImpl : torch::nn::Module {
  explicit HolderImpl(const torch::Tensor& w) { weight = register_parameter("weight", w); }
  torch::Tensor weight;
};
TORCH_MODULE(Holder);

struct TiedImpl : torch::nn::Module {
  TiedImpl() {
    const auto w = torch::randn({4, 4});
    a = register_module("a", Holder(w));
    b = register_module("b", Holder(w));
  }
  Holder a{nullptr}, b{nullptr};
};
TORCH_MODULE(Tied);

TEST(Sharded, TiedParameterAcrossUnitsIsAnErrorNamingIt) {
  Tied model;
  const auto o =
      StrategyOptions().strategy(strategy::StrategyKind::Fsdp).wrap_module_types({"HolderImpl"});
  auto strategy = strategy::make_strategy(o);
  const std::string msg = error_of([&] { strategy->setup(*model, g_world); });
  EXPECT_NE(msg.find("'a.weight'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("unit 'b'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("tied"), std::string::npos) << msg;
}

TEST(Sharded, BadOptionsAreConfigErrors) {
  using namespace strategy;
  EXPECT_NE(error_of([] { enum_from_name<Sharding>("full", "distributed.sharding"); }).find("full_shard"),
            std::string::npos);
  EXPECT_NE(error_of([] { enum_from_name<AutoWrapPolicy>("blocks", "distributed.auto_wrap_policy"); })
                .find("module_type"),
            std::string::npos);
  EXPECT_NE(error_of([] { enum_from_name<Accumulation>("lazy", "distributed.accumulation"); })
                .find("unsharded"),
            std::string::npos);
  const auto o = StrategyOptions().strategy(StrategyKind::Fsdp).limit_all_gathers(0);
  EXPECT_NE(error_of([&] { make_strategy(o); }).find("limit_all_gathers"), std::string::npos);
}

// At most limit_all_gathers unit gathers are in flight (issued and not yet
// waited for) at once, under every prefetch mode; a prefetch waits for the
// gathers before it, so even a limit of 1 prefetches.
TEST(Sharded, PrefetchStaysWithinTheGatherLimit) {
  for (const auto& c : prefetch_cases()) {
    auto model = make_net(false);
    auto strategy = strategy::make_strategy(options_for(c));
    strategy->setup(*model, g_world);
    auto& sharded = dynamic_cast<ShardedStrategy&>(*strategy);
    for (int s = 0; s < 3; ++s) {
      model->forward(torch::randn({4, kIn})).sum().backward();
      strategy->finish_gradient_sync();
    }
    EXPECT_EQ(sharded.prefetches() > 0, c.prefetch != "none" || c.forward_prefetch) << c.label();
    EXPECT_GE(sharded.max_gathers_in_flight(), 1) << c.label();
    EXPECT_LE(sharded.max_gathers_in_flight(), c.limit_all_gathers) << c.label();
  }
}

// auto_wrap_policy size: in post-order, a module with children whose
// parameters not yet in a unit number at least min_num_params becomes a
// unit. GPT blocks of n_embd 32: attn 4224, mlp 8352, each LayerNorm 64.
TEST(Sharded, SizePolicyWrapsModulesFromMinNumParams) {
  models::GPTConfig g;
  g.n_layer = 2;
  g.n_head = 2;
  g.n_embd = 32;
  g.block_size = 8;
  using Units = std::vector<std::pair<std::string, int64_t>>;
  const auto units_for = [&](int64_t min_num_params) {
    torch::manual_seed(3);
    models::GPT model(g);
    const auto o = StrategyOptions()
                       .strategy(strategy::StrategyKind::Fsdp)
                       .auto_wrap_policy(strategy::AutoWrapPolicy::Size)
                       .min_num_params(min_num_params);
    auto strategy = strategy::make_strategy(o);
    strategy->setup(*model, g_world);
    // One training step through the units, to prove they are usable.
    model->forward(torch::randint(256, {2, 8})).square().mean().backward();
    strategy->finish_gradient_sync();
    auto units = dynamic_cast<ShardedStrategy&>(*strategy).units();
    std::sort(units.begin(), units.end());
    return units;
  };
  const int64_t root = 256 * 32 + 8 * 32 + 2 * 32;  // wte, wpe, ln_f
  // 4224: attn reaches it exactly, so attn and mlp are units; the block
  // keeps only its LayerNorms.
  EXPECT_EQ(units_for(4224), (Units{{"", root + 2 * 128}, {"h.0.attn", 4224}, {"h.0.mlp", 8352},
                                    {"h.1.attn", 4224}, {"h.1.mlp", 8352}}));
  // 4225: attn stays with its block, which then reaches 4224 + 128.
  EXPECT_EQ(units_for(4225), (Units{{"", root}, {"h.0", 4224 + 128}, {"h.0.mlp", 8352},
                                    {"h.1", 4224 + 128}, {"h.1.mlp", 8352}}));
  // Above any block: only the root is left; it is a unit by itself.
  EXPECT_EQ(units_for(1 << 20), (Units{{"", root + 2 * (4224 + 8352 + 128)}}));
}

// Three equal units; ranks other than 0 skip the middle one, so they reduce
// in another order than rank 0 (with equal sizes the collectives would pair
// up silently). finish_gradient_sync must say so on every rank.
struct SkipImpl : torch::nn::Module {
  SkipImpl() {
    for (int i = 0; i < 3; ++i) layers.push_back(register_module("l" + std::to_string(i), torch::nn::Linear(8, 8)));
  }
  torch::Tensor forward(torch::Tensor x, bool skip_middle) {
    for (int i = 0; i < 3; ++i) {
      if (skip_middle && i == 1) continue;
      auto& l = layers[static_cast<size_t>(i)];
      x = unit_forward(l, [&] { return l(x); });
    }
    return x;
  }
  std::vector<torch::nn::Linear> layers;
};
TORCH_MODULE(Skip);

TEST(Sharded, RanksUsingDifferentUnitsIsAnErrorNotSilentlyWrong) {
  if (world_size() == 1) GTEST_SKIP() << "needs two ranks";
  Skip model;
  // In the first step every unit is still gathered from setup and
  // shard_grad_op does not free it after forward, so only the reductions
  // differ between ranks (same count, same sizes): the silent case.
  const auto o = StrategyOptions()
                     .strategy(strategy::StrategyKind::Fsdp)
                     .sharding(strategy::Sharding::ShardGradOp)
                     .wrap_module_types({"LinearImpl"});
  auto strategy = strategy::make_strategy(o);
  strategy->setup(*model, g_world);
  const std::string msg = error_of([&] {
    model->forward(torch::randn({2, 8}), rank() != 0).sum().backward();
    strategy->finish_gradient_sync();
  });
  EXPECT_NE(msg.find("different orders"), std::string::npos) << msg;
}
