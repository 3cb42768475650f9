// The built-in callbacks. Trainer adds the progress bar, the metrics writer,
// the TensorBoard writer and the learning-rate monitor by default, and early
// stopping when the config enables it.
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

/// Rank 0 writes the scalars of every logged step (loss, lr, grad_norm,
/// tokens_per_s, loss_scale, skipped, peak_rss_mb and peak_rss_mb/rank<k>,
/// comm_hidden) and each evaluation's eval_loss as a TensorBoard event file,
/// <run.dir>/tb/events.out.tfevents.<unix seconds>.<host>.<pid>, so
/// `tensorboard --logdir <run.dir>/tb` shows the run. Each log is one
/// write() of whole records; a write that comes short is cut off again and
/// is an IoError, as for MetricsWriter. Non-finite values are left out.
class TensorBoardWriter : public Callback {
 public:
  TensorBoardWriter() = default;
  ~TensorBoardWriter() override;
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;
  void on_train_begin(TrainerState&, TrainerControl&) override;
  void on_log(TrainerState&, TrainerControl&, const Metrics& logs) override;
  void on_evaluate(TrainerState&, TrainerControl&, const Metrics& metrics) override;
  /// The event file, once on_train_begin has opened it (rank 0 only).
  const std::string& path() const { return path_; }

 private:
  void append(const std::string& records);
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
