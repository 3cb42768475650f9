// LoRA through the Trainer under every strategy matches the single-process
// LoRA run: losses, clipped norms and final adapters within the trainer
// parity tolerances; the frozen base never changes, is never reduced and has
// no optimizer state; a quantized base is gathered at its stored size.
// Every rank also computes the single-process reference itself.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <map>

#include "shardtrain/comm/communicator.h"
#include "shardtrain/config/config.h"
#include "shardtrain/models/family.h"
#include "shardtrain/models/hf_dir.h"
#include "shardtrain/models/lora_peft.h"
#include "shardtrain/strategy/strategy.h"
#include "shardtrain/train/task.h"
#include "shardtrain/train/trainer.h"
#include "world.h"

using namespace shardtrain;
namespace fs = std::filesystem;
using models::LoraQuantize;

namespace {

std::shared_ptr<comm::Communicator>& g_world = ::shardtrain::testing::world_ptr();
// Clipping fires hard in every step (norms are several times this), so a
// clip computed but not applied fails.
constexpr double kMaxGradNorm = 0.05;

std::string corpus_file() {
  const fs::path path = fs::temp_directory_path() / ("shardtrain_lora_" + std::to_string(getpid()) + ".txt");
  std::ofstream out(path);
  for (int i = 0; i < 300; ++i) out << "row " << i % 29 << ": pack my box with " << (i * 5) % 13 << " jugs\n";
  return path.string();
}

config::Config lora_config(const std::string& data, int64_t micro, const std::string& strategy,
                           LoraQuantize quantize) {
  config::Config c;
  c.run.dir = (fs::temp_directory_path() / ("shardtrain_lora_run_" + ::shardtrain::testing::job_id())).string();
  c.model.n_layer = 2;
  c.model.n_head = 2;
  c.model.n_embd = 64;  // nf4 blocks of 64 along every input width
  c.model.block_size = 16;
  c.data.train = data;
  c.data.val_fraction = 0.0;
  c.batch.global = 12;
  c.batch.micro = micro;
  c.batch.accumulate.reset();
  c.optimizer.lr = 1e-2;
  c.schedule.warmup_steps = 1;
  c.trainer.max_steps = 5;
  c.trainer.eval_every = 0;
  c.trainer.max_grad_norm = kMaxGradNorm;
  c.trainer.progress = train::ProgressMode::None;
  c.trainer.sample_tokens = 0;
  c.checkpoint.keep = 1;
  c.distributed.strategy(enum_from_name<shardtrain::strategy::StrategyKind>(strategy, "strategy"));
  c.distributed.threads_per_rank(1);
  c.lora.r(3).alpha(6).quantize(quantize).double_quant(quantize == LoraQuantize::Nf4);
  return c;
}

struct Step {
  double loss, grad_norm;
  strategy::CommStats stats;
};

class Recorder : public train::Callback {
 public:
  explicit Recorder(train::Trainer* t) : trainer_(t) {}
  std::vector<Step> steps;
  void on_step_end(train::TrainerState& s, train::TrainerControl&) override {
    steps.push_back({s.loss, s.grad_norm, trainer_->strategy().comm_stats()});
  }

 private:
  train::Trainer* trainer_;
};

struct LoraRun {
  std::unique_ptr<train::Trainer> trainer;
  std::shared_ptr<Recorder> recorder;
  const std::vector<Step>& steps() const { return recorder->steps; }
};

LoraRun train_run(const config::Config& c, const std::shared_ptr<comm::Communicator>& comm) {
  LoraRun run;
  run.trainer = std::make_unique<train::Trainer>(c, train::make_task(c, comm->size()), comm);
  run.recorder = std::make_shared<Recorder>(run.trainer.get());
  run.trainer->add_callback(run.recorder);
  run.trainer->fit();
  return run;
}

LoraRun reference_run(const std::string& data, LoraQuantize q,
                      const std::function<void(config::Config&)>& tweak = {}) {
  auto c = lora_config(data, 12, "single", q);
  if (tweak) tweak(c);
  c.run.dir += "_reference_" + std::to_string(getpid());
  LoraRun r = train_run(c, comm::Communicator::create(comm::CommOptions()));
  fs::remove_all(c.run.dir);
  return r;
}

bool is_adapter(const std::string& name) { return name.find(".lora_") != std::string::npos; }

// fp32: the trainer parity tolerances (tests/dist/test_trainer_parity.cpp).
// bf16-mixed: those of the sharded bf16 parity (tests/dist/test_fsdp.cpp),
// since each rank's bf16 GEMMs round a different micro-batch.
struct Tolerance {
  double loss_atol, loss_rtol, norm_rtol, param_rtol, param_atol;
};
constexpr Tolerance kFp32{2e-5, 0.0, 1e-4, 1e-4, 2e-5};
constexpr Tolerance kBf16{0.0, 1e-2, 2e-2, 2e-2, 2e-3};

// Bytes of the adapters, and of everything, in the reference model.
struct Sizes {
  int64_t adapter_bytes = 0, total_bytes = 0;
};
Sizes sizes_of(torch::nn::Module& model) {
  Sizes s;
  for (const auto& p : model.named_parameters()) {
    s.total_bytes += p.value().nbytes();
    if (is_adapter(p.key())) s.adapter_bytes += p.value().nbytes();
  }
  return s;
}

void expect_same_run(const LoraRun& got, const LoraRun& ref, const std::string& what,
                     const Tolerance& tol = kFp32) {
  ASSERT_EQ(got.steps().size(), ref.steps().size()) << what;
  for (size_t i = 0; i < ref.steps().size(); ++i) {
    EXPECT_GT(ref.steps()[i].grad_norm, 4 * kMaxGradNorm) << "step " << i + 1 << ": the clip must fire hard";
    const double want = ref.steps()[i].loss;
    EXPECT_NEAR(got.steps()[i].loss, want, tol.loss_atol + tol.loss_rtol * std::abs(want))
        << what << " step " << i + 1;
    EXPECT_NEAR(got.steps()[i].grad_norm, ref.steps()[i].grad_norm, tol.norm_rtol * ref.steps()[i].grad_norm)
        << what << " step " << i + 1;
  }
  // Frozen tensors have no optimizer state: the optimizer sees adapters only.
  for (const auto& t : got.trainer->strategy().optimizer_parameters()) {
    EXPECT_TRUE(is_adapter(t.name)) << what << ": optimizer holds frozen '" << t.name << "'";
  }
  // Only adapters are reduced. The sharded strategies reduce padded flats
  // (at most n - 1 elements more per unit), and may reduce once per
  // micro-step (2 here); the frozen base is many times larger.
  const Sizes s = sizes_of(*ref.trainer->model());
  const int64_t slack = 4 * 4 * g_world->size() * 3;  // per-flat padding, fp32, at most 3 flats
  for (size_t i = 0; i < got.steps().size(); ++i) {
    const int64_t reduced = got.steps()[i].stats.reduced_bytes;
    EXPECT_GE(reduced, s.adapter_bytes) << what << " step " << i + 1;
    EXPECT_LE(reduced, 2 * (s.adapter_bytes + slack)) << what << " step " << i + 1 << " reduced "
                                                       << reduced << " bytes; adapters are "
                                                       << s.adapter_bytes;
  }
  const auto state = got.trainer->strategy().full_state_dict();
  if (g_world->rank() != 0) return;
  const auto want = ref.trainer->model()->named_parameters();
  ASSERT_EQ(state.size(), want.size()) << what;
  for (const auto& [name, value] : state) {
    const auto& other = want[name];
    if (is_adapter(name)) {
      EXPECT_TRUE(torch::allclose(value, other, tol.param_rtol, tol.param_atol))
          << what << " " << name << " differs by " << (value - other).abs().max().item<double>();
      EXPECT_GT(value.abs().max().item<double>(), 0.0) << what << " " << name;
    } else {
      EXPECT_TRUE(torch::equal(value, other)) << what << ": frozen " << name << " changed";
    }
  }
}

}  // namespace

TEST(LoraParity, EveryStrategyMatchesTheSingleProcess) {
  const int n = g_world->size();
  const std::string data = corpus_file();
  std::map<std::string, int64_t> gathered;  // per variant, step 2 (after set-up)
  for (const LoraQuantize q : {LoraQuantize::None, LoraQuantize::Nf4, LoraQuantize::Int8}) {
    const LoraRun ref = reference_run(data, q);
    struct Variant {
      const char* strategy;
      const char* sharding;
    };
    std::vector<Variant> variants = {{"ddp", "full_shard"}, {"fsdp", "full_shard"}};
    if (q == LoraQuantize::None) {
      variants.push_back({"zero1", "full_shard"});
      variants.push_back({"fsdp", "shard_grad_op"});
    }
    for (const Variant& v : variants) {
      auto c = lora_config(data, 12 / (2 * n), v.strategy, q);
      c.distributed.sharding(enum_from_name<shardtrain::strategy::Sharding>(v.sharding, "sharding"));
      c.run.dir += std::string("_") + v.strategy + v.sharding + enum_name(q);
      const LoraRun run = train_run(c, g_world);
      const std::string what = run.trainer->strategy().name() + " lora " + enum_name(q);
      expect_same_run(run, ref, what);
      gathered[what] = run.steps()[1].stats.gathered_bytes;
      g_world->barrier();
      if (g_world->rank() == 0) fs::remove_all(c.run.dir);
    }
  }
  // DDP gathers nothing. FULL_SHARD gathers the blocks forward and backward;
  // a 4-bit base at about 4 bits: much less than the fp32 base.
  EXPECT_EQ(gathered["ddp lora none"], 0);
  const double fp32 = static_cast<double>(gathered["fsdp/full_shard lora none"]);
  EXPECT_GT(fp32, 0);
  EXPECT_LT(gathered["fsdp/full_shard lora nf4"], 0.3 * fp32);
  EXPECT_LT(gathered["fsdp/full_shard lora int8"], 0.4 * fp32);
  if (g_world->rank() == 0) {
    for (const auto& [k, v] : gathered) std::printf("gathered bytes per step, %s: %lld\n", k.c_str(), (long long)v);
  }
  fs::remove(data);
}

// Mixed precision applies to adapters as to any parameter: bf16-mixed LoRA
// (fp32 and nf4 base) under ddp and full_shard against the bf16-mixed single
// process; the frozen base still never changes or travels in reductions.
// SGD with momentum, as in the sharded bf16 parity: AdamW's normalised step
// turns a sign flip of a near-zero bf16 gradient into a full lr-sized move.
TEST(LoraParity, Bf16MixedMatchesTheSingleProcess) {
  const int n = g_world->size();
  const std::string data = corpus_file();
  const auto bf16_sgd = [](config::Config& c) {
    c.precision = precision::PrecisionKind::Bf16Mixed;
    c.optimizer.name = train::OptimizerKind::Sgd;
    c.optimizer.lr = 0.1;
  };
  for (const LoraQuantize q : {LoraQuantize::None, LoraQuantize::Nf4}) {
    const LoraRun ref = reference_run(data, q, bf16_sgd);
    for (const char* strategy : {"ddp", "fsdp"}) {
      auto c = lora_config(data, 12 / (2 * n), strategy, q);
      bf16_sgd(c);
      c.run.dir += std::string("_bf16_") + strategy + enum_name(q);
      const LoraRun run = train_run(c, g_world);
      expect_same_run(run, ref, run.trainer->strategy().name() + " bf16-mixed lora " + enum_name(q), kBf16);
      g_world->barrier();
      if (g_world->rank() == 0) fs::remove_all(c.run.dir);
    }
  }
  fs::remove(data);
}

// QLoRA under tensor parallelism (world 2: tp 2): every rank quantizes its
// own blocks of the base, read from model.init_from. nf4 blocks run along a
// row's input, so a block of a tp rank is a block of the whole weight (each
// row-parallel input width here, 128 / 2 and 512 / 2, is a multiple of 64)
// and the run equals the single process's QLoRA run: losses, norms, the
// adapters, and the dequantized base assembled whole. int8 scales each row
// by its absolute maximum, which a row-parallel block takes over its half
// of the row: the same run within the quantization's own error.
TEST(LoraTensorParallel, QuantizedBasesSplitPerBlock) {
  ASSERT_EQ(g_world->size(), 2) << "run at world size 2";
  const std::string data = corpus_file();
  const fs::path base = fs::temp_directory_path() / ("shardtrain_lora_tp_base_" + ::shardtrain::testing::job_id());
  for (const LoraQuantize q : {LoraQuantize::Nf4, LoraQuantize::Int8}) {
    const auto make = [&](const std::string& strategy, int64_t micro) {
      auto c = lora_config(data, micro, strategy, q);
      c.model.n_embd = 128;
      c.lora.double_quant(false);
      return c;
    };
    if (g_world->rank() == 0 && !fs::exists(base)) {  // the random base, as an HF directory
      auto c = make("single", 12);
      const auto model = train::make_task(c, 1).model;
      std::vector<std::pair<std::string, at::Tensor>> state;
      for (const auto& p : model->named_parameters()) state.emplace_back(p.key(), p.value().detach());
      const auto& family = models::family_of(c.model.type);
      models::save_hf_dir(base.string(), family.hf_config_json(c.model), state, &family, models::kDefaultMaxShardBytes);
    }
    g_world->barrier();
    const auto reference = [&] {
      auto c = make("single", 12);
      c.model.init_from = base.string();
      c.run.dir += "_tp_reference_" + std::to_string(getpid());
      LoraRun r = train_run(c, comm::Communicator::create(comm::CommOptions()));
      fs::remove_all(c.run.dir);
      return r;
    }();
    auto c = make("ddp", 6);
    c.model.init_from = base.string();
    c.distributed.tensor_parallel(2);
    c.run.dir += std::string("_tp2_") + enum_name(q);
    const LoraRun run = train_run(c, g_world);
    const std::string what = run.trainer->strategy().name() + " lora " + enum_name(q);
    const bool exact = q == LoraQuantize::Nf4;
    const Tolerance tol = exact ? kFp32 : Tolerance{0.0, 2e-3, 2e-2, 0.0, 0.0};
    ASSERT_EQ(run.steps().size(), reference.steps().size());
    for (size_t i = 0; i < run.steps().size(); ++i) {
      const double want = reference.steps()[i].loss;
      EXPECT_NEAR(run.steps()[i].loss, want, tol.loss_atol + tol.loss_rtol * want) << what << " step " << i + 1;
      EXPECT_NEAR(run.steps()[i].grad_norm, reference.steps()[i].grad_norm,
                  tol.norm_rtol * reference.steps()[i].grad_norm) << what << " step " << i + 1;
    }
    const auto state = run.trainer->strategy().full_state_dict();
    const auto want = models::dequantize_lora_bases(reference.trainer->strategy().full_state_dict());
    if (g_world->rank() == 0) {
      ASSERT_EQ(state.size(), want.size()) << what;
      for (size_t i = 0; i < want.size(); ++i) {
        const auto& [name, value] = state[i];
        ASSERT_EQ(name, want[i].first) << what;
        const at::Tensor& other = want[i].second;
        if (is_adapter(name)) {
          // int8: AdamW's normalised steps turn the quantizations' small
          // gradient differences into lr-sized moves of near-zero
          // elements; the losses and norms above are its check.
          if (exact) {
            EXPECT_TRUE(torch::allclose(value, other, tol.param_rtol, tol.param_atol))
                << what << " " << name << " differs by " << (value - other).abs().max().item<double>();
          }
        } else if (!exact) {  // the bases within the rounding of two int8 quantizations
          EXPECT_TRUE(torch::allclose(value, other, 0.0, 2e-3))
              << what << ": the base " << name << " differs by " << (value - other).abs().max().item<double>();
        } else {
          EXPECT_TRUE(torch::equal(value, other)) << what << ": the base " << name << " differs";
        }
      }
    }
    g_world->barrier();
    if (g_world->rank() == 0) fs::remove_all(c.run.dir);
  }
  g_world->barrier();
  if (g_world->rank() == 0) fs::remove_all(base);
  fs::remove(data);
}
