// Loading a Hugging Face directory under FULL_SHARD never costs a rank the
// whole model: the model is built deferred, and each rank reads from the
// files only the slices its shards hold (a quantized base is quantized
// tensor by tensor as it is read). With SHARDTRAIN_LOADING_TP=2 the ranks
// are a tensor-parallel pair instead: each reads only its blocks.
//
// Each rank measures its own peak RSS (VmHWM, reset through clear_refs)
// while the trainer is built and set up, against the model's fp32 bytes and
// against its peak over two training steps; then the weights the strategy
// holds are gathered and compared bit for bit with a model built whole and
// loaded the plain way (and quantized whole, for QLoRA).
//
// The same program is the loading benchmark (bench/loading.sh): the model's
// shape comes from SHARDTRAIN_LOADING_LAYERS / _HIDDEN / _INTERMEDIATE, and
// rank 0 prints one "loading:" line with the figures.
// SHARDTRAIN_LOADING_QUANTIZE: none (full fine-tuning, the default) or nf4
// (QLoRA).
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <malloc.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

#include "shardtrain/comm/communicator.h"
#include "shardtrain/config/config.h"
#include "shardtrain/models/family.h"
#include "shardtrain/models/hf_dir.h"
#include "shardtrain/models/lora.h"
#include "shardtrain/strategy/strategy.h"
#include "shardtrain/train/callback.h"
#include "shardtrain/train/task.h"
#include "shardtrain/train/trainer.h"
#include "world.h"

using namespace shardtrain;
namespace fs = std::filesystem;

namespace {

std::shared_ptr<comm::Communicator>& g_world = ::shardtrain::testing::world_ptr();

int64_t env_int(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::stoll(v) : fallback;
}

// /proc/self/status field `key` in bytes.
int64_t status_bytes(const std::string& key) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key + ":", 0) == 0) return std::stoll(line.substr(key.size() + 1)) * 1024;
  }
  ADD_FAILURE() << "no " << key << " in /proc/self/status";
  return 0;
}
// Starts a new peak: VmHWM becomes the current RSS.
void reset_peak() { std::ofstream("/proc/self/clear_refs") << "5"; }

double max_over_ranks(double v) {
  auto t = torch::tensor({v}, torch::kDouble);
  g_world->all_reduce(t, comm::AllReduceOptions().op(comm::ReduceOp::Max));
  return t.item<double>();
}

// Rank 0 writes a random Llama directory (two shards and an index) with the
// independent reference's writer, in a process of its own, so that no rank
// has held the model before it measures; every rank then reads its
// config.json. Returns the model section and the model's fp32 bytes.
std::pair<config::ModelConfig, int64_t> write_model() {
  const char* port = std::getenv("MASTER_PORT");
  const fs::path dir = fs::temp_directory_path() / ("shardtrain_loading_" + std::string(port ? port : "0"));
  if (g_world->rank() == 0) {
    fs::remove_all(dir);
    const char* ref = std::getenv("SHARDTRAIN_LLAMA_REF");
    const std::string command =
        std::string("/usr/bin/python3 ") + (ref ? ref : "tests/reference/llama_ref.py") + " make " +
        dir.string() + " --shards 2 --vocab_size 256 --max_position_embeddings 64" +
        " --num_hidden_layers " + std::to_string(env_int("SHARDTRAIN_LOADING_LAYERS", 8)) +
        " --hidden_size " + std::to_string(env_int("SHARDTRAIN_LOADING_HIDDEN", 768)) +
        " --intermediate_size " + std::to_string(env_int("SHARDTRAIN_LOADING_INTERMEDIATE", 2048)) +
        " --num_attention_heads " + std::to_string(env_int("SHARDTRAIN_LOADING_HIDDEN", 768) / 64) +
        " --num_key_value_heads 4 > /dev/null";
    EXPECT_EQ(std::system(command.c_str()), 0) << command;
  }
  g_world->barrier();
  config::ModelConfig m;
  m.type = train::ModelType::Auto;
  m.init_from = dir.string();
  m.block_size = 16;
  models::resolve_model_config(m);
  return {m, static_cast<int64_t>(models::family_of(m.type).num_parameters(m)) * 4};
}

// Seconds to read every file of `dir` once (warm cache): into one reused
// buffer (`fresh` false), or each into new memory of its size, as a loader
// that keeps the bytes must (`fresh`: the pages are faulted in as well).
double read_once_s(const std::string& dir, bool fresh) {
  std::vector<char> buffer(16 << 20);
  const auto t0 = std::chrono::steady_clock::now();
  for (const auto& e : fs::directory_iterator(dir)) {
    std::ifstream in(e.path(), std::ios::binary);
    if (fresh) {
      std::unique_ptr<char[]> bytes(new char[e.file_size()]);
      in.read(bytes.get(), static_cast<std::streamsize>(e.file_size()));
      continue;
    }
    while (in.read(buffer.data(), static_cast<std::streamsize>(buffer.size())) || in.gcount() > 0) {
    }
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

config::Config run_config(const config::ModelConfig& m, models::LoraQuantize q, const std::string& data) {
  config::Config c;
  c.model = m;
  c.run.dir = m.init_from + "_run_" + enum_name(q);
  c.data.train = data;
  c.data.val_fraction = 0.0;
  c.batch.global = 2;
  c.batch.micro = 1;
  c.batch.accumulate.reset();
  c.trainer.max_steps = 2;
  c.trainer.eval_every = 0;
  c.trainer.progress = train::ProgressMode::None;
  c.trainer.sample_tokens = 0;
  c.checkpoint.keep = 1;
  c.distributed.strategy(strategy::StrategyKind::Fsdp);
  c.distributed.sharding(strategy::Sharding::FullShard);
  c.distributed.threads_per_rank(1);
  // SHARDTRAIN_LOADING_TP: tensor-parallel ranks (the rest shard); each
  // reads only its blocks of the split tensors.
  c.distributed.tensor_parallel(env_int("SHARDTRAIN_LOADING_TP", 1));
  if (q != models::LoraQuantize::None) c.lora.r(4).alpha(8).quantize(q).double_quant(true);
  return c;
}

// The highest RSS of the training steps.
class PeakOfSteps : public train::Callback {
 public:
  int64_t peak = 0;
  void on_step_end(train::TrainerState&, train::TrainerControl&) override {
    peak = std::max(peak, status_bytes("VmHWM"));
  }
};

struct Loaded {
  double load_s = 0;
  int64_t load_growth = 0, load_peak = 0, train_peak = 0;
};

// Builds and sets up the trainer (peak RSS measured), checks the weights
// it holds against a plain load, then trains two steps.
Loaded load_and_train(const config::Config& c) {
  Loaded r;
  malloc_trim(0);
  reset_peak();
  const int64_t before = status_bytes("VmRSS");
  // Every rank starts the clock together: rank 0 has just timed the plain
  // reads, and a rank that started alone would count its wait for rank 0 at
  // the setup's first collective as loading.
  g_world->barrier();
  const auto t0 = std::chrono::steady_clock::now();
  auto task = train::make_task(c, c.distributed.data_parallel_size(g_world->size()));
  train::Trainer trainer(c, std::move(task), g_world);
  r.load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.load_peak = status_bytes("VmHWM");
  r.load_growth = r.load_peak - before;

  // The weights as the strategy holds them, against a model built whole and
  // loaded (and quantized) the plain way.
  const auto state = trainer.strategy().full_state_dict();
  if (g_world->rank() == 0) {
    const auto& family = models::family_of(c.model.type);
    torch::manual_seed(c.run.seed);
    auto plain = family.build(c.model);
    models::load_hf_weights(*plain, std::make_shared<const models::HfWeights>(c.model.init_from), family);
    if (c.lora.r() > 0) {
      models::LoraOptions o = c.lora;
      models::apply_lora(*plain, o.target_modules(family.lora_targets()).seed(c.run.seed));
    }
    auto want = plain->named_parameters();
    EXPECT_EQ(state.size(), want.size());
    for (const auto& [name, value] : state) {
      const at::Tensor* other = want.find(name);
      EXPECT_TRUE(other != nullptr && torch::equal(value, *other)) << name << " differs from the plain load";
    }
  }
  malloc_trim(0);
  reset_peak();
  auto steps = std::make_shared<PeakOfSteps>();
  trainer.add_callback(steps);
  trainer.fit();
  r.train_peak = steps->peak;
  return r;
}

std::string data_file() {
  const fs::path path =
      fs::temp_directory_path() / ("shardtrain_loading_" + std::to_string(getpid()) + ".txt");
  std::ofstream out(path);
  for (int i = 0; i < 200; ++i) out << "line " << i << " of the loading test's text\n";
  return path.string();
}

}  // namespace

TEST(ShardedLoading, NoRankHoldsTheWholeModelAndTheShardsAreTheFiles) {
  const auto [m, full_bytes] = write_model();
  const std::string dir = m.init_from;
  const double read_s = g_world->rank() == 0 ? read_once_s(dir, false) : 0.0;
  const double read_fresh_s = g_world->rank() == 0 ? read_once_s(dir, true) : 0.0;
  const std::string data = data_file();
  // One variant per process, so each rank measures from a clean start.
  const char* variant = std::getenv("SHARDTRAIN_LOADING_QUANTIZE");
  const auto q = enum_from_name<models::LoraQuantize>(variant ? variant : "none", "quantize");
  {
    const config::Config c = run_config(m, q, data);
    const Loaded r = load_and_train(c);
    const double growth = max_over_ranks(static_cast<double>(r.load_growth));
    const double load_s = max_over_ranks(r.load_s);
    // FULL_SHARD on n ranks keeps 1/n of the weights and, when they train,
    // 1/n of their gradients (tensor-parallel ranks split all but the
    // norms, so tp x full_shard keeps 1/n too), plus a layer read at a time (0.3 leaves room
    // for the allocator); a quantized base keeps its codes alone, plus the
    // quantizer's scratch memory, which the allocator keeps for training to
    // reuse (measured: 0.39 of full_bytes on 2 ranks). Building the whole
    // model would cost 1.0 of full_bytes on top.
    const double cap = q == models::LoraQuantize::None ? 2.0 / g_world->size() + 0.3 : 0.6;
    EXPECT_LT(growth, cap * static_cast<double>(full_bytes))
        << enum_name(q) << ": a rank's RSS grew by " << growth / 1e6 << " MB while loading a model of "
        << full_bytes / 1e6 << " MB";
    // Loading never needs more than training does afterwards.
    EXPECT_LE(r.load_peak, r.train_peak + (8 << 20))
        << enum_name(q) << ": loading peaked at " << r.load_peak / 1e6 << " MB, training at "
        << r.train_peak / 1e6 << " MB";
    if (g_world->rank() == 0) {
      std::printf("loading: quantize=%s ranks=%d model_mb=%.1f read_once_s=%.3f read_fresh_s=%.3f "
                  "load_s=%.3f load_growth_mb=%.1f load_peak_mb=%.1f train_peak_mb=%.1f\n",
                  enum_name(q), g_world->size(), full_bytes / 1e6, read_s, read_fresh_s, load_s, growth / 1e6,
                  r.load_peak / 1e6, r.train_peak / 1e6);
      std::fflush(stdout);
    }
    if (g_world->rank() == 0) fs::remove_all(c.run.dir);
  }
  g_world->barrier();
  if (g_world->rank() == 0) fs::remove_all(dir);
  fs::remove(data);
}
