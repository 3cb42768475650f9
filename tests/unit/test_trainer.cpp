// The trainer in one process: event order, control flags, early stopping,
// schedules, the metrics file and accumulation through the loop; the
// learning rate each step applies, dropout around evaluations and the best
// checkpoint across a restart, against expectations the tests work out
// themselves.
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>

#include "shardtrain/checkpoint/checkpoint.h"
#include "shardtrain/checkpoint/safetensors.h"
#include "shardtrain/comm/communicator.h"
#include "shardtrain/config/config.h"
#include "shardtrain/core/error.h"
#include "shardtrain/train/callbacks.h"
#include "shardtrain/train/schedule.h"
#include "shardtrain/train/task.h"
#include "shardtrain/train/trainer.h"
#include "shardtrain/data/tokens.h"
#include "test_helpers.h"
#include "shardtrain/models/gpt.h"
#include "temp_dir.h"

using namespace shardtrain;
namespace fs = std::filesystem;

namespace {

std::shared_ptr<comm::Communicator> world_of_default_options() {
  return comm::Communicator::create(comm::CommOptions());
}

// Every run directory and file of this process lives under one directory,
// removed with everything in it when the process ends.
std::string temp_dir(const std::string& name) {
  static const shardtrain::testing::TempDir root("shardtrain_trainer_test");
  const fs::path dir = fs::path(root.path()) / name;
  fs::remove_all(dir);
  return dir.string();
}

// A small MLP regression job: fast, no files needed.
config::Config mlp_config(const std::string& name) {
  config::Config c;
  c.run.dir = temp_dir(name);
  c.model.type = train::ModelType::Mlp;
  c.model.mlp_sizes = {8, 16, 4};
  c.batch.global = 8;
  c.batch.micro = 4;
  c.batch.accumulate.reset();
  c.optimizer.name = train::OptimizerKind::Sgd;
  c.optimizer.lr = 0.05;
  c.optimizer.momentum = 0.9;
  c.optimizer.weight_decay = 0.0;
  c.schedule.name = train::LrSchedule::Constant;
  c.schedule.warmup_steps = 0;
  c.trainer.max_steps = 3;
  c.trainer.eval_every = 2;
  c.trainer.eval_batches = 2;
  c.trainer.log_every = 1;
  c.trainer.progress = train::ProgressMode::None;
  c.distributed.strategy(strategy::StrategyKind::Single);
  return c;
}

// Records every event as one word.
class Recorder : public train::Callback {
 public:
  std::vector<std::string> events;
  void on_train_begin(train::TrainerState&, train::TrainerControl&) override { events.push_back("train_begin"); }
  void on_epoch_begin(train::TrainerState&, train::TrainerControl&) override { events.push_back("epoch_begin"); }
  void on_step_begin(train::TrainerState&, train::TrainerControl&) override { events.push_back("step_begin"); }
  void on_substep_end(train::TrainerState&, train::TrainerControl&) override { events.push_back("substep_end"); }
  void on_pre_optimizer_step(train::TrainerState&, train::TrainerControl&) override { events.push_back("pre_optimizer_step"); }
  void on_optimizer_step(train::TrainerState&, train::TrainerControl&) override { events.push_back("optimizer_step"); }
  void on_step_end(train::TrainerState&, train::TrainerControl&) override { events.push_back("step_end"); }
  void on_log(train::TrainerState&, train::TrainerControl&, const train::Metrics&) override { events.push_back("log"); }
  void on_evaluate(train::TrainerState&, train::TrainerControl&, const train::Metrics&) override { events.push_back("evaluate"); }
  void on_save(train::TrainerState&, train::TrainerControl&, const std::string&) override { events.push_back("save"); }
  void on_epoch_end(train::TrainerState&, train::TrainerControl&) override { events.push_back("epoch_end"); }
  void on_train_end(train::TrainerState&, train::TrainerControl&) override { events.push_back("train_end"); }
};

std::vector<std::string> read_lines(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

}  // namespace

TEST(Trainer, EventsFireInTheDocumentedOrder) {
  auto c = mlp_config("events");
  c.batch.global = 8;
  c.batch.micro = 4;  // accumulate 2 at world size 1
  c.trainer.max_steps = 2;
  c.trainer.eval_every = 2;
  auto comm = world_of_default_options();
  train::Trainer trainer(c, train::make_task(c, 1), comm);
  auto rec = std::make_shared<Recorder>();
  trainer.add_callback(rec);
  trainer.fit();
  const std::vector<std::string> step = {"step_begin", "substep_end", "pre_optimizer_step",
                                         "optimizer_step", "step_end", "log"};
  std::vector<std::string> want = {"train_begin", "epoch_begin"};
  want.insert(want.end(), step.begin(), step.end());
  want.insert(want.end(), step.begin(), step.end());
  for (const char* e : {"evaluate", "epoch_end", "save", "train_end"}) want.push_back(e);
  EXPECT_EQ(rec->events, want);
}

// threads_per_rank governs OpenBLAS's own pool too (Debian's LibTorch does
// not pass its thread count on to OpenBLAS, which sizes itself to the machine).
TEST(Trainer, ThreadsPerRankReachesOpenBlas) {
  using GetThreads = int (*)();
  using SetThreads = void (*)(int);
  auto get = reinterpret_cast<GetThreads>(dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  auto set = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  // Debian's libopenblas0-pthread (make deps) takes over libblas.so.3, so CI,
  // where a skip fails the run, always has it.
  if (get == nullptr || set == nullptr) {
    GTEST_SKIP() << "the BLAS in use is not OpenBLAS; make deps installs libopenblas0-pthread "
                    "(update-alternatives --display libblas.so.3-x86_64-linux-gnu shows which)";
  }
  set(3);
  auto c = mlp_config("blas_threads");
  c.distributed.threads_per_rank(1);
  train::Trainer trainer(c, train::make_task(c, 1), world_of_default_options());
  EXPECT_EQ(at::get_num_threads(), 1);
  EXPECT_EQ(get(), 1);
}

// A flag set by one callback survives the others (OR) and the trainer acts on it.
class StopAt : public train::Callback {
 public:
  explicit StopAt(int64_t step) : step_(step) {}
  void on_step_end(train::TrainerState& s, train::TrainerControl& c) override {
    if (s.step == step_) c.should_training_stop = true;
    c.should_save = s.step == 1;  // a save the default flow would not do
  }
  int64_t step_;
};

class Bystander : public train::Callback {  // sets nothing, must not clear anything
 public:
  void on_step_end(train::TrainerState&, train::TrainerControl&) override {}
  int saves = 0;
  void on_save(train::TrainerState&, train::TrainerControl&, const std::string&) override { ++saves; }
};

TEST(Trainer, ControlFlagsAreOredAndObeyed) {
  auto c = mlp_config("control");
  c.trainer.max_steps = 10;
  c.trainer.eval_every = 0;
  auto comm = world_of_default_options();
  train::Trainer trainer(c, train::make_task(c, 1), comm);
  trainer.add_callback(std::make_shared<StopAt>(3));
  auto bystander = std::make_shared<Bystander>();
  trainer.add_callback(bystander);
  const auto& state = trainer.fit();
  EXPECT_EQ(state.step, 3);
  EXPECT_EQ(bystander->saves, 2);  // the requested one after step 1, and the final one
  // One checkpoint tree and the exported model beside it, nothing else.
  EXPECT_TRUE(checkpoint::is_complete(checkpoint::checkpoint_dir(c.run.dir, 3)));
  EXPECT_TRUE(fs::exists(checkpoint::exported_model_path(c.run.dir)));
  EXPECT_TRUE(fs::exists(checkpoint::exported_config_path(c.run.dir)));
  EXPECT_FALSE(fs::exists(fs::path(c.run.dir) / "checkpoint"));
}

TEST(Trainer, EarlyStoppingStops) {
  auto c = mlp_config("early");
  c.optimizer.lr = 1e-12;  // nothing improves
  c.trainer.max_steps = 50;
  c.trainer.eval_every = 1;
  c.trainer.early_stopping.enabled = true;
  c.trainer.early_stopping.patience = 3;
  c.trainer.early_stopping.min_delta = 1e-3;
  auto comm = world_of_default_options();
  train::Trainer trainer(c, train::make_task(c, 1), comm);
  const auto& state = trainer.fit();
  // First evaluation sets the best; three without improvement stop it.
  EXPECT_EQ(state.step, 4);
}

TEST(EarlyStoppingCallback, FollowsPatienceMinDeltaAndMode) {
  train::EarlyStopping es("eval_loss", 2, 0.1, train::MonitorMode::Min);
  train::TrainerState s;
  train::TrainerControl c;
  auto eval = [&](double v) {
    train::Metrics m;
    m.set("eval_loss", v);
    es.on_evaluate(s, c, m);
  };
  eval(1.0);
  eval(0.95);  // better, but not by min_delta
  EXPECT_FALSE(c.should_training_stop);
  eval(0.5);  // improvement resets
  EXPECT_EQ(es.wait_count(), 0);
  eval(0.45);
  eval(0.44);
  EXPECT_TRUE(c.should_training_stop);
  EXPECT_THROW(enum_from_name<train::MonitorMode>("sideways", "trainer.early_stopping.mode"),
               ConfigError);
  train::EarlyStopping missing("accuracy", 1, 0, train::MonitorMode::Max);
  train::Metrics m;
  m.set("eval_loss", 1.0);
  EXPECT_THROW(missing.on_evaluate(s, c, m), ConfigError);
}

TEST(Schedule, WarmupThenDecay) {
  config::Config c;
  c.optimizer.lr = 1.0;
  c.schedule.min_lr = 0.1;
  c.schedule.warmup_steps = 4;
  c.trainer.max_steps = 14;
  c.schedule.name = train::LrSchedule::Cosine;
  EXPECT_DOUBLE_EQ(train::scheduled_lr(c, 0), 0.25);
  EXPECT_DOUBLE_EQ(train::scheduled_lr(c, 3), 1.0);
  EXPECT_DOUBLE_EQ(train::scheduled_lr(c, 4), 1.0);
  EXPECT_NEAR(train::scheduled_lr(c, 9), 0.55, 1e-12);
  EXPECT_NEAR(train::scheduled_lr(c, 14), 0.1, 1e-12);
  c.schedule.name = train::LrSchedule::Linear;
  EXPECT_NEAR(train::scheduled_lr(c, 9), 0.55, 1e-12);
  EXPECT_NEAR(train::scheduled_lr(c, 14), 0.1, 1e-12);
  c.schedule.name = train::LrSchedule::Constant;
  EXPECT_DOUBLE_EQ(train::scheduled_lr(c, 13), 1.0);
}

TEST(Trainer, MetricsFileHasOneLinePerStepPlusEvaluations) {
  auto c = mlp_config("metrics");
  c.trainer.max_steps = 4;
  c.trainer.eval_every = 2;
  auto comm = world_of_default_options();
  train::Trainer trainer(c, train::make_task(c, 1), comm);
  trainer.fit();
  const auto lines = read_lines((fs::path(c.run.dir) / "metrics.jsonl").string());
  ASSERT_EQ(lines.size(), 6u);  // 4 steps, evaluations after steps 2 and 4
  for (const char* key : {"\"step\": ", "\"epoch\": ", "\"loss\": ", "\"lr\": ", "\"grad_norm\": ",
                          "\"tokens_per_s\": ", "\"samples_per_s\": ", "\"step_time_s\": ",
                          "\"peak_rss_mb\": ", "\"world_size\": 1", "\"strategy\": \"single\"",
                          "\"precision\": \"fp32\"", "\"lr_group0\": ", "\"peak_rss_mb_ranks\": ["}) {
    EXPECT_NE(lines[0].find(key), std::string::npos) << key << " missing in " << lines[0];
  }
  EXPECT_NE(lines[2].find("\"eval_loss\": "), std::string::npos) << lines[2];
  EXPECT_NE(lines[5].find("\"eval_loss\": "), std::string::npos) << lines[5];
}

// k micro-steps of b samples give the same update as one step of k*b.
TEST(Trainer, AccumulationEqualsOneBigBatch) {
  auto run = [](int64_t micro) {
    auto c = mlp_config("accumulate" + std::to_string(micro));
    c.batch.global = 8;
    c.batch.micro = micro;
    c.trainer.max_steps = 3;
    c.trainer.eval_every = 0;
    c.trainer.max_grad_norm = 0.0;
    auto comm = world_of_default_options();
    train::Trainer trainer(c, train::make_task(c, 1), comm);
    trainer.fit();
    EXPECT_EQ(trainer.batch().accumulate, 8 / micro);
    return trainer.model()->parameters();
  };
  const auto whole = run(8);
  for (int64_t micro : {4, 2, 1}) {
    const auto split = run(micro);
    ASSERT_EQ(whole.size(), split.size());
    for (size_t i = 0; i < whole.size(); ++i) {
      EXPECT_TRUE(torch::allclose(whole[i], split[i], 1e-5, 1e-6)) << "micro " << micro << " param " << i;
    }
  }
}

TEST(Trainer, BadBatchArithmeticIsAConfigError) {
  auto c = mlp_config("badbatch");
  c.batch.global = 10;
  c.batch.micro = 4;
  auto comm = world_of_default_options();
  EXPECT_THROW(train::Trainer(c, train::make_task(c, 1), comm), ConfigError);
}

// ---- exact accumulation and precision through the loop ------------------------------

namespace {

// A linear classifier over 6 features and 3 classes whose targets contain
// padding (kIgnoreIndex), unevenly spread over the global batch: rows 0-3
// have one padded row, rows 4-7 three.
train::TrainTask padded_task(uint64_t seed) {
  torch::manual_seed(seed);
  auto model = std::make_shared<torch::nn::LinearImpl>(6, 3);
  train::TrainTask task;
  task.model = model;
  task.loss_sum = [model](const data::Batch& b) {
    namespace F = torch::nn::functional;
    return F::cross_entropy(model->forward(b.input), b.target,
                            F::CrossEntropyFuncOptions().reduction(torch::kSum).ignore_index(train::kIgnoreIndex));
  };
  task.count_targets = train::count_non_ignored;
  task.train_batch = [](int64_t step, int64_t j, int64_t micro, int rank, int world) {
    auto gen = at::detail::createCPUGenerator(77 + static_cast<uint64_t>(step));
    auto x = torch::randn({8, 6}, c10::optional<at::Generator>(gen));
    auto y = torch::randint(0, 3, {8}, c10::optional<at::Generator>(gen));
    for (int64_t r : {1, 5, 6, 7}) y[r] = train::kIgnoreIndex;
    const int64_t first = (j * world + rank) * micro;
    return data::Batch{x.narrow(0, first, micro), y.narrow(0, first, micro)};
  };
  return task;
}

class GradCapture : public train::Callback {
 public:
  explicit GradCapture(std::shared_ptr<torch::nn::Module> m) : model_(std::move(m)) {}
  std::vector<torch::Tensor> grads;
  void on_pre_optimizer_step(train::TrainerState&, train::TrainerControl&) override {
    grads.clear();
    for (const auto& p : model_->parameters()) grads.push_back(p.grad().clone());
  }

 private:
  std::shared_ptr<torch::nn::Module> model_;
};

}  // namespace

// Padded, uneven micro-batches: the loss is normalised by the targets of the
// whole window, so the accumulated gradient is the big batch's, not an
// average of micro-batch means (which would weight the padded half more).
TEST(Trainer, UnevenPaddedMicroBatchesGiveTheBigBatchGradient) {
  auto run = [](int64_t micro) {
    auto c = mlp_config("padded" + std::to_string(micro));
    c.batch.global = 8;
    c.batch.micro = micro;
    c.trainer.max_steps = 1;
    c.trainer.eval_every = 0;
    c.trainer.max_grad_norm = 0.0;
    auto task = padded_task(5);
    auto capture = std::make_shared<GradCapture>(task.model);
    train::Trainer trainer(c, task, world_of_default_options());
    trainer.add_callback(capture);
    trainer.fit();
    return std::make_pair(capture->grads, trainer.state().loss);
  };
  const auto [whole, whole_loss] = run(8);
  for (int64_t micro : {4, 2}) {
    const auto [split, split_loss] = run(micro);
    ASSERT_EQ(whole.size(), split.size());
    for (size_t i = 0; i < whole.size(); ++i) {
      EXPECT_TRUE(torch::allclose(whole[i], split[i], 1e-6, 1e-7))
          << "micro " << micro << " grad " << i << " differs by "
          << (whole[i] - split[i]).abs().max().item<double>();
    }
    EXPECT_NEAR(whole_loss, split_loss, 1e-6);
  }
}

TEST(Precision, Fp16MixedOnCpuIsAConfigErrorSuggestingBf16) {
  auto c = mlp_config("fp16");
  c.precision = precision::PrecisionKind::Fp16Mixed;
  try {
    train::Trainer trainer(c, train::make_task(c, 1), world_of_default_options());
    if (!torch::cuda::is_available()) FAIL() << "fp16-mixed was accepted without CUDA";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("bf16-mixed"), std::string::npos) << e.what();
  }
}

// bf16-mixed lowers the loss of a small GPT on the bundled corpus about as
// much as fp32 does, and keeps fp32 master weights.
TEST(Precision, Bf16MixedTrainsLikeFp32) {
  auto run = [](const std::string& precision) {
    config::Config c;
    c.run.dir = temp_dir("bf16_" + precision);
    c.model.n_layer = 2;
    c.model.n_head = 2;
    c.model.n_embd = 64;
    c.model.block_size = 32;
    c.data.train = std::string(SHARDTRAIN_SOURCE_DIR) + "/data/corpus.txt";
    c.data.val_fraction = 0.0;
    c.batch.global = 8;
    c.batch.micro = 8;
    c.batch.accumulate.reset();
    c.optimizer.lr = 3e-3;
    c.schedule.warmup_steps = 5;
    c.trainer.max_steps = 40;
    c.trainer.eval_every = 0;
    c.trainer.progress = train::ProgressMode::None;
    c.distributed.strategy(strategy::StrategyKind::Single);
    c.precision = enum_from_name<precision::PrecisionKind>(precision, "precision");
    std::vector<double> losses;
    train::Trainer trainer(c, train::make_task(c, 1), world_of_default_options());
    struct Losses : train::Callback {
      std::vector<double>* out;
      void on_step_end(train::TrainerState& s, train::TrainerControl&) override { out->push_back(s.loss); }
    };
    auto rec = std::make_shared<Losses>();
    rec->out = &losses;
    trainer.add_callback(rec);
    trainer.fit();
    for (const auto& p : trainer.model()->parameters()) EXPECT_EQ(p.scalar_type(), torch::kFloat);
    // Mean of the first and last five steps: single steps are noisy.
    const auto mean = [&](size_t from) {
      double s = 0;
      for (size_t i = from; i < from + 5; ++i) s += losses[i];
      return s / 5;
    };
    return mean(0) - mean(losses.size() - 5);
  };
  const double fp32_drop = run("fp32");
  const double bf16_drop = run("bf16-mixed");
  std::printf("loss drop over 40 steps: fp32 %.4f, bf16-mixed %.4f\n", fp32_drop, bf16_drop);
  EXPECT_GT(fp32_drop, 0.5);
  // Stated margin: bf16-mixed achieves at least 85% of fp32's improvement.
  EXPECT_GT(bf16_drop, 0.85 * fp32_drop);
}

// Checkpoints through the trainer, one process (multi-rank resume is in
// tests/dist/test_trainer_parity.cpp).

TEST(TrainerCheckpoints, CadenceRetentionAndBest) {
  auto c = mlp_config("cadence");
  c.trainer.max_steps = 7;
  c.trainer.eval_every = 1;
  c.checkpoint.every_n_steps = 2;
  c.checkpoint.keep = 2;
  c.checkpoint.monitor = "eval_loss";
  c.checkpoint.mode = train::MonitorMode::Max;  // the worst loss is "best": the first evaluation, step 1
  train::Trainer t(c, train::make_task(c, 1), world_of_default_options());
  t.fit();
  std::vector<int64_t> steps;
  for (const auto& e : checkpoint::list_complete(c.run.dir)) steps.push_back(e.step);
  // The newest two (7 is the end of training, 6 the cadence) and the best (1).
  EXPECT_EQ(steps, (std::vector<int64_t>{7, 6, 1}));
}

TEST(TrainerCheckpoints, EveryNMinutes) {
  auto c = mlp_config("minutes");
  c.trainer.max_steps = 3;
  c.checkpoint.every_n_minutes = 1e-9;  // due after every step
  c.checkpoint.keep = 0;                // keep all
  train::Trainer t(c, train::make_task(c, 1), world_of_default_options());
  t.fit();
  std::vector<int64_t> steps;
  for (const auto& e : checkpoint::list_complete(c.run.dir)) steps.push_back(e.step);
  EXPECT_EQ(steps, (std::vector<int64_t>{3, 2, 1}));
}

TEST(TrainerCheckpoints, ResumeContinuesBitExactly) {
  auto c = mlp_config("exact");
  c.optimizer.name = train::OptimizerKind::AdamW;
  c.trainer.max_steps = 6;
  c.checkpoint.every_n_steps = 3;
  std::vector<double> whole, resumed;
  struct Losses : train::Callback {
    std::vector<double>* out;
    explicit Losses(std::vector<double>* o) : out(o) {}
    void on_step_end(train::TrainerState& s, train::TrainerControl&) override { out->push_back(s.loss); }
  };
  {
    train::Trainer t(c, train::make_task(c, 1), world_of_default_options());
    t.add_callback(std::make_shared<Losses>(&whole));
    t.fit();
  }
  c.checkpoint.resume = checkpoint::checkpoint_dir(c.run.dir, 3);
  c.run.dir = temp_dir("exact_resumed");
  train::Trainer t(c, train::make_task(c, 1), world_of_default_options());
  t.add_callback(std::make_shared<Losses>(&resumed));
  t.fit();
  ASSERT_EQ(whole.size(), 6u);
  ASSERT_EQ(resumed.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(resumed[i], whole[3 + i]) << "step " << 4 + i;
  EXPECT_EQ(t.state().step, 6);
}

TEST(TrainerCheckpoints, ResumeAutoWithoutCheckpointStartsFresh) {
  auto c = mlp_config("fresh");
  c.checkpoint.resume = "auto";
  c.trainer.max_steps = 1;
  train::Trainer t(c, train::make_task(c, 1), world_of_default_options());
  EXPECT_EQ(t.resume("auto"), "");
  t.fit();
  EXPECT_EQ(t.state().step, 1);
}

TEST(TrainerCheckpoints, ResumeFromAnotherModelIsACheckpointError) {
  auto c = mlp_config("other");
  c.trainer.max_steps = 1;
  {
    train::Trainer t(c, train::make_task(c, 1), world_of_default_options());
    t.fit();
  }
  auto other = c;
  other.model.mlp_sizes = {8, 32, 4};
  train::Trainer t(other, train::make_task(other, 1), world_of_default_options());
  try {
    t.resume(checkpoint::checkpoint_dir(c.run.dir, 1));
    FAIL() << "expected a CheckpointError";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("shape"), std::string::npos) << e.what();
  }
}

TEST(TrainerCheckpoints, InitFromSafetensors) {
  auto c = mlp_config("init_from");
  auto task = train::make_task(c, 1);
  std::vector<std::pair<std::string, at::Tensor>> weights;
  for (const auto& p : task.model->named_parameters()) weights.emplace_back(p.key(), p.value().detach() + 1.5);
  const std::string file = temp_dir("init_from_file") + ".safetensors";
  checkpoint::save_safetensors(file, weights);
  c.model.init_from = file;
  train::Trainer t(c, train::make_task(c, 1), world_of_default_options());
  for (const auto& [name, value] : weights) {
    EXPECT_TRUE(torch::equal(t.model()->named_parameters()[name], value)) << name;
  }
  fs::remove(file);
}

// The exported model holds the trained weights whichever way it was made:
// converted from the final checkpoint (fit) or gathered (no checkpoint of
// the current step), with the step in its metadata and the config beside it.
namespace {
void expect_export_matches(const std::string& dir, torch::nn::Module& model, int64_t step) {
  const checkpoint::SafetensorsFile f(checkpoint::exported_model_path(dir));
  EXPECT_EQ(f.metadata().at("step"), std::to_string(step));
  const auto params = model.named_parameters();
  EXPECT_EQ(f.entries().size(), params.size());
  for (const auto& p : params) {
    ASSERT_NE(f.find(p.key()), nullptr) << p.key();
    EXPECT_TRUE(torch::equal(f.read(p.key()), p.value())) << p.key();
  }
  EXPECT_FALSE(shardtrain::testing::temporary_left_beside(checkpoint::exported_model_path(dir)));
}
}  // namespace

TEST(TrainerExport, FitExportsTheFinalModelFromItsCheckpoint) {
  auto c = mlp_config("export_fit");
  c.trainer.max_steps = 3;
  train::Trainer t(c, train::make_task(c, 1), world_of_default_options());
  t.fit();
  expect_export_matches(c.run.dir, *t.model(), 3);
  EXPECT_EQ(config::Config::load(checkpoint::exported_config_path(c.run.dir)).to_yaml(), c.to_yaml());
}

TEST(TrainerExport, WithoutACheckpointTheModelIsGathered) {
  auto c = mlp_config("export_gather");
  train::Trainer t(c, train::make_task(c, 1), world_of_default_options());
  const std::string dir = temp_dir("export_gather_out");
  EXPECT_EQ(t.export_model(dir), checkpoint::exported_model_path(dir));
  expect_export_matches(dir, *t.model(), 0);
  EXPECT_TRUE(fs::exists(checkpoint::exported_config_path(dir)));
  EXPECT_FALSE(fs::exists(checkpoint::checkpoints_root(dir)));  // nothing sharded was written
}

TEST(TrainerExport, AnUnwritableDirectoryIsACheckpointError) {
  auto c = mlp_config("export_bad");
  train::Trainer t(c, train::make_task(c, 1), world_of_default_options());
  const std::string file = temp_dir("export_bad_file");
  std::ofstream(file) << "a file where the directory should be";
  EXPECT_THROW(t.export_model(file), CheckpointError);
}

// A GPT's export has Hugging Face's layout (Conv1D weights as [in, out]) and
// loads back into the same model with transpose_conv1d, both when converted
// from the final checkpoint and when gathered.
TEST(TrainerExport, GptExportHasHuggingFaceLayout) {
  config::Config c;
  c.run.dir = temp_dir("export_gpt");
  c.model.n_layer = 1;
  c.model.n_head = 2;
  c.model.n_embd = 16;
  c.model.block_size = 8;
  c.data.train = std::string(SHARDTRAIN_SOURCE_DIR) + "/data/corpus.txt";
  c.data.val_fraction = 0.0;
  c.batch.global = 4;
  c.batch.micro = 4;
  c.batch.accumulate.reset();
  c.trainer.max_steps = 1;
  c.trainer.eval_every = 0;
  c.trainer.progress = train::ProgressMode::None;
  c.distributed.strategy(strategy::StrategyKind::Single);
  const auto check = [&](const std::string& dir, torch::nn::Module& trained) {
    const std::string file = checkpoint::exported_model_path(dir);
    EXPECT_EQ(checkpoint::SafetensorsFile(file).find("h.0.attn.c_attn.weight")->shape,
              (std::vector<int64_t>{16, 48}));
    models::GPT loaded(train::gpt_config(c.model));
    checkpoint::load_safetensors_into(*loaded, file,
                                      checkpoint::SafetensorsLoadOptions().transpose_conv1d(true));
    for (const auto& p : trained.named_parameters()) {
      EXPECT_TRUE(torch::equal(loaded->named_parameters()[p.key()], p.value())) << p.key();
    }
  };
  train::Trainer t(c, train::make_task(c, 1), world_of_default_options());
  t.fit();
  check(c.run.dir, *t.model());
  train::Trainer fresh(c, train::make_task(c, 1), world_of_default_options());
  const std::string gathered = temp_dir("export_gpt_gathered");
  fresh.export_model(gathered);
  check(gathered, *fresh.model());
}


// ---- what the loop applies, seen from outside ---------------------------------------------
// Expected values here come from the test itself (numbers worked out by hand,
// scores it chooses), never from the trainer or the schedule function: a bug
// in the trainer would otherwise sit on both sides of the comparison.

namespace {

// After each optimizer step: the learning rate of every parameter group as
// the optimizer holds it, and the one the update actually used. Plain SGD
// (no momentum, no weight decay, no clipping) moves p by -lr * grad, so the
// applied rate is the least-squares fit of (before - after) against grad.
class AppliedLr : public train::Callback {
 public:
  explicit AppliedLr(train::Trainer& t) : trainer_(t) {}
  std::vector<std::vector<double>> group_lrs;  // per step, per group
  std::vector<double> applied;                 // per step
  void on_pre_optimizer_step(train::TrainerState&, train::TrainerControl&) override {
    before_.clear();
    grads_.clear();
    for (const auto& p : trainer_.model()->parameters()) {
      before_.push_back(p.detach().clone().to(torch::kDouble));
      grads_.push_back(p.grad().detach().clone().to(torch::kDouble));
    }
  }
  void on_optimizer_step(train::TrainerState&, train::TrainerControl&) override {
    std::vector<double> lrs;
    for (auto& g : trainer_.optimizer().param_groups()) lrs.push_back(g.options().get_lr());
    group_lrs.push_back(lrs);
    double num = 0, den = 0;
    const auto params = trainer_.model()->parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      const auto moved = before_[i] - params[i].detach().to(torch::kDouble);
      num += (moved * grads_[i]).sum().item<double>();
      den += (grads_[i] * grads_[i]).sum().item<double>();
    }
    applied.push_back(den > 0 ? num / den : std::numeric_limits<double>::quiet_NaN());
  }

 private:
  train::Trainer& trainer_;
  std::vector<torch::Tensor> before_, grads_;
};

}  // namespace

// Warm-up over 4 steps to lr 0.1, then linear decay to min_lr 0.01 at step 8
// (docs: "linear warmup over warmup_steps to lr, then ... linear decay to
// min_lr at max_steps"). Step s (0-based) of the warm-up uses 0.1 (s+1)/4;
// decay step s uses 0.1 - 0.09 (s-4)/4. Worked out by hand:
TEST(TrainerLr, TheRateAppliedAtEachStepIsTheScheduledOne) {
  const std::vector<double> want = {0.025, 0.05, 0.075, 0.1, 0.1, 0.0775, 0.055, 0.0325};
  auto c = mlp_config("applied_lr");
  c.optimizer.lr = 0.1;
  c.optimizer.momentum = 0.0;
  c.schedule.name = train::LrSchedule::Linear;
  c.schedule.warmup_steps = 4;
  c.schedule.min_lr = 0.01;
  c.trainer.max_steps = 8;
  c.trainer.eval_every = 0;
  c.trainer.max_grad_norm = 0.0;
  train::Trainer trainer(c, train::make_task(c, 1), world_of_default_options());
  auto seen = std::make_shared<AppliedLr>(trainer);
  trainer.add_callback(seen);
  trainer.fit();
  ASSERT_EQ(seen->applied.size(), want.size());
  for (size_t s = 0; s < want.size(); ++s) {
    ASSERT_EQ(seen->group_lrs[s].size(), 2u) << "weights and biases are two groups";
    for (double lr : seen->group_lrs[s]) EXPECT_NEAR(lr, want[s], 1e-12) << "step " << s;
    // fp32 parameters: the fit is good to about 1e-6 relative.
    EXPECT_NEAR(seen->applied[s], want[s], 1e-4 * want[s]) << "step " << s;
  }
}

namespace {

// A model whose dropout the test can watch: every input element is 1 (2 in
// evaluation batches), so after dropout an element is 0 exactly when dropout
// dropped it.
struct WatchedDropoutImpl : torch::nn::Module {
  WatchedDropoutImpl() {
    drop = register_module("drop", torch::nn::Dropout(0.5));
    fc = register_module("fc", torch::nn::Linear(64, 2));
  }
  torch::nn::Dropout drop{nullptr};
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(WatchedDropout);

struct DropoutCall {
  bool eval_batch;  // input was an evaluation batch
  bool dropped;     // some element was zeroed
};

train::TrainTask watched_dropout_task(std::vector<DropoutCall>* calls) {
  torch::manual_seed(3);
  WatchedDropout model;
  train::TrainTask task;
  task.model = model.ptr();
  task.loss_sum = [model, calls](const data::Batch& b) mutable {
    const at::Tensor h = model->drop->forward(b.input);
    const bool eval_batch = b.input[0][0].item().toFloat() == 2.0f;
    calls->push_back({eval_batch, (h == 0).any().item().toBool()});
    return (model->fc->forward(h) - b.target).pow(2).sum();
  };
  task.count_targets = [](const data::Batch& b) { return b.target.size(0); };
  task.train_batch = [](int64_t, int64_t, int64_t micro, int, int) {
    return data::Batch{torch::ones({micro, 64}), torch::zeros({micro, 2})};
  };
  task.eval_batch = [](int64_t, int64_t micro, int, int) {
    return data::Batch{torch::full({micro, 64}, 2.0), torch::zeros({micro, 2})};
  };
  return task;
}

}  // namespace

// Dropout is on in every training step, also after an evaluation, and off
// during evaluation. (Dropout 0.5 leaves 4 x 64 elements all standing with
// probability 2^-256.)
TEST(TrainerModes, DropoutTrainsAfterEvaluationAndIsOffDuringIt) {
  auto c = mlp_config("dropout_modes");
  c.batch.global = 4;
  c.batch.micro = 4;
  c.trainer.max_steps = 4;
  c.trainer.eval_every = 1;
  c.trainer.eval_batches = 2;
  std::vector<DropoutCall> calls;
  train::Trainer trainer(c, watched_dropout_task(&calls), world_of_default_options());
  trainer.fit();
  // Per step: one training forward, then two evaluation forwards.
  ASSERT_EQ(calls.size(), 12u);
  for (size_t i = 0; i < calls.size(); ++i) {
    const bool want_eval = i % 3 != 0;
    ASSERT_EQ(calls[i].eval_batch, want_eval) << "call " << i;
    if (want_eval) {
      EXPECT_FALSE(calls[i].dropped) << "dropout ran in evaluation, call " << i;
    } else {
      EXPECT_TRUE(calls[i].dropped) << "training step " << i / 3 + 1 << " ran without dropout";
    }
  }
  EXPECT_TRUE(trainer.model()->is_training());
}

namespace {

// Scores the test gives each step's evaluation ("score", mode max): the best
// is step 2, before the restart; every later one is worse than it but better
// than the one before, so a trainer that forgot the best would take step 4.
const std::map<int64_t, double> kScores = {{1, 0.5}, {2, 0.9}, {3, 0.3},
                                           {4, 0.6}, {5, 0.7}, {6, 0.4}};

class ScoreEvaluations : public train::Callback {
 public:
  std::vector<int64_t> evaluated;
  void on_evaluate(train::TrainerState& s, train::TrainerControl&, const train::Metrics&) override {
    evaluated.push_back(s.step);
    s.eval_metrics.set("score", kScores.at(s.step));
  }
};

std::vector<int64_t> complete_steps(const std::string& run_dir) {
  std::vector<int64_t> steps;
  for (const auto& e : checkpoint::list_complete(run_dir)) steps.push_back(e.step);
  return steps;
}

}  // namespace

// checkpoint.monitor with keep 1: a run stopped after step 3 keeps step 3
// (newest) and step 2 (best). Resumed to step 6, it must still know step 2
// is best: never prune it, and record it as best in later checkpoints.
TEST(TrainerCheckpoints, AResumedRunKeepsTheBestCheckpointOfBeforeTheRestart) {
  auto c = mlp_config("monitor_resume");
  c.trainer.max_steps = 3;
  c.trainer.eval_every = 1;
  c.checkpoint.every_n_steps = 1;
  c.checkpoint.keep = 1;
  c.checkpoint.monitor = "score";
  c.checkpoint.mode = train::MonitorMode::Max;
  {
    train::Trainer first(c, train::make_task(c, 1), world_of_default_options());
    auto scores = std::make_shared<ScoreEvaluations>();
    first.add_callback(scores);
    first.fit();
    EXPECT_EQ(scores->evaluated, (std::vector<int64_t>{1, 2, 3}));
  }
  ASSERT_EQ(complete_steps(c.run.dir), (std::vector<int64_t>{3, 2}));
  c.trainer.max_steps = 6;
  c.checkpoint.resume = "auto";
  train::Trainer resumed(c, train::make_task(c, 1), world_of_default_options());
  auto scores = std::make_shared<ScoreEvaluations>();
  resumed.add_callback(scores);
  resumed.fit();
  EXPECT_EQ(scores->evaluated, (std::vector<int64_t>{4, 5, 6}));
  EXPECT_EQ(complete_steps(c.run.dir), (std::vector<int64_t>{6, 2}));
  checkpoint::CheckpointReader last(checkpoint::checkpoint_dir(c.run.dir, 6));
  const auto state = nlohmann::json::parse(last.train_state());
  ASSERT_TRUE(state.contains("best")) << state.dump();
  EXPECT_EQ(state["best"]["step"], 2) << state.dump();
  EXPECT_EQ(state["best"]["value"], 0.9) << state.dump();
  EXPECT_EQ(state["best"]["monitor"], "score") << state.dump();
}
