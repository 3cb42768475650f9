// One name for each place in a run directory: resolve_checkpoint (run
// directory -> newest complete checkpoint, or the exported model for
// generate; a typed error for anything else), and `shardtrain generate` and
// `shardtrain checkpoint consolidate` given a run directory.
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "checkpoint/detail.h"
#include "shardtrain/checkpoint/checkpoint.h"
#include "shardtrain/checkpoint/safetensors.h"
#include "shardtrain/comm/communicator.h"
#include "shardtrain/config/config.h"
#include "shardtrain/core/error.h"
#include "shardtrain/models/gpt.h"
#include "shardtrain/train/task.h"
#include "shardtrain/train/trainer.h"
#include "temp_dir.h"
#include "test_helpers.h"
#include "train/run_dir.h"

using shardtrain::testing::cli;
using shardtrain::testing::CliRun;
using shardtrain::testing::checkpoint_error;

namespace {

namespace fs = std::filesystem;
namespace ck = shardtrain::checkpoint;
namespace cd = shardtrain::checkpoint::detail;
using shardtrain::CheckpointError;
using Kind = ck::ResolvedCheckpoint::Kind;
using shardtrain::models::GPT;
using shardtrain::strategy::ShardedTensor;

struct RunTempDir : shardtrain::testing::TempDir {
  RunTempDir() : shardtrain::testing::TempDir("shardtrain_rundir") {}
};

// A GPT small enough to sample from in a moment; byte vocabulary.
shardtrain::config::Config tiny_gpt_config() {
  shardtrain::config::Config c;
  c.model.type = shardtrain::train::ModelType::Gpt;
  c.model.n_layer = 1;
  c.model.n_head = 2;
  c.model.n_embd = 8;
  c.model.block_size = 8;
  c.model.vocab_size = 256;
  return c;
}

std::vector<std::pair<std::string, at::Tensor>> parameters_and_buffers(torch::nn::Module& m) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& p : m.named_parameters()) out.emplace_back(p.key(), p.value().detach());
  for (const auto& b : m.named_buffers()) out.emplace_back(b.key(), b.value().detach());
  return out;
}

// Saves `tensors` as the sharded checkpoint of `step` in `run`, split over
// two simulated ranks, with a training state that records `config` as the
// Trainer's does.
std::string save_step(const std::string& run, int64_t step,
                      const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                      const shardtrain::config::Config& config = tiny_gpt_config()) {
  const int world = 2;
  std::vector<std::vector<ShardedTensor>> per_rank(world);
  for (const auto& [name, t] : tensors) {
    for (int r = 0; r < world; ++r) {
      const auto range = shardtrain::comm::shard_range(t.numel(), world, r);
      ShardedTensor s;
      s.name = name;
      s.global_shape = t.sizes().vec();
      s.offset = range.offset;
      s.local = t.reshape({-1}).narrow(0, range.offset, range.count).clone();
      per_rank[r].push_back(s);
    }
  }
  const nlohmann::json state = {{"format", 1}, {"step", step}, {"config", config.to_yaml()}};
  return cd::save_ranks_locally(ck::checkpoint_dir(run, step), per_rank, state.dump(), {},
                                ck::SaveOptions().strategy("fsdp/full_shard").step(step));
}

// A checkpoint of `step` whose save never finished: everything but COMMITTED.
std::string save_torn_step(const std::string& run, int64_t step,
                           const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
  const std::string dir = save_step(run, step, tensors);
  fs::remove(fs::path(dir) / cd::kCommitFile);
  return dir;
}

// What Trainer::export_model writes: model.safetensors (HF names, Conv1D
// transposed, step in the metadata) and config.yaml beside it.
void export_model(const std::string& run, int64_t step,
                  const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
  fs::create_directories(run);
  ck::save_safetensors(ck::exported_model_path(run), tensors, /*transpose_conv1d=*/true,
                       {{"format", "pt"}, {"step", std::to_string(step)}});
  std::ofstream(ck::exported_config_path(run)) << tiny_gpt_config().to_yaml();
}

std::vector<std::pair<std::string, at::Tensor>> small_tensors() {
  return {{"w", torch::arange(10, torch::kFloat).view({2, 5})}, {"b", torch::ones({3})}};
}


bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// ---- resolve_checkpoint --------------------------------------------------------------

TEST(ResolveCheckpoint, RunDirectoryMeansItsNewestCompleteStep) {
  RunTempDir tmp;
  const std::string run = tmp / "run";
  save_step(run, 10, small_tensors());
  const std::string newest = save_step(run, 20, small_tensors());
  const auto r = ck::resolve_checkpoint(run);
  EXPECT_EQ(r.kind, Kind::Checkpoint);
  EXPECT_EQ(r.path, newest);
  EXPECT_EQ(r.step, 20);
}

TEST(ResolveCheckpoint, IncompleteStepsAreSkipped) {
  RunTempDir tmp;
  const std::string run = tmp / "run";
  const std::string complete = save_step(run, 10, small_tensors());
  save_torn_step(run, 30, small_tensors());
  fs::create_directories(ck::checkpoint_dir(run, 40) + ".tmp");  // a save in progress
  EXPECT_EQ(ck::resolve_checkpoint(run).path, complete);
  EXPECT_EQ(ck::resolve_checkpoint(run).step, 10);
}

TEST(ResolveCheckpoint, AStepDirectoryIsItself) {
  RunTempDir tmp;
  const std::string run = tmp / "run";
  const std::string older = save_step(run, 10, small_tensors());
  save_step(run, 20, small_tensors());
  const auto r = ck::resolve_checkpoint(older);
  EXPECT_EQ(r.kind, Kind::Checkpoint);
  EXPECT_EQ(r.path, older);
  EXPECT_EQ(r.step, 10);
}

TEST(ResolveCheckpoint, BadPathsAreCheckpointErrorsSayingWhatWasExpected) {
  RunTempDir tmp;
  const std::string run = tmp / "run";
  const std::string torn = save_torn_step(run, 30, small_tensors());

  std::string e = checkpoint_error([&] { ck::resolve_checkpoint(tmp / "nowhere"); });
  EXPECT_TRUE(contains(e, "does not exist")) << e;
  EXPECT_TRUE(contains(e, "Expected a checkpoint directory")) << e;

  e = checkpoint_error([&] { ck::resolve_checkpoint(torn); });
  EXPECT_TRUE(contains(e, "incomplete checkpoint")) << e;
  EXPECT_TRUE(contains(e, "COMMITTED")) << e;

  // A run directory whose only checkpoint is torn holds nothing to read.
  e = checkpoint_error([&] { ck::resolve_checkpoint(run); });
  EXPECT_TRUE(contains(e, "holds no complete checkpoint")) << e;
  EXPECT_TRUE(contains(e, ck::checkpoints_root(run))) << e;

  fs::create_directories(tmp / "empty");
  e = checkpoint_error([&] { ck::resolve_checkpoint(tmp / "empty"); });
  EXPECT_TRUE(contains(e, "holds no complete checkpoint")) << e;
  EXPECT_TRUE(contains(e, "Expected a checkpoint directory")) << e;

  std::ofstream(tmp / "notes.txt") << "hello";
  e = checkpoint_error([&] { ck::resolve_checkpoint(tmp / "notes.txt"); });
  EXPECT_TRUE(contains(e, "is a file")) << e;
  e = checkpoint_error(
      [&] { ck::resolve_checkpoint(tmp / "notes.txt", ck::ResolveOptions().exported_model(true)); });
  EXPECT_TRUE(contains(e, "is a file")) << e;
  EXPECT_TRUE(contains(e, ".safetensors")) << e;  // names what generate also takes
}

TEST(ResolveCheckpoint, TheExportedModelWhenAskedForAndNotOlder) {
  RunTempDir tmp;
  const std::string run = tmp / "run";
  const auto with_export = ck::ResolveOptions().exported_model(true);
  export_model(run, 20, small_tensors());

  // Only the export: it for generate; consolidate wants a checkpoint.
  auto r = ck::resolve_checkpoint(run, with_export);
  EXPECT_EQ(r.kind, Kind::ExportedModel);
  EXPECT_EQ(r.path, ck::exported_model_path(run));
  EXPECT_EQ(r.step, 20);
  const std::string e = checkpoint_error([&] { ck::resolve_checkpoint(run); });
  EXPECT_TRUE(contains(e, "holds no complete checkpoint")) << e;

  // A checkpoint of the same step: the export still wins (nothing to reshard).
  const std::string at20 = save_step(run, 20, small_tensors());
  EXPECT_EQ(ck::resolve_checkpoint(run, with_export).kind, Kind::ExportedModel);
  EXPECT_EQ(ck::resolve_checkpoint(run).path, at20);

  // A newer checkpoint (a resumed run stopped by a signal): the checkpoint.
  const std::string at30 = save_step(run, 30, small_tensors());
  r = ck::resolve_checkpoint(run, with_export);
  EXPECT_EQ(r.kind, Kind::Checkpoint);
  EXPECT_EQ(r.path, at30);

  // The file named directly.
  r = ck::resolve_checkpoint(ck::exported_model_path(run), with_export);
  EXPECT_EQ(r.kind, Kind::ExportedModel);
  EXPECT_EQ(r.step, 20);
}

// ---- the commands -----------------------------------------------------------------------


// The sampled text of a `generate` run, without its note on stderr.
std::string sample_of(const CliRun& r) {
  const std::string note = "generate: model from ";
  EXPECT_EQ(r.out.rfind(note, 0), 0u) << r.out;
  const size_t eol = r.out.find('\n');
  return eol == std::string::npos ? "" : r.out.substr(eol + 1);
}

TEST(RunDirectoryCommands, GenerateReadsTheNewestModelOfARunDirectory) {
  RunTempDir tmp;
  const std::string run = tmp / "run";
  const auto gpt = shardtrain::train::gpt_config(tiny_gpt_config().model);
  torch::manual_seed(1);
  GPT first(gpt);
  torch::manual_seed(2);
  GPT second(gpt);
  const std::string args = " --prompt 'The ' --max-new-tokens 12 --seed 3";

  save_step(run, 1, parameters_and_buffers(*first));
  const std::string step2 = save_step(run, 2, parameters_and_buffers(*second));
  CliRun from_step = cli("generate --checkpoint " + step2 + args);
  ASSERT_EQ(from_step.code, 0) << from_step.out;
  EXPECT_TRUE(contains(from_step.out, "model from " + step2 + " (step 2)")) << from_step.out;
  EXPECT_EQ(sample_of(from_step).rfind("The ", 0), 0u) << from_step.out;

  // A run directory without an export: its newest complete checkpoint.
  CliRun from_run = cli("generate --checkpoint " + run + args);
  ASSERT_EQ(from_run.code, 0) << from_run.out;
  EXPECT_TRUE(contains(from_run.out, "model from " + step2)) << from_run.out;
  EXPECT_EQ(sample_of(from_run), sample_of(from_step));

  // With the exported model of the same step: the export, and the same text
  // (its Conv1D weights went out transposed and came back).
  export_model(run, 2, parameters_and_buffers(*second));
  from_run = cli("generate --checkpoint " + run + args);
  ASSERT_EQ(from_run.code, 0) << from_run.out;
  EXPECT_TRUE(contains(from_run.out, "model from " + ck::exported_model_path(run))) << from_run.out;
  EXPECT_EQ(sample_of(from_run), sample_of(from_step));

  // Other weights give other text: the comparisons above can fail.
  CliRun from_first = cli("generate --checkpoint " + ck::checkpoint_dir(run, 1) + args);
  ASSERT_EQ(from_first.code, 0) << from_first.out;
  EXPECT_NE(sample_of(from_first), sample_of(from_step));
}

TEST(RunDirectoryCommands, ConsolidateTakesARunDirectory) {
  RunTempDir tmp;
  const std::string run = tmp / "run";
  const auto gpt = shardtrain::train::gpt_config(tiny_gpt_config().model);
  torch::manual_seed(4);
  GPT older(gpt);
  torch::manual_seed(5);
  GPT newer(gpt);
  save_step(run, 1, parameters_and_buffers(*older));
  const std::string step2 = save_step(run, 2, parameters_and_buffers(*newer));
  save_torn_step(run, 3, parameters_and_buffers(*older));

  const CliRun r = cli("checkpoint consolidate " + run + " --out " + (tmp / "out.safetensors"));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(contains(r.out, "using the newest complete checkpoint of run directory")) << r.out;
  EXPECT_TRUE(contains(r.out, step2)) << r.out;
  GPT loaded(gpt);
  ck::load_safetensors_into(*loaded, tmp / "out.safetensors",
                            ck::SafetensorsLoadOptions().transpose_conv1d(true));
  for (const auto& p : newer->named_parameters()) {
    EXPECT_TRUE(torch::equal(loaded->named_parameters()[p.key()], p.value())) << p.key();
  }
}

TEST(RunDirectoryCommands, BadPathsExitWithTheCheckpointErrorCode) {
  RunTempDir tmp;
  const std::string run = tmp / "run";
  const std::string torn = save_torn_step(run, 3, small_tensors());
  fs::create_directories(tmp / "empty");
  struct Case {
    std::string args, want;
  };
  for (const Case& c : std::vector<Case>{
           {"generate --checkpoint " + (tmp / "nowhere"), "does not exist"},
           {"generate --checkpoint " + torn, "incomplete checkpoint"},
           {"generate --checkpoint " + (tmp / "empty"), "holds no complete checkpoint"},
           {"checkpoint consolidate " + (tmp / "nowhere") + " --out " + (tmp / "x.safetensors"),
            "does not exist"},
           {"checkpoint consolidate " + run + " --out " + (tmp / "x.safetensors"),
            "holds no complete checkpoint"},
           {"checkpoint consolidate " + torn + " --out " + (tmp / "x.safetensors"),
            "incomplete checkpoint"}}) {
    const CliRun r = cli(c.args);
    EXPECT_EQ(r.code, 3) << c.args << "\n" << r.out;
    EXPECT_TRUE(contains(r.out, "checkpoint error: ")) << c.args << "\n" << r.out;
    EXPECT_TRUE(contains(r.out, c.want)) << c.args << "\n" << r.out;
    EXPECT_TRUE(contains(r.out, "Expected") || contains(r.out, "Hint")) << c.args << "\n" << r.out;
  }
  EXPECT_FALSE(fs::exists(tmp / "x.safetensors"));

  // A checkpoint the Trainer did not write records no config: generate says so.
  std::vector<std::vector<ShardedTensor>> one_rank(1);
  ShardedTensor w;
  w.name = "w";
  w.global_shape = {3};
  w.local = torch::ones({3});
  one_rank[0].push_back(w);
  const std::string bare = cd::save_ranks_locally(ck::checkpoint_dir(tmp / "bare", 1), one_rank,
                                                  "opaque", {}, ck::SaveOptions().step(1));
  const CliRun r = cli("generate --checkpoint " + bare);
  EXPECT_EQ(r.code, 3) << r.out;
  EXPECT_TRUE(contains(r.out, "records no config")) << r.out;
}

}  // namespace

// ---- one job per run directory, and only in shardtrain's own ---------------------------

namespace {

namespace td = shardtrain::train::detail;

// A one-step MLP job: no data files, a fraction of a second.
shardtrain::config::Config mlp_job(const std::string& run) {
  shardtrain::config::Config c;
  c.run.dir = run;
  c.model.type = shardtrain::train::ModelType::Mlp;
  c.model.mlp_sizes = {4, 8, 2};
  c.batch.global = 4;
  c.batch.micro = 4;
  c.batch.accumulate.reset();
  c.trainer.max_steps = 1;
  c.trainer.eval_every = 0;
  c.trainer.progress = shardtrain::train::ProgressMode::None;
  return c;
}

void fit(const shardtrain::config::Config& c) {
  auto comm = shardtrain::comm::Communicator::create(shardtrain::comm::CommOptions().rank(0).world_size(1));
  shardtrain::train::Trainer t(c, shardtrain::train::make_task(c, 1), comm);
  t.fit();
}

std::string fit_error(const shardtrain::config::Config& c) {
  try {
    fit(c);
  } catch (const shardtrain::ConfigError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no ConfigError for run.dir " << c.run.dir;
  return "";
}

}  // namespace

// A second job on a run directory in use is refused with the first one's host
// and PID, before it touches a file (issue 28, item 7).
TEST(RunDirectoryLock, ASecondJobIsRefusedNamingTheFirst) {
  RunTempDir tmp;
  const std::string run = tmp / "run";
  fit(mlp_job(run));  // ours now, and free again
  ASSERT_TRUE(fs::exists(fs::path(run) / td::kRunLockFile));
  // Another job holds it (another process: its own open file description).
  const int fd = ::open((fs::path(run) / td::kRunLockFile).c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX | LOCK_NB), 0);
  ASSERT_EQ(::ftruncate(fd, 0), 0);
  const std::string holder = "host node7, pid 4242, since 2026-01-01T00:00:00Z\n";
  ASSERT_EQ(::pwrite(fd, holder.data(), holder.size(), 0), static_cast<ssize_t>(holder.size()));
  const auto metrics_before = fs::file_size(fs::path(run) / "metrics.jsonl");
  auto resumed = mlp_job(run);
  resumed.checkpoint.resume = "auto";
  resumed.trainer.max_steps = 2;
  const std::string msg = fit_error(resumed);
  EXPECT_NE(msg.find("is in use by another job (host node7, pid 4242"), std::string::npos) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  EXPECT_EQ(fs::file_size(fs::path(run) / "metrics.jsonl"), metrics_before);
  // The same through the command line: exit 2, one line.
  const auto cli_run = cli("train --set run.dir=" + run + " --set distributed.strategy=single");
  EXPECT_EQ(cli_run.code, 2) << cli_run.out;
  EXPECT_NE(cli_run.out.find("host node7, pid 4242"), std::string::npos) << cli_run.out;
  ::close(fd);  // the other job ends
  fit(resumed);
}

// A job that crashes leaves no stale lock: the kernel drops it with the
// process (issue 28, item 7).
TEST(RunDirectoryLock, ACrashedHolderLeavesNoStaleLock) {
  RunTempDir tmp;
  const std::string run = tmp / "run";
  {
    const auto first = td::RunDirLock::acquire(run, false);
    try {
      td::RunDirLock::acquire(run, false);
      ADD_FAILURE() << "two holders of one run directory";
    } catch (const shardtrain::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("pid " + std::to_string(::getpid())), std::string::npos) << e.what();
    }
  }
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    try {
      const auto held = td::RunDirLock::acquire(run, false);
      ::kill(::getpid(), SIGKILL);
    } catch (...) {
    }
    ::_exit(3);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFSIGNALED(status)) << "the child could not take the lock";
  EXPECT_NO_THROW(td::RunDirLock::acquire(run, false));
  EXPECT_EQ(std::getenv(td::kRunLockEnv), nullptr) << "the released lock is still advertised";
}

// A directory with someone else's files is refused, untouched, unless the
// job resumes or run.overwrite says so (issue 28, item 8).
TEST(RunDirectoryLock, SomeoneElsesDirectoryIsRefusedUntouched) {
  RunTempDir tmp;
  const std::string run = tmp / "theirs";
  fs::create_directories(fs::path(run) / "checkpoints/step-000001");
  std::ofstream(fs::path(run) / "checkpoints/step-000001/weights.bin") << "their weights";
  std::ofstream(fs::path(run) / "config.yaml") << "their config\n";
  std::ofstream(fs::path(run) / "report.html") << "their report\n";
  const std::string msg = fit_error(mlp_job(run));
  EXPECT_NE(msg.find("already holds files shardtrain did not write there"), std::string::npos) << msg;
  EXPECT_NE(msg.find("run.overwrite: true"), std::string::npos) << msg;
  EXPECT_TRUE(fs::exists(fs::path(run) / "checkpoints/step-000001/weights.bin"));
  std::ifstream in(fs::path(run) / "config.yaml");
  std::string line;
  std::getline(in, line);
  EXPECT_EQ(line, "their config");
  EXPECT_FALSE(fs::exists(fs::path(run) / "metrics.jsonl"));
  EXPECT_FALSE(fs::exists(fs::path(run) / td::kRunLockFile));
  // An empty directory is fine, and so is one shardtrain wrote (to the
  // Trainer: `shardtrain train` asks first, see below).
  fs::create_directories(tmp / "empty");
  fit(mlp_job(tmp / "empty"));
  fit(mlp_job(tmp / "empty"));
  // Asked to, it writes there.
  auto c = mlp_job(run);
  c.run.overwrite = true;
  fit(c);
  EXPECT_TRUE(fs::exists(fs::path(run) / "metrics.jsonl"));
  EXPECT_EQ(shardtrain::config::Config::parse("run: {overwrite: true}\n", {}, "t.yaml").run.overwrite, true);
}

// A run directory a run of ours already trained in is not trained over from
// scratch by the next `shardtrain train`: without checkpoint.resume or
// run.overwrite it is refused, exit 2, its metrics untouched; with either
// the job goes on (issue 47, item 8). The launcher's restart rounds are one
// job: they never ask. (A tiny job, so that a regression ends in seconds.)
TEST(RunDirectoryLock, AFinishedRunIsNotTrainedOverSilently) {
  RunTempDir tmp;
  const std::string run = tmp / "run";
  const std::string job = "train --set run.dir=" + run + " --set distributed.strategy=single --set trainer.max_steps=1 "
                          "--set model.n_layer=1 --set model.n_head=2 --set model.n_embd=16 --set model.block_size=8 "
                          "--set batch.global=2 --set batch.micro=2 --set trainer.eval_every=0 "
                          "--set trainer.sample_tokens=0 --set data.val_fraction=0 --set checkpoint.every_n_steps=1 "
                          "--set data.train=" SHARDTRAIN_SOURCE_DIR "/data/corpus.txt";
  auto r = cli(job);
  ASSERT_EQ(r.code, 0) << r.out;
  const auto metrics_before = fs::file_size(fs::path(run) / "metrics.jsonl");
  r = cli(job);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("holds a previous run (metrics.jsonl, checkpoints/)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("checkpoint.resume: auto"), std::string::npos) << r.out;
  EXPECT_EQ(fs::file_size(fs::path(run) / "metrics.jsonl"), metrics_before);
  r = cli(job + " --set checkpoint.resume=auto --set trainer.max_steps=2");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_GT(fs::file_size(fs::path(run) / "metrics.jsonl"), metrics_before);
  r = cli(job + " --set run.overwrite=true");
  EXPECT_EQ(r.code, 0) << r.out;
}
