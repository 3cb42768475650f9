// Trainer::fit: the training loop, written to read like the algorithm.
//
// A TrainTask says what to train (any torch::nn::Module), how to get a
// micro-batch and how to score it; the Config says how (batch sizes,
// optimizer, schedule, strategy, steps). make_task() builds the task for the
// built-in models from the config.
#pragma once

#include <signal.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "shardtrain/config/config.h"
#include "shardtrain/data/tokens.h"
#include "shardtrain/train/callback.h"

namespace torch::nn {
class Module;
}
namespace torch::optim {
class Optimizer;
}
namespace shardtrain::comm {
class Communicator;
}
namespace shardtrain::strategy {
class Strategy;
struct StrategyOptions;
struct EstimateInput;
}
namespace shardtrain::precision {
class Precision;
}
namespace shardtrain::models {
struct GPTConfig;
}

namespace shardtrain::train {

struct TrainTask {
  /// The model; its parameters are trained in place.
  std::shared_ptr<torch::nn::Module> model;
  /// Summed loss over the targets of one micro-batch (a scalar with a
  /// graph), e.g. cross entropy with reduction sum and an ignore index.
  std::function<at::Tensor(const data::Batch&)> loss_sum;
  /// Targets that loss_sum sums over (tokens not equal to the ignore index).
  /// The trainer divides by the count over the whole accumulation window on
  /// all ranks, so uneven or padded micro-batches give the big-batch gradient.
  std::function<int64_t(const data::Batch&)> count_targets;
  /// Micro-batch `micro_step` of optimizer step `step` for `rank` of `world`.
  /// The union over micro-steps and ranks must be the step's global batch.
  std::function<data::Batch(int64_t step, int64_t micro_step, int64_t micro_batch, int rank,
                            int world)>
      train_batch;
  /// Evaluation micro-batch `index` for `rank`; empty: no evaluation.
  std::function<data::Batch(int64_t index, int64_t micro_batch, int rank, int world)> eval_batch;
  /// Epoch of a step; empty: always epoch 0.
  std::function<int64_t(int64_t step)> epoch_of;
  /// Tokens in one sample, for tokens/s (block_size for language models).
  int64_t tokens_per_sample = 1;
  /// Extra fields of every metrics line (e.g. the model's parameter count).
  Metrics static_metrics;
};

/// The GPT described by the config's model section.
models::GPTConfig gpt_config(const config::ModelConfig& model);

/// The task for the config's built-in model: a GPT on the config's token data
/// (train/validation split by data.val_fraction) or an MLP on a synthetic
/// regression set. The same seed gives the same initial weights on every rank;
/// `world_size` fixes the batch plan the data order is built for.
TrainTask make_task(const config::Config& config, int world_size);

/// The memory estimator's input (strategy/estimate.h) for `model` trained
/// as the config says at `world_size` ranks, `local_world_size` per node.
strategy::EstimateInput estimate_input(const config::Config& config, torch::nn::Module& model,
                                       int world_size, int local_world_size);

/// The strategy options the config's distributed section asks for; strategy
/// "auto" becomes the one choose_strategy() picks for the memory budget
/// (distributed.memory_budget_mb, or MemAvailable / local ranks).
strategy::StrategyOptions strategy_options(const config::Config& config, torch::nn::Module& model,
                                           int world_size, int local_world_size);

/// Target id the built-in losses skip (padding), as in PyTorch.
constexpr int64_t kIgnoreIndex = -100;

/// Counts the targets of a batch that are not kIgnoreIndex.
int64_t count_non_ignored(const data::Batch& batch);

/// Learning rate of `step` (0-based): linear warmup over warmup_steps to lr,
/// then constant, linear decay to min_lr at max_steps, or cosine to min_lr.
double scheduled_lr(const config::Config& config, int64_t step);

/// Installs SIGTERM/SIGINT handlers that only record the signal (when
/// enabled) and restores the previous handlers when destroyed.
class SignalGuard {
 public:
  explicit SignalGuard(bool enabled);
  ~SignalGuard();
  SignalGuard(const SignalGuard&) = delete;
  SignalGuard& operator=(const SignalGuard&) = delete;
  /// The signal received since construction, or 0.
  static int received();

 private:
  bool enabled_;
  struct sigaction previous_term_ {};
  struct sigaction previous_int_ {};
};

class Trainer {
 public:
  /// `comm` is the world (Communicator::create). Builds the precision plugin
  /// and the strategy and sets them up (DDP broadcasts rank 0's weights),
  /// then the optimizer.
  /// Throws ConfigError for batch sizes that do not fit the world size.
  Trainer(config::Config config, TrainTask task, std::shared_ptr<comm::Communicator> comm);
  ~Trainer();

  /// Adds a callback after the built-in ones.
  void add_callback(std::shared_ptr<Callback> callback);

  /// Trains until trainer.max_steps or a callback stops it; evaluates and
  /// saves as configured. Returns the final state.
  const TrainerState& fit();

  /// Evaluation loss over trainer.eval_batches micro-batches per rank: the
  /// summed loss of all ranks over their target count; NaN when the task has
  /// no evaluation data.
  double evaluate();

  /// Writes the whole model (gathered to rank 0 by the strategy) to
  /// `dir`/model.pt with the config beside it,
  /// through a temporary directory and a rename; returns `dir`.
  std::string save(const std::string& dir);

  /// Collective: writes a sharded checkpoint of the current step to
  /// <run.dir>/checkpoints/step-NNNNNN (checkpoint/checkpoint.h: every rank
  /// its shards, rank 0 the metadata and training state, a commit marker
  /// last), then keeps the newest checkpoint.keep ones and the best. Returns
  /// its directory.
  std::string save_checkpoint();

  /// Collective: continues from a checkpoint written by any strategy at any
  /// world size: "auto" takes the newest complete one of run.dir (none: a
  /// fresh start, returns ""), anything else is a checkpoint directory.
  /// Restores parameters, optimizer state, step, epoch, loss scaler, best
  /// value and (same world size) each rank's RNG. CheckpointError for a
  /// missing, torn, corrupt or mismatched checkpoint. Returns its directory.
  /// fit() calls it when checkpoint.resume is set.
  std::string resume(const std::string& spec);

  const TrainerState& state() const { return state_; }
  const std::shared_ptr<torch::nn::Module>& model() const { return task_.model; }
  strategy::Strategy& strategy() { return *strategy_; }
  precision::Precision& precision() { return *precision_; }
  torch::optim::Optimizer& optimizer() { return *optimizer_; }
  const config::BatchPlan& batch() const { return batch_; }

 private:
  void run_step();
  void set_learning_rate(double lr);
  void for_each_callback(const std::function<void(Callback&)>& f);
  // OR-s the control flags over ranks so every rank acts alike.
  void agree_on_control();
  // After an evaluation: tracks the best checkpoint.monitor value.
  void note_evaluation();

  config::Config config_;
  TrainTask task_;
  std::shared_ptr<comm::Communicator> comm_;
  std::unique_ptr<precision::Precision> precision_;
  std::unique_ptr<strategy::Strategy> strategy_;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  config::BatchPlan batch_;
  std::vector<std::shared_ptr<Callback>> callbacks_;
  TrainerState state_;
  TrainerControl control_;
  double best_value_ = 0.0;
  int64_t best_step_ = -1;  // step of the best monitored value; -1: none yet
  std::chrono::steady_clock::time_point last_save_ = std::chrono::steady_clock::now();
};

/// Intra-op threads for this rank: `requested` when positive, else the
/// machine's cores divided by the ranks on this node (at least 1).
int threads_for_rank(int64_t requested, int local_world_size);

/// Peak resident memory of this process so far, in MB.
double peak_rss_mb();

}  // namespace shardtrain::train
