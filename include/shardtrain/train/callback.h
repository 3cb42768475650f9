// Callbacks: code that runs at fixed points of Trainer::fit, with Hugging
// Face's event names, and the TrainerControl flags they use to steer it.
//
// Order of events in fit():
//   on_train_begin
//   per epoch:      on_epoch_begin ... on_epoch_end
//   per step:       on_step_begin
//                   on_substep_end          after each micro-step but the last
//                   on_pre_optimizer_step   gradients final and clipped
//                   on_optimizer_step       parameters updated
//                   on_step_end             state.metrics holds the step's line
//                   on_log / on_evaluate / on_save, when the flags ask for them
//   on_train_end
// Callbacks run in the order they were added. A flag set by any callback on
// any rank stays set: flags are OR-ed across callbacks and across ranks before
// the trainer acts on them, so every rank logs, evaluates, saves and stops at
// the same step.
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace shardtrain::train {

/// One JSON object of metrics: keys in insertion order, numbers, text or a
/// list of numbers (one per rank, for example).
class Metrics {
 public:
  using Value = std::variant<double, int64_t, std::string, std::vector<double>>;

  /// Sets `key`, replacing an earlier value of the same key.
  void set(const std::string& key, Value value);
  /// The value of `key` as a number, when present and a single number.
  std::optional<double> number(const std::string& key) const;
  bool contains(const std::string& key) const;
  const std::vector<std::pair<std::string, Value>>& entries() const { return entries_; }
  /// {"step": 3, "loss": 2.5, "peak_rss_mb_ranks": [301.5, 298], ...} on one
  /// line; non-finite numbers are null.
  std::string to_json() const;

 private:
  std::vector<std::pair<std::string, Value>> entries_;
};

/// Where training stands. The trainer updates it; callbacks may read it and
/// add keys to `metrics` in on_step_end (before the metrics writer sees it,
/// when added earlier).
struct TrainerState {
  /// Optimizer steps completed.
  int64_t step = 0;
  int64_t max_steps = 0;
  int64_t epoch = 0;
  /// Micro-step within the current step (on_substep_end).
  int64_t micro_step = 0;
  int64_t accumulate = 1;
  int rank = 0;
  int world_size = 1;
  /// Mean loss over the global batch of the last step.
  double loss = std::numeric_limits<double>::quiet_NaN();
  double lr = 0.0;
  /// Learning rate of each optimizer parameter group.
  std::vector<double> group_lrs;
  /// Global gradient norm of the last step, before clipping.
  double grad_norm = 0.0;
  /// The last step's metrics line (aggregated over ranks).
  Metrics metrics;
  /// The last evaluation's metrics (eval_loss, ...), empty before the first.
  Metrics eval_metrics;
  /// Run directory (config run.dir).
  std::string run_dir;
  /// SIGTERM or SIGINT that stopped training (after a checkpoint), or 0.
  int signal = 0;
};

/// Requests callbacks make of the trainer; reset at each step's start,
/// except should_training_stop.
struct TrainerControl {
  bool should_training_stop = false;
  bool should_save = false;
  bool should_evaluate = false;
  bool should_log = false;
};

class Callback {
 public:
  virtual ~Callback() = default;
  virtual void on_train_begin(TrainerState&, TrainerControl&) {}
  virtual void on_epoch_begin(TrainerState&, TrainerControl&) {}
  virtual void on_step_begin(TrainerState&, TrainerControl&) {}
  virtual void on_substep_end(TrainerState&, TrainerControl&) {}
  virtual void on_pre_optimizer_step(TrainerState&, TrainerControl&) {}
  virtual void on_optimizer_step(TrainerState&, TrainerControl&) {}
  virtual void on_step_end(TrainerState&, TrainerControl&) {}
  /// `logs` is the line being logged (the step's metrics).
  virtual void on_log(TrainerState&, TrainerControl&, const Metrics& logs) {}
  /// `metrics` holds eval_loss and the step.
  virtual void on_evaluate(TrainerState&, TrainerControl&, const Metrics& metrics) {}
  /// `path` is the directory just written.
  virtual void on_save(TrainerState&, TrainerControl&, const std::string& path) {}
  virtual void on_epoch_end(TrainerState&, TrainerControl&) {}
  virtual void on_train_end(TrainerState&, TrainerControl&) {}
};

}  // namespace shardtrain::train
