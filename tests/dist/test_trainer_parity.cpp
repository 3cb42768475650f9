// DDP through the Trainer matches the single-process run: same global batch,
// same initial weights, same data order; at every world size the launcher
// gives it. Each rank also computes the single-process reference itself.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "shardtrain/checkpoint/checkpoint.h"
#include "shardtrain/comm/communicator.h"
#include "shardtrain/config/config.h"
#include "shardtrain/strategy/strategy.h"
#include "shardtrain/train/task.h"
#include "shardtrain/train/trainer.h"
#include "world.h"

using namespace shardtrain;
namespace fs = std::filesystem;

namespace {

std::shared_ptr<comm::Communicator>& g_world = ::shardtrain::testing::world_ptr();

// Deterministic text with structure a model can learn, written per rank.
std::string corpus_file() {
  const fs::path path = fs::temp_directory_path() /
                        ("shardtrain_parity_" + std::to_string(getpid()) + ".txt");
  std::ofstream out(path);
  for (int i = 0; i < 400; ++i) out << "line " << i % 37 << ": the quick brown fox " << (i * 7) % 11 << "\n";
  return path.string();
}

config::Config parity_config(const std::string& data, int64_t micro, const std::string& strategy) {
  config::Config c;
  // One directory for all ranks of this job (checkpoints are written by
  // every rank): named after the job's rendezvous port.
  const char* port = std::getenv("MASTER_PORT");
  c.run.dir = (fs::temp_directory_path() /
               ("shardtrain_parity_run_" + std::string(port ? port : std::to_string(getpid()))))
                  .string();
  c.model.n_layer = 2;
  c.model.n_head = 2;
  c.model.n_embd = 32;
  c.model.block_size = 16;
  c.data.train = data;
  c.data.val_fraction = 0.1;
  c.batch.global = 12;
  c.batch.micro = micro;
  c.batch.accumulate.reset();
  c.optimizer.lr = 3e-3;
  c.schedule.warmup_steps = 2;
  c.trainer.max_steps = 10;
  c.trainer.eval_every = 5;
  c.trainer.eval_batches = 2;
  c.trainer.max_grad_norm = 0.5;  // clipping active: the global norm must agree
  c.trainer.progress = train::ProgressMode::None;
  c.trainer.sample_tokens = 0;
  c.distributed.strategy(enum_from_name<shardtrain::strategy::StrategyKind>(strategy, "strategy"));
  c.distributed.threads_per_rank(1);
  return c;
}

struct StepRecord {
  double loss;
  double grad_norm;
  int64_t collectives;
};

class Recorder : public train::Callback {
 public:
  explicit Recorder(train::Trainer* t) : trainer_(t) {}
  std::vector<StepRecord> steps;
  void on_step_end(train::TrainerState& s, train::TrainerControl&) override {
    steps.push_back({s.loss, s.grad_norm, trainer_->strategy().gradient_collectives()});
  }

 private:
  train::Trainer* trainer_;
};

// One run of the trainer to its end, with every step recorded.
struct TrainedRun {
  std::unique_ptr<train::Trainer> trainer;
  std::shared_ptr<Recorder> recorder;
  const std::vector<StepRecord>& steps() const { return recorder->steps; }
};

TrainedRun train_run(const config::Config& c, const std::shared_ptr<comm::Communicator>& comm) {
  TrainedRun run;
  run.trainer = std::make_unique<train::Trainer>(c, train::make_task(c, comm->size()), comm);
  run.recorder = std::make_shared<Recorder>(run.trainer.get());
  run.trainer->add_callback(run.recorder);
  run.trainer->fit();
  return run;
}

// The reference: one process, one micro-batch of the whole global batch, in
// a run directory of this rank's own (every rank runs it).
TrainedRun reference_run(const std::string& data) {
  auto c = parity_config(data, 12, "single");
  c.run.dir += "_reference_" + std::to_string(getpid());
  return train_run(c, comm::Communicator::create(comm::CommOptions()));
}

}  // namespace

// Tolerances: fp32 throughout; ranks sum gradients in another order than the
// single process, so values differ by rounding that grows slowly with steps.
constexpr double kLossAtol = 2e-5;
constexpr double kParamRtol = 1e-4;
constexpr double kParamAtol = 2e-5;

// Loss and clipped norm of every step, and the final weights (gathered to
// rank 0 through full_state_dict), against a reference run.
void expect_same_run(const TrainedRun& got, const TrainedRun& ref, const std::string& what) {
  ASSERT_EQ(got.steps().size(), ref.steps().size()) << what;
  for (size_t i = 0; i < ref.steps().size(); ++i) {
    EXPECT_NEAR(got.steps()[i].loss, ref.steps()[i].loss, kLossAtol) << what << " step " << i + 1;
    EXPECT_NEAR(got.steps()[i].grad_norm, ref.steps()[i].grad_norm,
                1e-4 * ref.steps()[i].grad_norm) << what << " step " << i + 1;
  }
  const auto state = got.trainer->strategy().full_state_dict();
  if (g_world->rank() != 0) return;
  const auto want = ref.trainer->model()->named_parameters();
  ASSERT_EQ(state.size(), want.size()) << what;
  for (const auto& [name, value] : state) {
    const auto& other = want[name];
    EXPECT_TRUE(torch::allclose(value, other, kParamRtol, kParamAtol))
        << what << " " << name << " differs by " << (value - other).abs().max().item<double>();
  }
}

// Every sharded strategy through the Trainer on the GPT, whose blocks are
// the units: the same run as the single process, with accumulation 2.
TEST(TrainerParity, ShardedStrategiesMatchSingleProcessStepByStep) {
  const int n = g_world->size();
  const std::string data = corpus_file();
  const TrainedRun ref = reference_run(data);

  struct Variant {
    std::string strategy, sharding;
    bool checkpointing;
  };
  for (const Variant& v : {Variant{"zero1", "full_shard", false}, Variant{"fsdp", "full_shard", false},
                           Variant{"fsdp", "full_shard", true}, Variant{"fsdp", "shard_grad_op", true},
                           Variant{"fsdp", "no_shard", false}}) {
    auto c = parity_config(data, 12 / (2 * n), v.strategy);
    c.distributed.sharding(enum_from_name<shardtrain::strategy::Sharding>(v.sharding, "sharding"));
    c.model.activation_checkpointing = v.checkpointing;
    const TrainedRun run = train_run(c, g_world);
    expect_same_run(run, ref,
                    run.trainer->strategy().name() + (v.checkpointing ? " +activation checkpointing" : ""));
  }
  fs::remove(data);
}

TEST(TrainerParity, DdpMatchesSingleProcessStepByStep) {
  const int n = g_world->size();
  const std::string data = corpus_file();

  // Accumulation 2 under DDP: micro = 12 / (2 n).
  const auto ddp_config = parity_config(data, 12 / (2 * n), "ddp");
  const TrainedRun ddp = train_run(ddp_config, g_world);
  EXPECT_EQ(ddp.trainer->batch().accumulate, 2);
  const TrainedRun ref = reference_run(data);
  const auto& ddp_rec = ddp.recorder;
  const auto& ref_rec = ref.recorder;

  ASSERT_EQ(ddp_rec->steps.size(), 10u);
  ASSERT_EQ(ref_rec->steps.size(), 10u);
  int64_t previous = 0;
  for (size_t i = 0; i < 10; ++i) {
    EXPECT_NEAR(ddp_rec->steps[i].loss, ref_rec->steps[i].loss, kLossAtol) << "step " << i + 1;
    EXPECT_NEAR(ddp_rec->steps[i].grad_norm, ref_rec->steps[i].grad_norm,
                1e-4 * ref_rec->steps[i].grad_norm) << "step " << i + 1;
    // One bucket for this small model, reduced once per optimizer step,
    // not once per micro-step.
    EXPECT_EQ(ddp_rec->steps[i].collectives - previous, 1) << "step " << i + 1;
    previous = ddp_rec->steps[i].collectives;
  }
  const auto a = ddp.trainer->model()->named_parameters();
  const auto b = ref.trainer->model()->named_parameters();
  ASSERT_EQ(a.size(), b.size());
  for (const auto& item : a) {
    const auto& other = b[item.key()];
    EXPECT_TRUE(torch::allclose(item.value(), other, kParamRtol, kParamAtol))
        << item.key() << " differs by " << (item.value() - other).abs().max().item<double>();
  }
  fs::remove(data);
}

// Resume at the same world size and strategy continues bit-exactly: every
// later step's loss equals the uninterrupted run's. The same checkpoint
// resumed under another strategy continues within rounding.
TEST(TrainerResume, SameLayoutIsBitExactOtherStrategyIsClose) {
  const int n = g_world->size();
  const std::string data = corpus_file();
  for (const char* strategy : {"ddp", "fsdp"}) {
    auto c = parity_config(data, 12 / (2 * n), strategy);
    c.run.dir += std::string("_resume_") + strategy;
    c.trainer.max_steps = 8;
    c.trainer.eval_every = 0;
    c.checkpoint.every_n_steps = 4;
    const TrainedRun whole = train_run(c, g_world);

    const std::string from = checkpoint::checkpoint_dir(c.run.dir, 4);
    for (const char* other : {"ddp", "fsdp"}) {
      auto r = c;
      r.distributed.strategy(enum_from_name<shardtrain::strategy::StrategyKind>(other, "strategy"));
      r.checkpoint.resume = from;
      r.run.dir += std::string("_as_") + other;
      const TrainedRun resumed = train_run(r, g_world);
      ASSERT_EQ(resumed.steps().size(), 4u);
      for (size_t i = 0; i < 4; ++i) {
        const double want = whole.steps()[4 + i].loss;
        if (std::string(other) == strategy) {
          EXPECT_EQ(resumed.steps()[i].loss, want) << strategy << " step " << 5 + i;
        } else {
          EXPECT_NEAR(resumed.steps()[i].loss, want, kLossAtol) << strategy << " as " << other << " step " << 5 + i;
        }
      }
      if (g_world->rank() == 0) fs::remove_all(r.run.dir);
    }
    g_world->barrier();
    if (g_world->rank() == 0) fs::remove_all(c.run.dir);
  }
  fs::remove(data);
}
