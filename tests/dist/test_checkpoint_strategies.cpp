// Resharding with the real strategies: a model trained for 3 steps under
// strategy A on WA ranks and saved (Matrix.Save) is loaded under strategy B
// on WB ranks (Matrix.Load), for the pairs tests/dist/
// checkpoint_strategies.cmake lists.
//
// The model is test_fsdp.cpp's: three Linear units called through
// unit_forward and root parameters of 2 and 0 elements (3415 parameters, not
// divisible by 2, 3 or 4), plus a 3-element buffer, trained with AdamW
// (weight decay on matrices) and clipping. Each rank takes its rows of a
// fixed global batch per step. The saving job also writes its reference
// next to the checkpoint: the full state at the save, the global losses of
// the 2 steps that follow, and the full state after them. The loading job
// builds its model from another seed, loads parameters, buffers and AdamW
// state, and must then have
//   (a) the saved full state, bitwise;
//   (b) the reference's next 2 losses within 1e-5 relative (another world
//       size sums gradients in another order), and the final state within
//       the fp32 parity tolerance of test_fsdp.cpp (1e-5 + 1e-4 |ref|);
//   where A and B are the same strategy at the same world size, (b) holds
//   bitwise.
//
// Environment (set by the .cmake file):
//   SHARDTRAIN_MATRIX_DIR         the saving configuration's directory:
//                                 checkpoint/, reference.pt, reference.txt
//   SHARDTRAIN_MATRIX_STRATEGY    "single", "ddp", "zero1" or "fsdp/<sharding>"
//   SHARDTRAIN_MATRIX_NODE_SIZE   hybrid_shard's ranks per node (optional)
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "shardtrain/checkpoint/checkpoint.h"
#include "shardtrain/checkpoint/optimizer_state.h"
#include "shardtrain/comm/communicator.h"
#include "shardtrain/strategy/strategy.h"
#include "shardtrain/strategy/unit.h"
#include "world.h"

namespace {

namespace fs = std::filesystem;
namespace ck = shardtrain::checkpoint;
namespace st = shardtrain::strategy;
using st::unit_forward;

std::shared_ptr<shardtrain::comm::Communicator>& g_world = shardtrain::testing::world_ptr();
int rank() { return g_world->rank(); }
int world_size() { return g_world->size(); }

constexpr int64_t kIn = 16, kHidden = 48, kOut = 5;
constexpr int64_t kRows = 12;       // global batch: divisible by 1..4
constexpr int64_t kSavedStep = 3;   // steps trained before the save
constexpr int64_t kMoreSteps = 2;   // steps compared after it
constexpr double kMaxNorm = 0.5;

struct NetImpl : torch::nn::Module {
  NetImpl() {
    l1 = register_module("l1", torch::nn::Linear(kIn, kHidden));
    l2 = register_module("l2", torch::nn::Linear(kHidden, kHidden));
    l3 = register_module("l3", torch::nn::Linear(kHidden, kOut));
    gain = register_parameter("gain", torch::ones({2}));
    empty = register_parameter("empty", torch::zeros({0}));
    // A buffer that depends on the seed, so loading must overwrite it too.
    scale = register_buffer("scale", torch::rand({3}));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = unit_forward(l1, [&] { return torch::gelu(l1(x)); });
    h = unit_forward(l2, [&] { return torch::gelu(l2(h)); });
    auto y = unit_forward(l3, [&] { return l3(h); });
    return y * (gain.sum() / 2 + 0.1 * scale.sum()) + empty.sum();
  }
  torch::nn::Linear l1{nullptr}, l2{nullptr}, l3{nullptr};
  torch::Tensor gain, empty, scale;
};
TORCH_MODULE(Net);

// Ranks other than 0 perturb their copy: setup must start every rank from
// rank 0's values.
Net make_net(uint64_t seed) {
  torch::manual_seed(seed);
  Net net;
  if (rank() != 0) {
    torch::NoGradGuard no_grad;
    for (auto& p : net->parameters()) p.add_(0.25 * rank());
    net->scale.add_(rank());
  }
  return net;
}

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

std::string matrix_dir() { return env("SHARDTRAIN_MATRIX_DIR"); }
std::string checkpoint_path() { return matrix_dir() + "/checkpoint"; }

std::unique_ptr<st::Strategy> make_strategy_from_env() {
  const std::string spec = env("SHARDTRAIN_MATRIX_STRATEGY");
  st::StrategyOptions o;
  const auto slash = spec.find('/');
  o.strategy(shardtrain::enum_from_name<st::StrategyKind>(spec.substr(0, slash), "strategy"));
  if (slash != std::string::npos) {
    o.sharding(shardtrain::enum_from_name<st::Sharding>(spec.substr(slash + 1), "sharding"));
  }
  o.auto_wrap_policy(st::AutoWrapPolicy::ModuleType).wrap_module_types({"LinearImpl"});
  const std::string node = env("SHARDTRAIN_MATRIX_NODE_SIZE");
  if (!node.empty()) o.local_world_size(std::stoi(node));
  return st::make_strategy(o);
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const std::vector<st::ShardedTensor>& params) {
  std::vector<torch::Tensor> decay, no_decay;
  for (const auto& p : params) (p.global_shape.size() >= 2 ? decay : no_decay).push_back(p.local);
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

// The global batches of every step, the same in every job.
struct Data {
  torch::Tensor xs, ys;
  Data() {
    torch::manual_seed(1234);
    xs = torch::randn({kSavedStep + kMoreSteps, kRows, kIn});
    ys = torch::randn({kSavedStep + kMoreSteps, kRows, kOut});
  }
};

double global_sum(double local) {
  auto t = torch::tensor({local}, torch::kDouble);
  g_world->all_reduce(t).wait();
  return t.item<double>();
}

// One optimizer step on this rank's rows of step `s`; returns the global
// mean loss (the mean over ranks of their row means, all equal in size).
double train_step(Net& model, st::Strategy& strategy, torch::optim::Optimizer& opt, const Data& data,
                  int64_t s) {
  const int64_t per_rank = kRows / world_size();
  const int64_t first = rank() * per_rank;
  auto loss = torch::mse_loss(model->forward(data.xs[s].narrow(0, first, per_rank)),
                              data.ys[s].narrow(0, first, per_rank));
  loss.backward();
  strategy.finish_gradient_sync();
  strategy.clip_grad_norm(kMaxNorm);
  strategy.optimizer_step(opt);
  opt.zero_grad();
  return global_sum(loss.item<double>()) / world_size();
}

// ---- the reference written next to the checkpoint ------------------------------------------

struct Reference {
  std::vector<std::string> names;            // full_state_dict order
  std::vector<torch::Tensor> saved, final;   // at the save, after kMoreSteps more
  std::vector<double> losses;                // of the kMoreSteps steps
};

void write_reference(const Reference& ref) {
  std::vector<torch::Tensor> all = ref.saved;
  all.insert(all.end(), ref.final.begin(), ref.final.end());
  torch::save(all, matrix_dir() + "/reference.pt");
  std::ofstream out(matrix_dir() + "/reference.txt");
  out << "losses";
  char buf[64];
  for (double l : ref.losses) {
    std::snprintf(buf, sizeof buf, " %.17g", l);
    out << buf;
  }
  out << "\n";
  for (const auto& n : ref.names) out << n << "\n";
  ASSERT_TRUE(out.good()) << "cannot write " << matrix_dir() << "/reference.txt";
}

Reference read_reference() {
  Reference ref;
  std::ifstream in(matrix_dir() + "/reference.txt");
  std::string line, word;
  std::getline(in, line);
  std::istringstream first(line);
  first >> word;  // "losses"
  for (double l; first >> l;) ref.losses.push_back(l);
  while (std::getline(in, line)) {
    if (!line.empty()) ref.names.push_back(line);
  }
  std::vector<torch::Tensor> all;
  torch::load(all, matrix_dir() + "/reference.pt");
  const auto n = static_cast<std::ptrdiff_t>(ref.names.size());
  if (static_cast<std::ptrdiff_t>(all.size()) == 2 * n) {
    ref.saved.assign(all.begin(), all.begin() + n);
    ref.final.assign(all.begin() + n, all.end());
  }
  return ref;
}

// Every rank stops at the same point, or the others would wait for it.
bool any_rank_failed() { return global_sum(::testing::Test::HasFailure() ? 1.0 : 0.0) > 0; }

// On rank 0 (the only one holding a full state): `got` against the
// reference, bitwise or within the fp32 parity tolerance. A helper, so that
// a failed ASSERT returns from here and rank 0 still joins the collectives
// that follow.
void compare_state(const std::vector<std::pair<std::string, at::Tensor>>& got,
                   const std::vector<std::string>& names, const std::vector<torch::Tensor>& want,
                   bool exact, const std::string& when) {
  if (rank() != 0) return;
  ASSERT_EQ(got.size(), names.size()) << when;
  ASSERT_EQ(want.size(), names.size()) << when;
  for (size_t i = 0; i < got.size(); ++i) {
    const auto& [name, value] = got[i];
    EXPECT_EQ(name, names[i]) << when;
    EXPECT_EQ(value.scalar_type(), want[i].scalar_type()) << name << " " << when;
    if (value.sizes() != want[i].sizes()) {
      ADD_FAILURE() << name << " " << when << ": shape " << value.sizes() << ", reference " << want[i].sizes();
      continue;
    }
    const double max_diff = value.numel() ? (value - want[i]).abs().max().item<double>() : 0.0;
    if (exact) {
      EXPECT_TRUE(torch::equal(value, want[i])) << name << " " << when << ": not bitwise equal, max |diff| "
                                                << max_diff;
    } else {
      EXPECT_TRUE(torch::allclose(value, want[i], 1e-4, 1e-5)) << name << " " << when << ": max |diff| "
                                                                << max_diff;
    }
  }
}

std::vector<st::ShardedTensor> with_optimizer_state(st::Strategy& strategy, torch::optim::Optimizer& opt) {
  auto tensors = strategy.sharded_state_dict();
  const auto state = ck::optimizer_state(opt, strategy.optimizer_parameters());
  tensors.insert(tensors.end(), state.begin(), state.end());
  return tensors;
}

}  // namespace

// Trains kSavedStep steps, saves, then records the reference continuation.
TEST(Matrix, Save) {
  ASSERT_FALSE(matrix_dir().empty()) << "set SHARDTRAIN_MATRIX_DIR";
  if (rank() == 0) {
    fs::remove_all(matrix_dir());
    fs::create_directories(matrix_dir());
  }
  g_world->barrier();

  const Data data;
  auto model = make_net(42);
  auto strategy = make_strategy_from_env();
  strategy->setup(*model, g_world);
  auto opt = make_optimizer(strategy->optimizer_parameters());
  for (int64_t s = 0; s < kSavedStep; ++s) train_step(model, *strategy, *opt, data, s);

  ck::save_sharded(checkpoint_path(), *g_world, with_optimizer_state(*strategy, *opt),
                   "train-state step 3", "rank-state " + std::to_string(rank()),
                   ck::SaveOptions().strategy(strategy->name()).step(kSavedStep).checksum_chunk_bytes(4096));

  Reference ref;
  for (auto& [name, value] : strategy->full_state_dict()) {
    ref.names.push_back(name);
    ref.saved.push_back(value.clone());
  }
  for (int64_t s = kSavedStep; s < kSavedStep + kMoreSteps; ++s) {
    ref.losses.push_back(train_step(model, *strategy, *opt, data, s));
  }
  for (auto& [name, value] : strategy->full_state_dict()) ref.final.push_back(value.clone());
  if (rank() == 0) {
    write_reference(ref);
    std::printf("[matrix] saved %s x%d at step %" PRId64 ", next losses %.9g %.9g\n",
                strategy->name().c_str(), world_size(), kSavedStep, ref.losses[0], ref.losses[1]);
  }
  ASSERT_FALSE(any_rank_failed());
  EXPECT_TRUE(ck::is_complete(checkpoint_path()));
}

// Loads under this job's strategy and world size, then compares.
TEST(Matrix, Load) {
  ASSERT_FALSE(matrix_dir().empty()) << "set SHARDTRAIN_MATRIX_DIR";
  const Data data;
  auto model = make_net(7);  // another seed: every value must come from the checkpoint
  auto strategy = make_strategy_from_env();
  strategy->setup(*model, g_world);
  auto opt = make_optimizer(strategy->optimizer_parameters());

  auto targets = strategy->sharded_state_dict();
  const auto result = ck::load_sharded(checkpoint_path(), *g_world, targets);
  strategy->reload_parameters();
  ck::load_optimizer_state(checkpoint_path(), *g_world, *opt, strategy->optimizer_parameters());

  const auto& meta = result.metadata;
  const bool same = meta.strategy == strategy->name() && meta.world_size == world_size();
  const std::string pair = meta.strategy + " x" + std::to_string(meta.world_size) + " -> " +
                           strategy->name() + " x" + std::to_string(world_size());
  SCOPED_TRACE(pair);
  EXPECT_EQ(meta.step, kSavedStep);
  EXPECT_EQ(result.train_state, "train-state step 3");
  EXPECT_EQ(result.rank_state_restored, meta.world_size == world_size());
  if (result.rank_state_restored) EXPECT_EQ(result.rank_state, "rank-state " + std::to_string(rank()));

  const Reference ref = rank() == 0 ? read_reference() : Reference{};
  if (rank() == 0) {
    EXPECT_EQ(ref.losses.size(), static_cast<size_t>(kMoreSteps)) << "reference.txt";
    EXPECT_EQ(ref.saved.size(), ref.names.size()) << "reference.pt";
  }
  // (a) the loaded model is the saved one, bit for bit.
  compare_state(strategy->full_state_dict(), ref.names, ref.saved, true, "after loading");
  ASSERT_FALSE(any_rank_failed());

  // (b) training goes on as it did in the saving job.
  for (int64_t k = 0; k < kMoreSteps; ++k) {
    const double loss = train_step(model, *strategy, *opt, data, kSavedStep + k);
    if (rank() != 0 || ref.losses.size() != static_cast<size_t>(kMoreSteps)) continue;
    const double want = ref.losses[static_cast<size_t>(k)];
    if (same) {
      EXPECT_EQ(loss, want) << "step " << kSavedStep + k << ": same strategy and world, so bitwise";
    } else {
      EXPECT_NEAR(loss, want, 1e-5 * std::abs(want)) << "step " << kSavedStep + k;
    }
    std::printf("[matrix] %s step %" PRId64 ": loss %.9g, reference %.9g (rel diff %.2g)\n", pair.c_str(),
                kSavedStep + k, loss, want, std::abs(loss - want) / std::abs(want));
  }
  compare_state(strategy->full_state_dict(), ref.names, ref.final, same,
                "after " + std::to_string(kMoreSteps) + " more steps");
  ASSERT_FALSE(any_rank_failed());
}
