// The built-in callbacks. Trainer adds the progress bar, the metrics writer
// and the learning-rate monitor by default, and early stopping when the
// config enables it.
#pragma once

#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>

#include "shardtrain/train/callback.h"
#include "shardtrain/train/choices.h"

namespace shardtrain::train {

/// Rank 0 shows step/total, loss, lr, tokens/s and ETA: a redrawn bar when
/// stdout is a terminal, plain lines otherwise (logs, the launcher's pipes).
class ProgressCallback : public Callback {
 public:
  explicit ProgressCallback(ProgressMode mode = ProgressMode::Auto, FILE* out = stdout);
  void on_train_begin(TrainerState&, TrainerControl&) override;
  void on_log(TrainerState&, TrainerControl&, const Metrics& logs) override;
  void on_evaluate(TrainerState&, TrainerControl&, const Metrics& metrics) override;
  void on_train_end(TrainerState&, TrainerControl&) override;

 private:
  bool bar_ = false;
  bool to_launcher_ = false;  // progress lines for the launcher's bar
  bool enabled_ = true;
  FILE* out_;
  std::chrono::steady_clock::time_point start_;
};

/// Rank 0 appends every step's metrics line, and every evaluation's, to
/// <run.dir>/metrics.jsonl (one JSON object per line, written whole). A line
/// that cannot be written (a full disk) is cut off again and is an IoError:
/// the file never ends in half a line.
class MetricsWriter : public Callback {
 public:
  MetricsWriter() = default;
  ~MetricsWriter() override;
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;
  void on_train_begin(TrainerState&, TrainerControl&) override;
  void on_step_end(TrainerState&, TrainerControl&) override;
  void on_evaluate(TrainerState&, TrainerControl&, const Metrics& metrics) override;
  const std::string& path() const { return path_; }

 private:
  void append_line(const std::string& json);
  std::string path_;
  int fd_ = -1;
};

/// Adds the learning rate of every parameter group to the step's metrics
/// ("lr_group0", "lr_group1", ...), so schedules can be checked per group.
class LearningRateMonitor : public Callback {
 public:
  void on_step_end(TrainerState&, TrainerControl&) override;
};

/// Stops training when `monitor` (an evaluation metric such as eval_loss)
/// has not improved by more than min_delta for `patience` evaluations.
class EarlyStopping : public Callback {
 public:
  /// mode Min: lower is better; Max: higher is better.
  EarlyStopping(std::string monitor, int64_t patience, double min_delta, MonitorMode mode);
  void on_evaluate(TrainerState&, TrainerControl&, const Metrics& metrics) override;
  int64_t wait_count() const { return wait_; }
  double best() const { return best_; }

 private:
  std::string monitor_;
  int64_t patience_;
  double min_delta_;
  bool maximize_;
  double best_;
  int64_t wait_ = 0;
};

}  // namespace shardtrain::train
