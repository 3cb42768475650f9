// Trainer::fit: the training loop, written to read like the algorithm.
//
// A TrainTask (train/task.h) says what to train (any torch::nn::Module), how
// to get a micro-batch and how to score it; the Config says how (batch sizes,
// optimizer, schedule, strategy, steps). make_task() builds the task for the
// built-in models from the config.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "shardtrain/config/config.h"
#include "shardtrain/train/callback.h"
#include "shardtrain/train/task.h"

namespace torch::optim {
class Optimizer;
}
namespace shardtrain::comm {
class Communicator;
class DeviceMesh;
}
namespace shardtrain::strategy {
class Strategy;
}
namespace shardtrain::precision {
class Precision;
}
namespace shardtrain::parallel {
class Pipeline;
struct PipelineStepFns;
struct PipelineStepStats;
}

namespace shardtrain::checkpoint {
struct LoadResult;
}
namespace shardtrain::dist {
struct ClusterEnv;
}

namespace shardtrain::train {
namespace detail {
class LoadBalancer;
}

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
  /// saves as configured, writes a checkpoint of the last step, and (unless
  /// a signal stopped it) exports the model to run.dir (export_model).
  /// Returns the final state.
  const TrainerState& fit();

  /// Evaluation loss over trainer.eval_batches micro-batches per rank: the
  /// summed loss of all ranks over their target count; NaN when the task has
  /// no evaluation data.
  double evaluate();

  /// Collective: writes the whole model to `dir`/model.safetensors with
  /// Hugging Face GPT-2 tensor names (Conv1D weights as [in, out]; the step
  /// in its metadata) and the config to `dir`/config.yaml, each through a
  /// temporary file and a rename, the model last. When this trainer saved a
  /// checkpoint of the current step, rank 0 converts it tensor by tensor;
  /// otherwise the strategy gathers the model to rank 0. What
  /// `shardtrain generate` and model.init_from read. Returns the model
  /// file's path. CheckpointError on every rank when rank 0 cannot write.
  std::string export_model(const std::string& dir);

  /// Collective: writes a sharded checkpoint of the current step to
  /// <run.dir>/checkpoints/step-NNNNNN (checkpoint/checkpoint.h: every rank
  /// its shards, rank 0 the metadata and training state, a commit marker
  /// last), then keeps the newest checkpoint.keep ones and the best. Returns
  /// its directory.
  std::string save_checkpoint();

  /// Collective: continues from a checkpoint written by any strategy at any
  /// world size: "auto" takes the newest complete one of run.dir that loads
  /// (one that fails, e.g. its checksums, is named in a warning and the
  /// previous one is tried; none: a fresh start, returns ""), anything else
  /// is a checkpoint directory.
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
  /// The precision that runs, with why when the config said `auto`, e.g.
  /// "bf16-mixed (auto: this CPU computes bf16 natively ...)".
  std::string precision_description() const;

 private:
  // ---- set-up, in the constructor's order (train/trainer.cpp)
  // The mesh, its data-parallel group, the batch plan and this rank's threads.
  void set_up_mesh(const dist::ClusterEnv& env);
  // Each data-parallel rank's share of a step's batch, and where it runs.
  void set_up_load_balance(const dist::ClusterEnv& env);
  // precision `auto` decided (measured on a bf16 CPU) and the plugin built.
  void set_up_precision();
  // distributed.pipeline_parallel > 1: this rank's stages.
  void set_up_pipeline();
  // LoRA, the tensor-parallel split, the strategy over what is left, and the
  // optimizer over what the strategy made of the parameters.
  void set_up_strategy(const dist::ClusterEnv& env);
  // The schedule checked, and a warning naming the bubble when the window
  // holds fewer micro-batches than there are pipeline ranks.
  void check_pipeline_schedule();
  void set_up_callbacks();

  // ---- one optimizer step (train/step.cpp): run_step calls the phases below in order.
  // The step's micro-batches and what normalises their loss.
  struct Window {
    std::vector<data::Batch> batches;
    int64_t total_targets = 0;     // over every data-parallel rank
    int64_t local_samples = 0;     // this rank's rows
    double normaliser = 0.0;       // data-parallel ranks over total_targets
    double tp_busy_before = 0.0;   // the tensor-parallel group's busy seconds at the start
  };
  // What forward and backward over a window give.
  struct WindowWork {
    double loss_sum = 0.0;   // this rank's summed loss (before normalisation)
    double aux_sum = 0.0;    // this rank's summed auxiliary losses (TrainTask::aux_loss)
    double aux_count = 0.0;  // and how many forwards gave one
    double compute_s = 0.0;  // this rank's compute, less its waits in collectives
    double busy_s = 0.0;     // pipeline: this rank's stages' work
    double span_s = 0.0;     // pipeline: the schedule's span on this rank
    bool timed = false;      // compute_s measured by the runner (a pipeline's stages)
  };
  void run_step();
  // 1. data: the window's micro-batches and the global target count.
  Window data_window(int64_t step);
  // 2. compute: forward and backward over the window, then the gradients' sync.
  WindowWork forward_backward(const Window& window);
  // How a window runs, chosen once in the constructor: micro-steps one after
  // another, or the pipeline's schedule.
  WindowWork micro_steps(const Window& window);
  WindowWork pipeline_window(const Window& window);
  WindowWork (Trainer::*run_window_)(const Window&) = &Trainer::micro_steps;
  // 3. step: unscale and check, clip, the learning rate, the optimizer.
  //    Returns whether the step was skipped (fp16 overflow).
  bool optimizer_step(int64_t step);
  // 4. metrics: one all-gather of every rank's figures, then the record.
  void record_metrics(const Window& window, const WindowWork& work, bool skipped, double step_time);
  void parallel_metrics(const at::Tensor& per_rank, const Window& window, Metrics& m);
  void run_metrics(bool skipped, Metrics& m);
  // 5. control: what comes after the step (log, evaluate, save, stop), agreed by every rank.
  void plan_next_step();

  // What the pipeline's stages need from this trainer (backward_root is the step's).
  parallel::PipelineStepFns pipeline_fns();
  // Collective: the step's pipeline work per rank, to <run.dir>/pipeline_timeline.json (rank 0).
  void write_pipeline_timeline(const parallel::PipelineStepStats& stats);
  // Micro-step j's batch of this rank: the even split, or its share's rows.
  data::Batch micro_batch(int64_t step, int64_t j);
  // After a step: every rank's compute seconds and samples (columns of
  // `per_rank`, one row per world rank, as the step's all-gather left them)
  // into the load balancer, which may re-plan the shares and name
  // stragglers; the step's metrics get both.
  void balance_step(const at::Tensor& per_rank, Metrics& m);
  void set_learning_rate(double lr);
  void for_each_callback(const std::function<void(Callback&)>& f);
  // OR-s the control flags over ranks so every rank acts alike.
  void agree_on_control();

  // ---- fit (train/trainer.cpp)
  // Where fit stands: the steps last saved and evaluated (-1: none).
  struct FitMarks {
    int64_t saved_at = -1;
    int64_t evaluated_at = -1;
  };
  // checkpoint.resume as fit applies it ("" for a fresh start).
  std::string resume_spec() const;
  // Steps until trainer.max_steps or a stop, with the cadences' evaluations and saves.
  void train_steps(FitMarks& marks);
  // After the loop: the final evaluation, checkpoint and export.
  void finish_fit(FitMarks& marks);
  void evaluate_now(FitMarks& marks);
  void checkpoint_now(FitMarks& marks);
  // After an evaluation: tracks the best checkpoint.monitor value.
  void note_evaluation();
  // Collective: parameters and optimizer state from checkpoint `dir`.
  checkpoint::LoadResult load_checkpoint(const std::string& dir);
  // Step, epoch, loss scaler, best value and RNG from what it loaded.
  void restore_train_state(const std::string& dir, const checkpoint::LoadResult& loaded);

  config::Config config_;
  TrainTask task_;
  std::shared_ptr<comm::Communicator> comm_;
  // The mesh over comm_ (distributed.tensor_parallel x data parallel) and
  // its data-parallel group: the ranks that see different data.
  std::unique_ptr<comm::DeviceMesh> mesh_;
  std::shared_ptr<comm::Communicator> dp_;
  // distributed.pipeline_parallel > 1: this rank's stages and their executor,
  // and what its last step did (for the timeline).
  std::unique_ptr<parallel::Pipeline> pipeline_;
  std::unique_ptr<parallel::PipelineStepStats> pipeline_stats_;
  std::unique_ptr<precision::Precision> precision_;
  std::unique_ptr<strategy::Strategy> strategy_;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  config::BatchPlan batch_;
  // Each data-parallel rank's share of the batch and measured speed (fixed
  // equal shares under distributed.load_balance: even).
  std::unique_ptr<detail::LoadBalancer> balance_;
  // Where each data-parallel rank runs, for the log ("rank 1 on host b").
  std::vector<std::string> dp_places_;
  std::vector<std::shared_ptr<Callback>> callbacks_;
  TrainerState state_;
  TrainerControl control_;
  double best_value_ = 0.0;
  int64_t best_step_ = -1;  // step of the best monitored value; -1: none yet
  // The checkpoint save_checkpoint() wrote last and its step (-1: none), for
  // export_model.
  std::string last_checkpoint_;
  int64_t last_checkpoint_step_ = -1;
  std::chrono::steady_clock::time_point last_save_ = std::chrono::steady_clock::now();
  // Times the launcher restarted this job (SHARDTRAIN_RESTART_COUNT).
  int restarts_ = 0;
  int threads_ = 1;        // intra-op and BLAS threads of this rank
  std::string blas_core_;  // OpenBLAS's kernel set, "" for another BLAS
  std::string precision_reason_;  // why `auto` chose what it did; "" otherwise
  // LoRA: the frozen parameters' names, model.init_from's identity as JSON
  // (path, bytes, SHA-256; "" without it), and whether checkpoints reference
  // that file instead of copying the base.
  std::vector<std::string> frozen_names_;
  std::string base_identity_;
  bool reference_base_ = false;
};

}  // namespace shardtrain::train
