// Trainer::run_step: one optimizer step as five named phases, in the order
// of the algorithm: the data window, forward and backward over it (the one
// place a pipeline's schedule replaces the micro-step loop), the optimizer
// step, the metrics record, and what comes next.
#include "shardtrain/train/trainer.h"

#include <sys/resource.h>
#include <torch/torch.h>
#include <ATen/autocast_mode.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "checkpoint/detail.h"
#include "shardtrain/comm/communicator.h"
#include "shardtrain/comm/mesh.h"
#include "shardtrain/core/error.h"
#include "shardtrain/launch/env.h"
#include "shardtrain/parallel/pipeline.h"
#include "shardtrain/precision/precision.h"
#include "shardtrain/strategy/estimate.h"
#include "shardtrain/strategy/strategy.h"
#include "shardtrain/train/schedule.h"
#include "train/balance.h"
#include "train/profile.h"
#include "train/signal_guard.h"

namespace shardtrain::train {

namespace fs = std::filesystem;
namespace ck = ::shardtrain::checkpoint;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Autocast keeps the low-precision copy of each weight it casts until the
// outermost autocast scope ends: each micro-step would cast every weight
// again. One level of nesting held over the accumulation window keeps those
// copies for the window's later micro-steps (the weights cannot change
// inside it) and drops them before the optimizer step. Autocast itself stays
// off outside the micro-steps' forward.
class WindowCastCache {
 public:
  explicit WindowCastCache(bool mixed) : active_(mixed) {
    if (active_) at::autocast::increment_nesting();
  }
  ~WindowCastCache() {
    if (active_ && at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  }
  WindowCastCache(const WindowCastCache&) = delete;
  WindowCastCache& operator=(const WindowCastCache&) = delete;

 private:
  bool active_;
};

// Peak resident memory of this process so far, in MB.
double peak_rss_mb() {
  struct rusage usage {};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) / 1024.0;  // ru_maxrss is in KB on Linux
}

// trainer.profile_step: the step under LibTorch's profiler, by phase, with
// enough heap for a step's tensors of a mid-sized model (a 25M GPT needed
// about 1.1 GB), within a quarter of this rank's share of the memory.
std::optional<detail::StepProfiler> step_profiler(const config::Config& config, int64_t step) {
  if (config.trainer.profile_step != step + 1) return std::nullopt;
  const dist::ClusterEnv env = dist::ClusterEnv::detect();
  return std::optional<detail::StepProfiler>(
      std::in_place, static_cast<int64_t>(std::min(2.0 * (1 << 30),
                                                   strategy::default_memory_budget_bytes(env.local_world_size) / 4)));
}

// The columns of the step's all-gather, one row per world rank.
enum Column { kLoss, kRss, kStepTime, kBusy, kSpan, kCompute, kSamples, kDpRank, kAuxSum, kAuxCount, kColumns };

}  // namespace

void Trainer::run_step() {
  const int64_t step = state_.step;
  control_.should_save = control_.should_evaluate = control_.should_log = false;
  for_each_callback([&](Callback& c) { c.on_step_begin(state_, control_); });
  std::optional<detail::StepProfiler> profiler = step_profiler(config_, step);
  const auto start = Clock::now();

  const Window window = data_window(step);
  const WindowWork work = forward_backward(window);
  const bool skipped = optimizer_step(step);

  const double step_time = seconds_since(start);
  state_.step = step + 1;
  if (profiler) {
    profiler->write((fs::path(config_.run.dir) / ("profile-rank" + std::to_string(comm_->rank()) + ".json")).string(),
                    state_.step, comm_->rank(), step_time * 1e6);
  }
  record_metrics(window, work, skipped, step_time);
  plan_next_step();
}

Trainer::Window Trainer::data_window(int64_t step) {
  ST_PROFILE_PHASE("data");
  // The whole window's micro-batches first: the loss is normalised by the
  // number of targets in the window on all ranks (one small all-reduce), so
  // padded or uneven micro-batches give the gradient of one big batch.
  Window w;
  w.tp_busy_before = mesh_->tp()->busy_seconds();
  w.batches.reserve(static_cast<size_t>(batch_.accumulate));
  int64_t local_targets = 0;
  for (int64_t j = 0; j < batch_.accumulate; ++j) {
    w.batches.push_back(micro_batch(step, j));
    local_targets += task_.count_targets(w.batches.back());
    w.local_samples += w.batches.back().input.defined() ? w.batches.back().input.size(0) : 0;
  }
  auto targets = torch::tensor({local_targets}, torch::kLong);
  dp_->all_reduce(targets);
  w.total_targets = targets.item<int64_t>();
  ST_CHECK(w.total_targets > 0, Error, "step ", step + 1,
           " has no targets on any rank (every target is the ignore index)");
  // The strategy averages gradients over the data-parallel ranks, hence
  // their number here: the result is the sum over all targets divided by
  // their count. (Tensor-parallel ranks share their micro-batches.)
  w.normaliser = static_cast<double>(dp_->size()) / static_cast<double>(w.total_targets);
  return w;
}

Trainer::WindowWork Trainer::forward_backward(const Window& window) {
  const auto start = Clock::now();
  WindowWork work;
  {
    using precision::PrecisionKind;
    const bool mixed = config_.precision == PrecisionKind::Bf16Mixed || config_.precision == PrecisionKind::Fp16Mixed;
    const WindowCastCache cast_cache(mixed && batch_.accumulate > 1);
    work = (this->*run_window_)(window);
  }  // the window's cast copies go here, before gradient sync and the optimizer step
  {
    ST_PROFILE_PHASE("sync");
    strategy_->finish_gradient_sync();
  }
  // This rank's compute: forward and backward less the time it waited for
  // collectives (data-parallel gathers and reductions, tensor-parallel
  // ones). A pipeline measured its stages' work itself.
  if (!work.timed) {
    work.compute_s = std::max(0.0, seconds_since(start) - strategy_->comm_stats().exposed_s -
                                       (mesh_->tp()->busy_seconds() - window.tp_busy_before));
  }
  return work;
}

// Micro-steps one after another; only the last one's backward communicates.
Trainer::WindowWork Trainer::micro_steps(const Window& window) {
  WindowWork work;
  const int64_t accumulate = batch_.accumulate;
  for (int64_t j = 0; j < accumulate; ++j) {
    state_.micro_step = j;
    strategy_->set_gradient_sync(j == accumulate - 1);
    at::Tensor loss;
    {
      ST_PROFILE_PHASE("forward");
      const auto autocast = precision_->autocast();
      loss = task_.loss_sum(window.batches[static_cast<size_t>(j)]);
    }
    {
      ST_PROFILE_PHASE("backward");
      // An auxiliary loss (a router's load balance) is one value per forward:
      // its mean over the step's forwards enters the loss, so each adds
      // weight / accumulate here and the strategy's average over the
      // data-parallel ranks completes the mean.
      at::Tensor total = loss * window.normaliser;
      const at::Tensor aux = task_.aux_loss ? task_.aux_loss() : at::Tensor();
      if (aux.defined()) {
        work.aux_sum += aux.item<double>();
        work.aux_count += 1.0;
        if (task_.aux_loss_weight > 0.0) {
          total = total + aux * (task_.aux_loss_weight / static_cast<double>(accumulate));
        }
      }
      precision_->scale_loss(total).backward();
      work.loss_sum += loss.item<double>();
    }
    if (j < accumulate - 1) for_each_callback([&](Callback& c) { c.on_substep_end(state_, control_); });
  }
  return work;
}

// The micro-batches flow through the stages in the schedule's order.
Trainer::WindowWork Trainer::pipeline_window(const Window& window) {
  ST_PROFILE_PHASE("pipeline");
  parallel::PipelineStepFns fns = pipeline_fns();
  fns.backward_root = [&](const at::Tensor& loss) { return precision_->scale_loss(loss * window.normaliser); };
  pipeline_stats_ = std::make_unique<parallel::PipelineStepStats>(pipeline_->run_step(window.batches, fns));
  WindowWork work;
  work.loss_sum = pipeline_stats_->loss_sum;
  work.busy_s = pipeline_stats_->busy_s;
  work.span_s = pipeline_stats_->span_s;
  work.compute_s = work.busy_s;
  work.timed = true;
  return work;
}

bool Trainer::optimizer_step(int64_t step) {
  // Overflowed fp16 steps are skipped by every rank alike; otherwise clip by
  // the global norm and step.
  bool skipped = false;
  {
    ST_PROFILE_PHASE("clip");
    const std::vector<at::Tensor> grads = strategy_->gradients();
    skipped = precision_->unscale_and_check(grads, *comm_);
    state_.grad_norm = skipped ? std::numeric_limits<double>::quiet_NaN()
                               : strategy_->clip_grad_norm(config_.trainer.max_grad_norm);
  }
  for_each_callback([&](Callback& c) { c.on_pre_optimizer_step(state_, control_); });
  set_learning_rate(scheduled_lr(config_, step));
  {
    ST_PROFILE_PHASE("optimizer");
    if (!skipped) strategy_->optimizer_step(*optimizer_);
    optimizer_->zero_grad();
    precision_->update(skipped);
  }
  for_each_callback([&](Callback& c) { c.on_optimizer_step(state_, control_); });
  return skipped;
}

void Trainer::record_metrics(const Window& window, const WindowWork& work, bool skipped, double step_time) {
  // One all-gather gives every rank the loss, memory and time of all ranks
  // (a tensor-parallel group's loss counted once, its first rank's; under a
  // pipeline, the last stage's ranks hold the loss).
  const double counted_loss = mesh_->tp()->rank() == 0 ? work.loss_sum : 0.0;
  auto local = torch::tensor({counted_loss, peak_rss_mb(), step_time, work.busy_s, work.span_s, work.compute_s,
                              static_cast<double>(window.local_samples), static_cast<double>(dp_->rank()),
                              work.aux_sum, work.aux_count},
                             torch::kDouble);
  auto all = torch::empty({kColumns * comm_->size()}, torch::kDouble);
  comm_->all_gather(local, all);
  const at::Tensor per_rank = all.view({comm_->size(), kColumns});
  state_.loss = per_rank.select(1, kLoss).sum().item<double>() / static_cast<double>(window.total_targets);
  const at::Tensor rss_ranks = per_rank.select(1, kRss).contiguous();
  const double slowest = per_rank.select(1, kStepTime).max().item<double>();
  const double samples = static_cast<double>(batch_.global);

  Metrics m;
  m.set("step", state_.step);
  m.set("epoch", state_.epoch);
  m.set("loss", state_.loss);
  m.set("lr", state_.lr);
  m.set("grad_norm", state_.grad_norm);
  if (task_.aux_loss) {  // the mean over the step's forwards on every rank
    const double count = per_rank.select(1, kAuxCount).sum().item<double>();
    m.set("aux_loss", count > 0.0 ? per_rank.select(1, kAuxSum).sum().item<double>() / count
                                  : std::numeric_limits<double>::quiet_NaN());
  }
  m.set("tokens_per_s", samples * static_cast<double>(task_.tokens_per_sample) / slowest);
  m.set("samples_per_s", samples / slowest);
  m.set("step_time_s", slowest);
  m.set("peak_rss_mb", rss_ranks.max().item<double>());
  m.set("peak_rss_mb_ranks", std::vector<double>(rss_ranks.data_ptr<double>(),
                                                 rss_ranks.data_ptr<double>() + comm_->size()));
  m.set("world_size", static_cast<int64_t>(comm_->size()));
  balance_step(per_rank, m);
  parallel_metrics(per_rank, window, m);
  run_metrics(skipped, m);
  state_.metrics = std::move(m);
}

void Trainer::parallel_metrics(const at::Tensor& per_rank, const Window& window, Metrics& m) {
  m.set("tensor_parallel", static_cast<int64_t>(mesh_->shape().tp()));
  m.set("pipeline_parallel", static_cast<int64_t>(mesh_->shape().pp()));
  if (pipeline_) {
    // Each pipeline rank's compute and idle time in this step (the first
    // data-parallel and tensor-parallel rank's), and the bubble they make.
    const int per_stage = comm_->size() / mesh_->shape().pp();
    std::vector<double> busy, idle;
    double span = 0.0;
    for (int r = 0; r < mesh_->shape().pp(); ++r) span = std::max(span, per_rank[r * per_stage][kSpan].item<double>());
    for (int r = 0; r < mesh_->shape().pp(); ++r) {
      busy.push_back(per_rank[r * per_stage][kBusy].item<double>());
      idle.push_back(std::max(0.0, span - busy.back()));
    }
    m.set("pipeline_busy_s", busy);
    m.set("pipeline_idle_s", idle);
    m.set("pipeline_bubble", parallel::measured_bubble(busy, span));
  }
  // The tensor-parallel collectives of the step (forward, backward and the
  // loss): the training thread waits for each, so this is time not computing.
  m.set("tp_comm_s", mesh_->tp()->busy_seconds() - window.tp_busy_before);
}

void Trainer::run_metrics(bool skipped, Metrics& m) {
  m.set("strategy", strategy_->name());
  // Communication of the gradient path: time the comm threads worked and
  // the part the training thread waited for (the rest overlapped compute).
  const strategy::CommStats cs = strategy_->comm_stats();
  m.set("comm_busy_s", cs.busy_s);
  m.set("comm_exposed_s", cs.exposed_s);
  m.set("comm_reduced_bytes", cs.reduced_bytes);
  m.set("comm_gathered_bytes", cs.gathered_bytes);
  m.set("comm_in_place_ops", cs.in_place_ops);
  m.set("comm_staged_ops", cs.staged_ops);
  m.set("precision", precision_->name());
  m.set("loss_scale", precision_->loss_scale());
  m.set("skipped", static_cast<int64_t>(skipped ? 1 : 0));
  m.set("restarts", static_cast<int64_t>(restarts_));
  m.set("blas_core", blas_core_);
  m.set("blas_threads", static_cast<int64_t>(threads_));
  for (const auto& [key, value] : task_.static_metrics.entries()) m.set(key, value);
}

void Trainer::plan_next_step() {
  // The default flow: log, evaluate on their cadences; callbacks may add more.
  const auto& t = config_.trainer;
  const bool last = state_.step >= t.max_steps;
  control_.should_log = t.log_every > 0 && (state_.step % t.log_every == 0 || last);
  control_.should_evaluate = t.eval_every > 0 && task_.eval_batch && (state_.step % t.eval_every == 0 || last);
  // Checkpoint cadence (any rank's clock or signal counts: the flags are
  // OR-ed over ranks next).
  const auto& k = config_.checkpoint;
  if (k.every_n_steps > 0 && state_.step % k.every_n_steps == 0) control_.should_save = true;
  if (k.every_n_minutes > 0 && seconds_since(last_save_) >= 60.0 * k.every_n_minutes) control_.should_save = true;
  if (detail::SignalGuard::received() != 0) control_.should_save = control_.should_training_stop = true;
  for_each_callback([&](Callback& c) { c.on_step_end(state_, control_); });
  agree_on_control();
  if (pipeline_ && control_.should_log) write_pipeline_timeline(*pipeline_stats_);
}

void Trainer::balance_step(const at::Tensor& per_rank, Metrics& m) {
  // A data-parallel rank's compute is its slowest tensor- or pipeline-
  // parallel rank's (they wait for each other); its samples are theirs.
  const int dp = dp_->size();
  std::vector<double> compute(static_cast<size_t>(dp), 0.0), samples(static_cast<size_t>(dp), 0.0);
  std::vector<double> compute_ranks;
  const auto a = per_rank.accessor<double, 2>();
  for (int r = 0; r < comm_->size(); ++r) {
    const auto k = static_cast<size_t>(a[r][kDpRank]);
    compute_ranks.push_back(a[r][kCompute]);
    compute[k] = std::max(compute[k], a[r][kCompute]);
    samples[k] = a[r][kSamples];
  }
  const std::vector<double> before = balance_->shares();
  const detail::BalanceEvents events = balance_->observe(state_.step, samples, compute);
  m.set("compute_s_ranks", compute_ranks);
  m.set("samples_ranks", samples);
  m.set("shares", before);  // the split this step ran with
  m.set("load_balance", enum_name(config_.distributed.load_balance()));
  if (comm_->rank() != 0) return;
  // The log names what changed: the split, and ranks that fell behind the
  // median or caught up (each once, with where it runs).
  const auto& now = balance_->shares();
  const auto relative = [&](int k) { return now[static_cast<size_t>(k)] * dp; };
  if (events.replanned) {
    std::string split;
    for (double x : now) split += ::shardtrain::detail::str_cat(split.empty() ? "" : " ", std::lround(1000 * x) / 1000.0);
    std::printf("load balance: after step %lld the shares are %s (predicted step time %.2fx shorter)\n",
                static_cast<long long>(state_.step), split.c_str(), events.predicted_gain);
  }
  for (int k : events.slowed) {
    std::printf("%s is %.1fx slower than the median; its share is now %.2fx\n", dp_places_[static_cast<size_t>(k)].c_str(),
                balance_->slowdown(k), relative(k));
  }
  for (int k : events.recovered) {
    std::printf("%s has recovered (%.1fx the median's time per sample); its share is now %.2fx\n",
                dp_places_[static_cast<size_t>(k)].c_str(), balance_->slowdown(k), relative(k));
  }
  if (events.replanned || !events.slowed.empty() || !events.recovered.empty()) std::fflush(stdout);
}

void Trainer::write_pipeline_timeline(const parallel::PipelineStepStats& stats) {
  // Each rank's work in this step as "op stage micro start end" lines; rank
  // 0 keeps those of each pipeline rank's first data- and tensor-parallel
  // rank and writes them for the report (train/report.h).
  std::string mine;
  for (const auto& span : stats.spans) {
    mine += ::shardtrain::detail::str_cat(parallel::to_string(span.action).substr(0, 1), ' ', span.action.stage, ' ',
                            span.action.micro, ' ', span.start_s, ' ', span.end_s, '\n');
  }
  const std::vector<std::string> all = ck::detail::all_gather_strings(*comm_, mine);
  if (comm_->rank() != 0) return;
  const int per_stage = comm_->size() / mesh_->shape().pp();
  nlohmann::json ranks = nlohmann::json::array();
  for (int r = 0; r < mesh_->shape().pp(); ++r) {
    nlohmann::json spans = nlohmann::json::array();
    std::istringstream in(all[static_cast<size_t>(r * per_stage)]);
    std::string op;
    int stage = 0, micro = 0;
    double start = 0.0, end = 0.0;
    while (in >> op >> stage >> micro >> start >> end) spans.push_back({op, stage, micro, start, end});
    ranks.push_back(spans);
  }
  const nlohmann::json timeline = {{"step", state_.step},
                                   {"schedule", enum_name(config_.distributed.pipeline_schedule())},
                                   {"stages", pipeline_->stages().size()},
                                   {"ranks", ranks}};
  ck::detail::write_file_atomically((fs::path(config_.run.dir) / "pipeline_timeline.json").string(),
                                    timeline.dump() + "\n");
}

data::Batch Trainer::micro_batch(int64_t step, int64_t j) {
  if (config_.distributed.load_balance() == LoadBalance::Even) {
    return task_.train_batch(step, j, batch_.micro, dp_->rank(), dp_->size());
  }
  const auto [first, count] = balance_->rows(j, dp_->rank());
  return task_.train_rows(step, first, count);
}

void Trainer::set_learning_rate(double lr) {
  state_.lr = lr;
  state_.group_lrs.clear();
  // Every group follows the one schedule; groups differ only in weight decay.
  for (auto& group : optimizer_->param_groups()) {
    group.options().set_lr(lr);
    state_.group_lrs.push_back(lr);
  }
}

void Trainer::for_each_callback(const std::function<void(Callback&)>& f) {
  for (auto& c : callbacks_) f(*c);
}

void Trainer::agree_on_control() {
  auto flags = torch::tensor({control_.should_training_stop ? 1.0f : 0.0f, control_.should_save ? 1.0f : 0.0f,
                              control_.should_evaluate ? 1.0f : 0.0f, control_.should_log ? 1.0f : 0.0f});
  comm_->all_reduce(flags, comm::AllReduceOptions().op(comm::ReduceOp::Max));
  auto f = flags.accessor<float, 1>();
  control_.should_training_stop = f[0] > 0;
  control_.should_save = f[1] > 0;
  control_.should_evaluate = f[2] > 0;
  control_.should_log = f[3] > 0;
}

parallel::PipelineStepFns Trainer::pipeline_fns() {
  parallel::PipelineStepFns fns;
  fns.loss_sum = task_.logits_loss_sum;
  fns.in_precision = [this](const std::function<at::Tensor()>& forward) {
    const auto autocast = precision_->autocast();
    return forward();
  };
  fns.set_gradient_sync = [this](bool enabled) { strategy_->set_gradient_sync(enabled); };
  return fns;
}

}  // namespace shardtrain::train
