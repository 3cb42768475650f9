// Sharded checkpoints across processes, through the real launcher: saved
// by a world of A ranks (DistCheckpoint.Save), loaded by a world of B ranks
// with other slicing (DistCheckpoint.Load), for the pairs tests/dist/
// checkpoint.cmake lists. Parameters, buffers and AdamW state over 1-D
// shards all reshard; every loaded element must equal the original. With a
// rank file missing or corrupt, every rank throws a CheckpointError naming
// the file, whichever rank found it (DistCheckpoint.FailsTogether).
//
// Environment: SHARDTRAIN_CKPT_TEST_DIR (where the worlds save), and for the
// load tests SHARDTRAIN_CKPT_FROM (the saving world's size).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "checkpoint_synthetic.h"
#include "shardtrain/checkpoint/checkpoint.h"
#include "shardtrain/checkpoint/optimizer_state.h"
#include "shardtrain/comm/communicator.h"
#include "shardtrain/core/error.h"
#include "world.h"

namespace {

namespace fs = std::filesystem;
namespace ck = shardtrain::checkpoint;
namespace syn = shardtrain::testing::synthetic;
using shardtrain::CheckpointError;
using shardtrain::strategy::ShardedTensor;

std::shared_ptr<shardtrain::comm::Communicator>& g_world = shardtrain::testing::world_ptr();
int rank() { return g_world->rank(); }
int world_size() { return g_world->size(); }

std::string base_dir() {
  const char* d = std::getenv("SHARDTRAIN_CKPT_TEST_DIR");
  return d ? d : "";
}
int from_world() {
  const char* f = std::getenv("SHARDTRAIN_CKPT_FROM");
  return f ? std::atoi(f) : 0;
}
std::string world_dir(int world) { return base_dir() + "/world" + std::to_string(world); }

// Parameters an AdamW is built over: 1-D shards (shard_range when saving,
// the uneven split when loading), with 0, 1 and no-divisor sizes.
const std::vector<std::vector<int64_t>> kOptShapes = {{7, 3}, {1}, {0}, {}, {10}};

at::Tensor opt_param_full(size_t k) {
  int64_t n = 1;
  for (auto d : kOptShapes[k]) n *= d;
  return torch::arange(n, torch::kFloat).mul(0.1).add(static_cast<double>(k));
}
// The state values written after the real step, known to every loader.
at::Tensor state_full(size_t k, int which) {
  return opt_param_full(k).mul(which == 0 ? 0.5 : 0.25).add(which == 0 ? -1.0 : 3.0);
}
constexpr int64_t kStep = 5;

std::vector<ShardedTensor> opt_params(int world, int r, bool uneven, bool fill) {
  std::vector<ShardedTensor> out;
  for (size_t k = 0; k < kOptShapes.size(); ++k) {
    const auto full = opt_param_full(k);
    int64_t off, count;
    if (uneven) {
      std::tie(off, count) = syn::uneven_range(full.numel(), world, r);
    } else {
      const auto s = shardtrain::comm::shard_range(full.numel(), world, r);
      off = s.offset;
      count = s.count;
    }
    ShardedTensor p;
    p.name = "opt.p" + std::to_string(k);
    p.global_shape = kOptShapes[k];
    p.offset = off;
    p.local = full.narrow(0, off, count).clone();
    if (!fill) p.local.fill_(std::numeric_limits<float>::quiet_NaN());
    p.local.requires_grad_(true);
    out.push_back(p);
  }
  return out;
}

std::vector<at::Tensor> locals(const std::vector<ShardedTensor>& ps) {
  std::vector<at::Tensor> out;
  for (const auto& p : ps) out.push_back(p.local);
  return out;
}

TEST(DistCheckpoint, Save) {
  if (base_dir().empty()) GTEST_SKIP() << "SHARDTRAIN_CKPT_TEST_DIR is not set";
  const int a = world_size();
  auto tensors = syn::rank_tensors(a, rank(), 0, true);

  // AdamW over this rank's shards: one real step, then state values every
  // loader can recompute (a real step's values would depend on how
  // vectorised kernels split the elements).
  auto params = opt_params(a, rank(), false, true);
  torch::optim::AdamW opt(locals(params), torch::optim::AdamWOptions(0.01));
  for (auto& p : params) p.local.mutable_grad() = torch::ones_like(p.local);
  opt.step();
  {
    torch::NoGradGuard no_grad;
    for (size_t k = 0; k < params.size(); ++k) {
      auto& st = static_cast<torch::optim::AdamWParamState&>(
          *opt.state().at(c10::guts::to_string(params[k].local.unsafeGetTensorImpl())));
      st.exp_avg().copy_(state_full(k, 0).narrow(0, params[k].offset, params[k].local.numel()));
      st.exp_avg_sq().copy_(state_full(k, 1).narrow(0, params[k].offset, params[k].local.numel()));
      st.step(kStep);
      // The parameters go back to their known values too.
      params[k].local.copy_(opt_param_full(k).narrow(0, params[k].offset, params[k].local.numel()));
    }
  }
  for (const auto& p : params) tensors.push_back(p);
  for (const auto& e : ck::optimizer_state(opt, params)) tensors.push_back(e);

  const std::string dir = ck::save_sharded(
      world_dir(a), *g_world, tensors, "train state of world " + std::to_string(a),
      "rank " + std::to_string(rank()) + " of " + std::to_string(a),
      ck::SaveOptions().strategy("synthetic").step(a).checksum_chunk_bytes(256));
  EXPECT_TRUE(ck::is_complete(dir));
  const ck::Metadata m = ck::read_metadata(dir);
  EXPECT_EQ(m.world_size, a);
  EXPECT_EQ(m.files.size(), static_cast<size_t>(a) + 1);
}

TEST(DistCheckpoint, Load) {
  if (base_dir().empty() || from_world() == 0) GTEST_SKIP() << "needs SHARDTRAIN_CKPT_TEST_DIR and _FROM";
  const int a = from_world(), b = world_size();
  const std::string dir = world_dir(a);
  const std::string where = std::to_string(a) + " -> " + std::to_string(b) + ", rank " + std::to_string(rank());

  auto targets = syn::rank_tensors(b, rank(), 1, false);
  const size_t n_synthetic = targets.size();
  auto params = opt_params(b, rank(), true, false);
  for (const auto& p : params) targets.push_back(p);
  const ck::LoadResult r = ck::load_sharded(dir, *g_world, targets);

  syn::expect_values(std::vector<ShardedTensor>(targets.begin(), targets.begin() + n_synthetic), where);
  for (size_t k = 0; k < params.size(); ++k) {
    EXPECT_TRUE(at::equal(params[k].local.detach(),
                          opt_param_full(k).narrow(0, params[k].offset, params[k].local.numel())))
        << where << " " << params[k].name;
  }
  EXPECT_EQ(r.train_state, "train state of world " + std::to_string(a));
  EXPECT_EQ(r.rank_state_restored, a == b);
  if (a == b) EXPECT_EQ(r.rank_state, "rank " + std::to_string(rank()) + " of " + std::to_string(a));
  EXPECT_EQ(r.metadata.world_size, a);
  EXPECT_EQ(r.metadata.strategy, "synthetic");
  EXPECT_EQ(r.metadata.step, a);

  // The optimizer state follows the new slicing.
  torch::optim::AdamW opt(locals(params), torch::optim::AdamWOptions(0.01));
  ck::load_optimizer_state(dir, *g_world, opt, params);
  for (size_t k = 0; k < params.size(); ++k) {
    auto it = opt.state().find(c10::guts::to_string(params[k].local.unsafeGetTensorImpl()));
    ASSERT_NE(it, opt.state().end()) << where << " " << params[k].name;
    auto& st = static_cast<torch::optim::AdamWParamState&>(*it->second);
    const auto slice = [&](int which) {
      return state_full(k, which).narrow(0, params[k].offset, params[k].local.numel())
          .reshape(params[k].local.sizes());
    };
    EXPECT_TRUE(at::equal(st.exp_avg(), slice(0))) << where << " " << params[k].name;
    EXPECT_TRUE(at::equal(st.exp_avg_sq(), slice(1))) << where << " " << params[k].name;
    EXPECT_EQ(st.step(), kStep) << where << " " << params[k].name;
  }
  // And it steps.
  for (auto& p : params) p.local.mutable_grad() = torch::ones_like(p.local);
  opt.step();
}

void flip_byte(const std::string& path, int64_t offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(offset);
  char c = 0;
  f.read(&c, 1);
  f.seekp(offset);
  f.put(static_cast<char>(c ^ 0x21));
}

TEST(DistCheckpoint, FailsTogether) {
  if (base_dir().empty() || from_world() == 0) GTEST_SKIP() << "needs SHARDTRAIN_CKPT_TEST_DIR and _FROM";
  const int a = from_world(), b = world_size();
  const std::string tag = std::to_string(a) + "_to_" + std::to_string(b);
  const std::string missing = base_dir() + "/missing_" + tag;
  const std::string corrupt = base_dir() + "/corrupt_" + tag;
  std::string damaged_file;
  {
    // Every rank computes which file holds big.weight's largest slice.
    const ck::Metadata m = ck::read_metadata(world_dir(a));
    const ck::TensorInfo* big = m.find_tensor("big.weight");
    const ck::SliceInfo* s = &big->slices[0];
    for (const auto& x : big->slices) {
      if (x.count > s->count) s = &x;
    }
    damaged_file = s->file;
    if (rank() == 0) {
      for (const auto& d : {missing, corrupt}) {
        fs::remove_all(d);
        fs::copy(world_dir(a), d, fs::copy_options::recursive);
      }
      fs::remove(fs::path(missing) / "rank-00000.bin");
      flip_byte((fs::path(corrupt) / s->file).string(), s->byte_offset + 4 * (s->count / 2));
    }
  }
  g_world->barrier();

  for (const auto& [dir, needle] : {std::pair<std::string, std::string>{missing, "rank-00000.bin"},
                                    {corrupt, damaged_file}}) {
    auto targets = syn::rank_tensors(b, rank(), 1, false);
    try {
      ck::load_sharded(dir, *g_world, targets, ck::LoadOptions().strict(false));
      ADD_FAILURE() << "loading " << dir << " did not throw on rank " << rank();
    } catch (const CheckpointError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(needle), std::string::npos) << "rank " << rank() << ": " << msg;
    }
  }
  g_world->barrier();
  if (rank() == 0) {
    fs::remove_all(missing);
    fs::remove_all(corrupt);
  }
}

}  // namespace
