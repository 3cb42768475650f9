// Trainer::fit, the loop every strategy runs under.
#include "shardtrain/train/trainer.h"

#include <malloc.h>
#include <unistd.h>
#include <sys/resource.h>
#include <torch/torch.h>
#include <ATen/autocast_mode.h>

#include <chrono>
#include <cstdio>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <thread>

#include "checkpoint/detail.h"
#include "shardtrain/checkpoint/checkpoint.h"
#include "shardtrain/checkpoint/safetensors.h"
#include "shardtrain/comm/communicator.h"
#include "shardtrain/comm/mesh.h"
#include "shardtrain/core/blas.h"
#include "shardtrain/core/error.h"
#include "shardtrain/launch/env.h"
#include "shardtrain/models/family.h"
#include "shardtrain/models/causal_lm.h"
#include "shardtrain/parallel/pipeline.h"
#include "shardtrain/parallel/tensor_parallel.h"
#include "shardtrain/precision/precision.h"
#include "shardtrain/strategy/estimate.h"
#include "shardtrain/strategy/strategy.h"
#include "shardtrain/train/callbacks.h"
#include "shardtrain/train/plan.h"
#include "shardtrain/train/schedule.h"
#include "train/balance.h"
#include "train/config_digest.h"
#include "train/fused_adamw.h"
#include "train/lora.h"
#include "train/profile.h"
#include "train/run_dir.h"
#include "train/signal_guard.h"

namespace shardtrain::train {

namespace fs = std::filesystem;
namespace ck = ::shardtrain::checkpoint;
using Clock = std::chrono::steady_clock;

namespace {

// Intra-op threads for this rank: `requested` when positive, else the
// machine's cores divided by the ranks on this node (at least 1).
int threads_for_rank(int64_t requested, int local_world_size) {
  if (requested > 0) return static_cast<int>(requested);
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  return std::max(1, static_cast<int>(cores) / std::max(1, local_world_size));
}

// A training step allocates and frees the same activation-sized blocks
// (MBs each) over and over. With glibc's defaults the heap's free top is
// trimmed back to the system and large blocks are mapped and unmapped, so
// their pages fault in again every step: in a VM that cost a third of a
// one-thread GPT step. Blocks up to 32 MB come from the heap and freed memory
// stays there for reuse (up to 1 GB above the top). Flat parameter storage
// is mapped by the strategies themselves and still returns when freed.
void keep_freed_memory() {
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
}

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

// Weight decay for matrices and embeddings only, never for biases and
// LayerNorm gains: the usual rule for transformers (nanoGPT, HF). Decided by
// the whole parameter's shape, so sharded (1-D) slices group alike.
std::vector<torch::optim::OptimizerParamGroup> param_groups(
    const std::vector<strategy::ShardedTensor>& params, const config::OptimizerConfig& o) {
  std::vector<torch::Tensor> decay, no_decay;
  for (const auto& p : params) (p.global_shape.size() >= 2 ? decay : no_decay).push_back(p.local);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  auto options = [&](double wd) -> std::unique_ptr<torch::optim::OptimizerOptions> {
    if (o.name == OptimizerKind::Sgd) {
      return std::make_unique<torch::optim::SGDOptions>(
          torch::optim::SGDOptions(o.lr).momentum(o.momentum).weight_decay(wd));
    }
    return std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(o.lr)
                                                            .betas({o.betas.at(0), o.betas.at(1)})
                                                            .eps(o.eps)
                                                            .weight_decay(wd));
  };
  if (!decay.empty()) groups.emplace_back(decay, options(o.weight_decay));
  if (!no_decay.empty()) groups.emplace_back(no_decay, options(0.0));
  return groups;
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(
    const std::vector<strategy::ShardedTensor>& params, const config::OptimizerConfig& o) {
  auto groups = param_groups(params, o);
  ST_CHECK(!groups.empty(), ConfigError, "the model has no trainable parameters");
  if (o.name == OptimizerKind::Sgd) {
    return std::make_unique<torch::optim::SGD>(groups, torch::optim::SGDOptions(o.lr));
  }
  return std::make_unique<detail::FusedAdamW>(groups, torch::optim::AdamWOptions(o.lr));
}

}  // namespace

namespace {

// Rank 0 takes the run directory's lock (train/run_dir.h) unless the
// process that started this job holds it; the refusal reaches every rank.
std::unique_ptr<detail::RunDirLock> hold_run_dir(comm::Communicator& comm, const config::Config& config,
                                                 bool resuming) {
  std::unique_ptr<detail::RunDirLock> held;
  std::string error;
  if (comm.rank() == 0 && !detail::run_dir_locked_above(config.run.dir)) {
    try {
      held = detail::RunDirLock::acquire(config.run.dir, resuming || config.run.overwrite);
    } catch (const Error& e) {
      error = e.what();
    }
  }
  error = ck::detail::agree_on_error(comm, error);
  if (!error.empty()) throw ConfigError(error);
  return held;
}

// Where each data-parallel rank runs, for the log ("rank 1 on host b (node
// 1)": its first rank's), and its threads (the fewest of its tensor- and
// pipeline-parallel ranks). Collective over `world`.
struct DataParallelPlaces {
  std::vector<std::string> where;
  std::vector<double> threads;
};

DataParallelPlaces data_parallel_places(comm::Communicator& world, const comm::Communicator& dp, int threads,
                                        int node_rank) {
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  const std::vector<std::string> all = ck::detail::all_gather_strings(
      world, ::shardtrain::detail::str_cat(dp.rank(), ' ', threads, ' ', host, " (node ", node_rank, ")"));
  DataParallelPlaces out{std::vector<std::string>(static_cast<size_t>(dp.size())),
                         std::vector<double>(static_cast<size_t>(dp.size()), 0.0)};
  for (size_t r = 0; r < all.size(); ++r) {
    std::istringstream in(all[r]);
    int k = 0;
    double t = 0.0;
    in >> k >> t;
    std::string where;
    std::getline(in >> std::ws, where);
    auto& fewest = out.threads[static_cast<size_t>(k)];
    fewest = fewest > 0.0 ? std::min(fewest, t) : t;
    if (out.where[static_cast<size_t>(k)].empty()) {
      out.where[static_cast<size_t>(k)] = ::shardtrain::detail::str_cat(dp.size() == world.size() ? "" : "world ",
                                                                        "rank ", r, " on host ", where);
    }
  }
  return out;
}

}  // namespace

Trainer::Trainer(config::Config config, TrainTask task, std::shared_ptr<comm::Communicator> comm)
    : config_(std::move(config)), task_(std::move(task)), comm_(std::move(comm)) {
  ST_CHECK(task_.model && task_.loss_sum && task_.count_targets && task_.train_batch, ConfigError,
           "a TrainTask needs a model, loss_sum, count_targets and train_batch");
  // Before any other collective: ranks started with different configs or
  // files are refused, naming the first key that differs (config_digest.h).
  detail::refuse_mismatched_ranks(*comm_, config_);
  const dist::ClusterEnv env = dist::ClusterEnv::detect();
  // The mesh first: everything below that speaks of data parallelism (the
  // batch plan, the strategy, the sampler's ranks) means its dp dimension.
  mesh_ = std::make_unique<comm::DeviceMesh>(
      comm::DeviceMesh::create(comm_, mesh_shape(config_, comm_->size(), env.local_world_size)));
  dp_ = mesh_->dp();
  batch_ = config_.resolve_batch(dp_->size());
  restarts_ = env.restart_count;
  threads_ = threads_for_rank(config_.distributed.threads_per_rank(), env.local_world_size);
  at::set_num_threads(threads_);
  set_blas_threads(threads_);
  blas_core_ = blas_core();
  // The shares of each step's batch: equal under load_balance even; under
  // measured distributed.shares, else each data-parallel rank's threads, so
  // hosts of different core counts start apart.
  {
    const auto& d = config_.distributed;
    const bool measured = d.load_balance() == LoadBalance::Measured;
    ST_CHECK(!measured || task_.train_rows, ConfigError,
             "distributed.load_balance=measured: this task serves only even micro-batches (no "
             "TrainTask::train_rows); set distributed.load_balance: even");
    ST_CHECK(d.shares().empty() || static_cast<int>(d.shares().size()) == dp_->size(), ConfigError,
             "distributed.shares has ", d.shares().size(), " entries for ", dp_->size(),
             " data-parallel ranks; give one weight per data-parallel rank (world / (tensor_parallel x "
             "pipeline_parallel)), or leave it empty");
    const DataParallelPlaces places = data_parallel_places(*comm_, *dp_, threads_, env.node_rank);
    dp_places_ = places.where;
    detail::BalanceOptions bo;
    bo.rebalance_every = measured ? d.rebalance_every() : 0;
    bo.min_gain = d.rebalance_gain();
    bo.straggler_factor = d.straggler_factor();
    bo.global = batch_.global;
    bo.accumulate = batch_.accumulate;
    std::vector<double> start(static_cast<size_t>(dp_->size()), 1.0);
    if (measured) start = d.shares().empty() ? places.threads : d.shares();
    balance_ = std::make_unique<detail::LoadBalancer>(start, bo);
  }
  if (comm_->rank() == 0) {
    const std::string warning = blas_coretype_warning();
    if (!warning.empty()) std::fprintf(stderr, "warning: %s\n", warning.c_str());
  }

  // `auto` is decided once, here: everything below (memory plans, the
  // strategy's dtypes, checkpoints, the run's config.yaml) sees what runs.
  // On a CPU with native bf16, whether its bf16 GEMMs outrun fp32 ones is
  // measured, and the ranks average their figures so that all decide alike.
  const precision::ResolvedPrecision resolved =
      precision::resolve_precision_measured(config_.precision, torch::cuda::is_available(), comm_.get());
  config_.precision = resolved.kind;
  precision_reason_ = resolved.reason;
  precision_ = precision::Precision::create(config_.precision, config_.loss_scaler,
                                            torch::cuda::is_available());
  // Fine-tuning: weights from a safetensors file or a Hugging Face directory
  // (the family's names and layouts). Checked here; make_task built the
  // model deferred, so the strategy reads each tensor, or only the slices a
  // rank keeps, from the files in its setup (every rank reads them).
  detail::load_init_weights(*task_.model, config_);
  // Pipeline parallelism: each rank keeps its stages' modules (a deferred
  // model's other weights are never read).
  if (mesh_->shape().pp() > 1) {
    auto lm = std::dynamic_pointer_cast<models::CausalLMImpl>(task_.model);
    ST_CHECK(lm != nullptr && task_.logits_loss_sum, ConfigError, "distributed.pipeline_parallel=",
             mesh_->shape().pp(), ": the ", enum_name(config_.model.type),
             " model is not a language model a pipeline can cut; set distributed.pipeline_parallel: 1");
    const auto& d = config_.distributed;
    pipeline_ = std::make_unique<parallel::Pipeline>(
        *lm, *mesh_,
        parallel::PipelineOptions()
            .schedule(d.pipeline_schedule())
            .stages_per_rank(static_cast<int>(d.pipeline_stages() / d.pipeline_parallel()))
            .split(d.pipeline_split()));
    // LoRA adapts decoder layers: a stage of only the embedding or the head
    // would have nothing to train (every rank sees the same cut).
    const auto& stages = pipeline_->stages();
    for (size_t s = 0; s < stages.size() && config_.lora.r() > 0; ++s) {
      const bool layer = stages[s].end > 1 && stages[s].first <= config_.model.n_layer;
      ST_CHECK(layer, ConfigError, "distributed.pipeline_parallel=", d.pipeline_parallel(), ": pipeline stage ", s,
               " holds only the ", s == 0 ? "embedding" : "head", ", which LoRA leaves frozen; set "
               "distributed.pipeline_split so that every stage holds a decoder layer, or use fewer stages");
    }
  }
  // LoRA: freeze the (loaded) base and attach the adapters before anything
  // plans over the parameters. Under tensor parallelism the adapters split
  // with their layers, and a quantized base is quantized per block after.
  const bool tensor_parallel = mesh_->shape().tp() > 1;
  detail::prepare_lora(*task_.model, config_, /*quantize=*/!tensor_parallel, /*stage_part=*/pipeline_ != nullptr);
  // Tensor parallelism before the data-parallel strategy plans over the
  // parameters: each rank keeps its blocks of the split layers.
  std::optional<parallel::TensorParallelLayout> tp_layout;
  if (tensor_parallel) {
    tp_layout = parallel::apply_tensor_parallel(
        *task_.model, models::family_of(config_.model.type).tensor_parallel_plan(), mesh_->tp(),
        parallel::TensorParallelOptions()
            .sequence_parallel(config_.distributed.sequence_parallel())
            .loss_parallel(config_.distributed.loss_parallel())
            .whole_model(pipeline_ == nullptr));
    detail::quantize_lora(*task_.model, config_);
  }
  // After QLoRA's quantization of a base built whole, which returns the
  // fp32 base first; before the strategy reads deferred weights, whose
  // per-tensor scratch memory is then reused instead of mapped afresh.
  keep_freed_memory();
  {
    detail::FrozenBase base = detail::frozen_base(*task_.model, config_);
    frozen_names_ = std::move(base.names);
    base_identity_ = std::move(base.identity);
    reference_base_ = base.referenced;
  }
  precision_->prepare_model(*task_.model);

  strategy::StrategyOptions so = strategy_options(config_, *task_.model, comm_->size(), env.local_world_size);
  // Interleaved: a rank's other stages finish their backward before the
  // step's last one, so their gradients are reduced with the last, as
  // parameters that took no part in it.
  if (pipeline_ && pipeline_->local_stages().size() > 1) so.find_unused_parameters(true);
  strategy_ = strategy::make_strategy(so);
  if (tp_layout) {
    strategy_ = parallel::tensor_parallel_strategy(std::move(strategy_), std::move(*tp_layout), mesh_->tp());
  }
  if (pipeline_) strategy_ = pipeline_->wrap(std::move(strategy_));
  strategy_->setup(*task_.model, *mesh_);
  // A stage's forwards and backwards of the window's micro-batches
  // interleave: its units stay gathered for the step (sharded strategies).
  if (pipeline_) strategy_->keep_gathered_in_step(true);
  // After setup: the optimizer must see the parameters as the strategy left them.
  optimizer_ = make_optimizer(strategy_->optimizer_parameters(), config_.optimizer);

  if (pipeline_) {
    // The schedule of a step, checked now (interleaved needs whole rounds);
    // fewer micro-batches than pipeline ranks run, with a larger bubble.
    const int p = mesh_->shape().pp(), m = static_cast<int>(batch_.accumulate);
    const int v = static_cast<int>(pipeline_->local_stages().size());
    const auto schedule = config_.distributed.pipeline_schedule();
    const double bubble = parallel::simulate(parallel::pipeline_schedule(schedule, p, m, v), v, m).bubble;
    if (m < p && comm_->rank() == 0) {
      std::fprintf(stderr,
                   "warning: batch.accumulate=%d micro-batches for distributed.pipeline_parallel=%d: the %s "
                   "pipeline idles %.0f%% as long as it computes (the bubble); raise batch.accumulate to %d or more\n",
                   m, p, enum_name(schedule), 100.0 * bubble, p);
    }
  }

  state_.max_steps = config_.trainer.max_steps;
  state_.accumulate = batch_.accumulate;
  state_.rank = comm_->rank();
  state_.world_size = comm_->size();
  state_.run_dir = config_.run.dir;

  callbacks_.push_back(std::make_shared<LearningRateMonitor>());
  callbacks_.push_back(std::make_shared<MetricsWriter>());
  callbacks_.push_back(std::make_shared<TensorBoardWriter>());
  callbacks_.push_back(std::make_shared<ProgressCallback>(config_.trainer.progress));
  const auto& es = config_.trainer.early_stopping;
  if (es.enabled) {
    callbacks_.push_back(
        std::make_shared<EarlyStopping>(es.monitor, es.patience, es.min_delta, es.mode));
  }
}

Trainer::~Trainer() = default;

std::string Trainer::precision_description() const {
  const std::string name = enum_name(config_.precision);
  return precision_reason_.empty() ? name : name + " (" + precision_reason_ + ")";
}

void Trainer::add_callback(std::shared_ptr<Callback> callback) {
  callbacks_.push_back(std::move(callback));
}

void Trainer::for_each_callback(const std::function<void(Callback&)>& f) {
  for (auto& c : callbacks_) f(*c);
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

void Trainer::agree_on_control() {
  auto flags = torch::tensor({control_.should_training_stop ? 1.0f : 0.0f,
                              control_.should_save ? 1.0f : 0.0f,
                              control_.should_evaluate ? 1.0f : 0.0f,
                              control_.should_log ? 1.0f : 0.0f});
  comm_->all_reduce(flags, comm::AllReduceOptions().op(comm::ReduceOp::Max));
  auto f = flags.accessor<float, 1>();
  control_.should_training_stop = f[0] > 0;
  control_.should_save = f[1] > 0;
  control_.should_evaluate = f[2] > 0;
  control_.should_log = f[3] > 0;
}

void Trainer::run_step() {
  const int64_t step = state_.step;
  const int64_t accumulate = batch_.accumulate;
  control_.should_save = control_.should_evaluate = control_.should_log = false;
  for_each_callback([&](Callback& c) { c.on_step_begin(state_, control_); });
  // trainer.profile_step: this step under LibTorch's profiler, by phase.
  std::optional<detail::StepProfiler> profiler;
  if (config_.trainer.profile_step == step + 1) {
    // Enough heap for a step's tensors of a mid-sized model (a 25M GPT needed
    // about 1.1 GB), within a quarter of this rank's share of the memory.
    const dist::ClusterEnv env = dist::ClusterEnv::detect();
    profiler.emplace(static_cast<int64_t>(
        std::min(2.0 * (1 << 30), strategy::default_memory_budget_bytes(env.local_world_size) / 4)));
  }
  const auto start = Clock::now();
  const double tp_busy_before = mesh_->tp()->busy_seconds();

  // The whole window's micro-batches first: the loss is normalised by the
  // number of targets in the window on all ranks (one small all-reduce), so
  // padded or uneven micro-batches give the gradient of one big batch.
  std::vector<data::Batch> window;
  window.reserve(static_cast<size_t>(accumulate));
  int64_t total_targets = 0, local_samples = 0;
  {
    ST_PROFILE_PHASE("data");
    int64_t local_targets = 0;
    for (int64_t j = 0; j < accumulate; ++j) {
      window.push_back(micro_batch(step, j));
      local_targets += task_.count_targets(window.back());
      local_samples += window.back().input.defined() ? window.back().input.size(0) : 0;
    }
    auto targets = torch::tensor({local_targets}, torch::kLong);
    dp_->all_reduce(targets);
    total_targets = targets.item<int64_t>();
  }
  ST_CHECK(total_targets > 0, Error, "step ", step + 1,
           " has no targets on any rank (every target is the ignore index)");
  // The strategy averages gradients over the data-parallel ranks, hence
  // their number here: the result is the sum over all targets divided by
  // their count. (Tensor-parallel ranks share their micro-batches.)
  const double normaliser = static_cast<double>(dp_->size()) / static_cast<double>(total_targets);

  // Forward and backward over the window; only the last micro-step's
  // backward communicates.
  const auto compute_start = Clock::now();
  double loss_sum = 0.0;
  parallel::PipelineStepStats pipe_stats;
  {
    using precision::PrecisionKind;
    const bool mixed = config_.precision == PrecisionKind::Bf16Mixed ||
                       config_.precision == PrecisionKind::Fp16Mixed;
    const WindowCastCache cast_cache(mixed && accumulate > 1);
    if (pipeline_) {
      // The micro-batches flow through the stages in the schedule's order.
      ST_PROFILE_PHASE("pipeline");
      parallel::PipelineStepFns fns = pipeline_fns();
      fns.backward_root = [&](const at::Tensor& loss) { return precision_->scale_loss(loss * normaliser); };
      pipe_stats = pipeline_->run_step(window, fns);
      loss_sum = pipe_stats.loss_sum;
    }
    for (int64_t j = 0; j < (pipeline_ ? 0 : accumulate); ++j) {
      state_.micro_step = j;
      strategy_->set_gradient_sync(j == accumulate - 1);
      at::Tensor loss;
      {
        ST_PROFILE_PHASE("forward");
        const auto autocast = precision_->autocast();
        loss = task_.loss_sum(window[static_cast<size_t>(j)]);
      }
      {
        ST_PROFILE_PHASE("backward");
        precision_->scale_loss(loss * normaliser).backward();
        loss_sum += loss.item<double>();
      }
      if (j < accumulate - 1) for_each_callback([&](Callback& c) { c.on_substep_end(state_, control_); });
    }
  }  // the window's cast copies go here, before gradient sync and the optimizer step
  {
    ST_PROFILE_PHASE("sync");
    strategy_->finish_gradient_sync();
  }
  // This rank's compute: forward and backward less the time it waited for
  // collectives (data-parallel gathers and reductions, tensor-parallel ones);
  // under a pipeline, its stages' work.
  const double compute_s =
      pipeline_ ? pipe_stats.busy_s
                : std::max(0.0, std::chrono::duration<double>(Clock::now() - compute_start).count() -
                                    strategy_->comm_stats().exposed_s -
                                    (mesh_->tp()->busy_seconds() - tp_busy_before));

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
  const double step_time = std::chrono::duration<double>(Clock::now() - start).count();
  state_.step = step + 1;
  if (profiler) {
    profiler->write((fs::path(config_.run.dir) / ("profile-rank" + std::to_string(comm_->rank()) + ".json")).string(),
                    state_.step, comm_->rank(), step_time * 1e6);
  }

  // One all-gather gives every rank the loss, memory and time of all ranks
  // (a tensor-parallel group's loss counted once, its first rank's).
  // (Under a pipeline, the last stage's ranks hold the loss.)
  const double counted_loss = mesh_->tp()->rank() == 0 ? loss_sum : 0.0;
  auto local = torch::tensor({counted_loss, peak_rss_mb(), step_time, pipe_stats.busy_s, pipe_stats.span_s,
                              compute_s, static_cast<double>(local_samples), static_cast<double>(dp_->rank())},
                             torch::kDouble);
  auto all = torch::empty({8 * comm_->size()}, torch::kDouble);
  comm_->all_gather(local, all);
  auto per_rank = all.view({comm_->size(), 8});
  state_.loss = per_rank.select(1, 0).sum().item<double>() / static_cast<double>(total_targets);
  const at::Tensor rss_ranks = per_rank.select(1, 1).contiguous();
  const double rss = rss_ranks.max().item<double>();
  const double slowest = per_rank.select(1, 2).max().item<double>();
  const double samples = static_cast<double>(batch_.global);

  Metrics m;
  m.set("step", state_.step);
  m.set("epoch", state_.epoch);
  m.set("loss", state_.loss);
  m.set("lr", state_.lr);
  m.set("grad_norm", state_.grad_norm);
  m.set("tokens_per_s", samples * static_cast<double>(task_.tokens_per_sample) / slowest);
  m.set("samples_per_s", samples / slowest);
  m.set("step_time_s", slowest);
  m.set("peak_rss_mb", rss);
  m.set("peak_rss_mb_ranks", std::vector<double>(rss_ranks.data_ptr<double>(),
                                                 rss_ranks.data_ptr<double>() + comm_->size()));
  m.set("world_size", static_cast<int64_t>(comm_->size()));
  balance_step(per_rank, m);
  m.set("tensor_parallel", static_cast<int64_t>(mesh_->shape().tp()));
  m.set("pipeline_parallel", static_cast<int64_t>(mesh_->shape().pp()));
  if (pipeline_) {
    // Each pipeline rank's compute and idle time in this step (the first
    // data-parallel and tensor-parallel rank's), and the bubble they make.
    const int per_stage = comm_->size() / mesh_->shape().pp();
    std::vector<double> busy, idle;
    double span = 0.0;
    for (int r = 0; r < mesh_->shape().pp(); ++r) span = std::max(span, per_rank[r * per_stage][4].item<double>());
    for (int r = 0; r < mesh_->shape().pp(); ++r) {
      busy.push_back(per_rank[r * per_stage][3].item<double>());
      idle.push_back(std::max(0.0, span - busy.back()));
    }
    m.set("pipeline_busy_s", busy);
    m.set("pipeline_idle_s", idle);
    m.set("pipeline_bubble", parallel::measured_bubble(busy, span));
  }
  // The tensor-parallel collectives of the step (forward, backward and the
  // loss): the training thread waits for each, so this is time not computing.
  m.set("tp_comm_s", mesh_->tp()->busy_seconds() - tp_busy_before);
  m.set("strategy", strategy_->name());
  // Communication of the gradient path: time the comm threads worked and
  // the part the training thread waited for (the rest overlapped compute).
  const strategy::CommStats cs = strategy_->comm_stats();
  m.set("comm_busy_s", cs.busy_s);
  m.set("comm_exposed_s", cs.exposed_s);
  m.set("comm_reduced_bytes", cs.reduced_bytes);
  m.set("comm_gathered_bytes", cs.gathered_bytes);
  m.set("precision", precision_->name());
  m.set("loss_scale", precision_->loss_scale());
  m.set("skipped", static_cast<int64_t>(skipped ? 1 : 0));
  m.set("restarts", static_cast<int64_t>(restarts_));
  m.set("blas_core", blas_core_);
  m.set("blas_threads", static_cast<int64_t>(threads_));
  for (const auto& [key, value] : task_.static_metrics.entries()) m.set(key, value);
  state_.metrics = std::move(m);

  // The default flow: log, evaluate on their cadences; callbacks may add more.
  const auto& t = config_.trainer;
  const bool last = state_.step >= t.max_steps;
  control_.should_log = t.log_every > 0 && (state_.step % t.log_every == 0 || last);
  control_.should_evaluate = t.eval_every > 0 && task_.eval_batch &&
                             (state_.step % t.eval_every == 0 || last);
  // Checkpoint cadence (any rank's clock or signal counts: the flags are
  // OR-ed over ranks next).
  const auto& k = config_.checkpoint;
  if (k.every_n_steps > 0 && state_.step % k.every_n_steps == 0) control_.should_save = true;
  if (k.every_n_minutes > 0 &&
      std::chrono::duration<double>(Clock::now() - last_save_).count() >= 60.0 * k.every_n_minutes) {
    control_.should_save = true;
  }
  if (detail::SignalGuard::received() != 0) control_.should_save = control_.should_training_stop = true;
  for_each_callback([&](Callback& c) { c.on_step_end(state_, control_); });
  agree_on_control();
  if (pipeline_ && control_.should_log) write_pipeline_timeline(pipe_stats);
}

data::Batch Trainer::micro_batch(int64_t step, int64_t j) {
  if (config_.distributed.load_balance() == LoadBalance::Even) {
    return task_.train_batch(step, j, batch_.micro, dp_->rank(), dp_->size());
  }
  const auto [first, count] = balance_->rows(j, dp_->rank());
  return task_.train_rows(step, first, count);
}

void Trainer::balance_step(const at::Tensor& per_rank, Metrics& m) {
  // A data-parallel rank's compute is its slowest tensor- or pipeline-
  // parallel rank's (they wait for each other); its samples are theirs.
  const int dp = dp_->size();
  std::vector<double> compute(static_cast<size_t>(dp), 0.0), samples(static_cast<size_t>(dp), 0.0);
  std::vector<double> compute_ranks;
  const auto a = per_rank.accessor<double, 2>();
  for (int r = 0; r < comm_->size(); ++r) {
    const auto k = static_cast<size_t>(a[r][7]);
    compute_ranks.push_back(a[r][5]);
    compute[k] = std::max(compute[k], a[r][5]);
    samples[k] = a[r][6];
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

double Trainer::evaluate() {
  if (!task_.eval_batch || config_.trainer.eval_batches <= 0) {
    return std::numeric_limits<double>::quiet_NaN();
  }
  torch::NoGradGuard no_grad;
  task_.model->eval();
  double sum = 0.0;
  int64_t count = 0;
  // Under a pipeline the last stage's ranks hold the loss, and count the targets.
  const bool counts = !pipeline_ || mesh_->pp()->rank() == mesh_->shape().pp() - 1;
  for (int64_t i = 0; i < config_.trainer.eval_batches; ++i) {
    const data::Batch batch = task_.eval_batch(i, batch_.micro, dp_->rank(), dp_->size());
    if (pipeline_) {
      sum += pipeline_->evaluate(batch, pipeline_fns());
    } else {
      const auto autocast = precision_->autocast();
      sum += task_.loss_sum(batch).item<double>();
    }
    if (counts) count += task_.count_targets(batch);
  }
  task_.model->train();
  auto totals = torch::tensor({sum, static_cast<double>(count)}, torch::kDouble);
  dp_->all_reduce(totals);
  if (pipeline_) mesh_->pp()->all_reduce(totals);
  const double eval_loss = totals[0].item<double>() / totals[1].item<double>();
  Metrics m;
  m.set("step", state_.step);
  m.set("epoch", state_.epoch);
  m.set("eval_loss", eval_loss);
  state_.eval_metrics = std::move(m);
  return eval_loss;
}

std::string Trainer::export_model(const std::string& dir) {
  if (config_.lora.r() > 0) {  // the merged model (its checkpoints may lack the base)
    detail::export_lora(*strategy_, *comm_, config_, dir);
    return ck::exported_model_path(dir);
  }
  // From this step's checkpoint when there is one (and the model fits one
  // file): rank 0 streams it tensor by tensor and nobody gathers. Otherwise
  // sharded strategies gather the model unit by unit, to rank 0 only. Every
  // rank decides alike: the members below are set by a collective.
  const bool from_checkpoint = last_checkpoint_step_ == state_.step && !last_checkpoint_.empty() &&
                               model_parameter_count(config_.model) * 4.0 <=
                                   config_.checkpoint.export_max_shard_mb * 1e6;
  std::vector<std::pair<std::string, at::Tensor>> gathered;
  if (!from_checkpoint) gathered = strategy_->full_state_dict();
  std::string failure;  // rank 0's, shared with every rank before anyone throws
  if (comm_->rank() == 0) try {
    // Each file is written aside and renamed into place, the weights before
    // the index, so a reader never sees half a model.
    detail::write_exported_model(dir, config_, gathered, from_checkpoint ? last_checkpoint_ : "",
                                           {{"format", "pt"},
                                            {"producer", "shardtrain"},
                                            {"strategy", strategy_->name()},
                                            {"world_size", std::to_string(comm_->size())},
                                            {"step", std::to_string(state_.step)}});
  } catch (const std::exception& e) {
    failure = ::shardtrain::detail::one_line_message(e);
  }
  auto failed = torch::tensor({failure.empty() ? 0L : 1L}, torch::kLong);
  comm_->broadcast(failed);  // also the barrier: nobody goes on before the model is in place
  ST_CHECK(failed.item<int64_t>() == 0, CheckpointError, "exporting the model to '", dir,
           "' failed", comm_->rank() == 0 ? ": " + failure : std::string(" on rank 0 (see its error)"),
           ". Hint: check that run.dir is writable and the disk is not full");
  return ck::exported_model_path(dir);
}

const TrainerState& Trainer::fit() {
  // SIGTERM / SIGINT / SIGHUP only set a flag; the step in progress finishes, every
  // rank agrees (control flags), a checkpoint is written and fit returns.
  const detail::SignalGuard signals(config_.checkpoint.save_on_signal);
  int64_t saved_at = -1;  // step of the last checkpoint written or loaded
  // A restarted job continues from its newest checkpoint unless told never to.
  std::string spec = config_.checkpoint.resume;
  if (spec == "never") spec.clear();
  else if (spec.empty() && restarts_ > 0) spec = "auto";
  // One job per run directory, and never in someone else's files
  // (train/run_dir.h): rank 0 holds the lock for fit unless the process
  // that started this job already does; every rank fails alike.
  const auto run_lock = hold_run_dir(*comm_, config_, /*resuming=*/!spec.empty());
  if (!spec.empty() && !resume(spec).empty()) {
    saved_at = state_.step;  // never rewrite the checkpoint we resumed from
    if (comm_->rank() == 0 && restarts_ > 0) {
      std::printf("resumed from step %lld after restart %d\n", static_cast<long long>(state_.step),
                  restarts_);
      std::fflush(stdout);
    }
  }

  const auto epoch_of = [this](int64_t step) { return task_.epoch_of ? task_.epoch_of(step) : 0; };
  const auto run_evaluation = [this] {
    evaluate();
    for_each_callback([&](Callback& c) { c.on_evaluate(state_, control_, state_.eval_metrics); });
    note_evaluation();
  };
  const auto run_checkpoint = [&] {
    const std::string path = save_checkpoint();
    saved_at = state_.step;
    for_each_callback([&](Callback& c) { c.on_save(state_, control_, path); });
  };

  state_.epoch = epoch_of(state_.step);
  for_each_callback([&](Callback& c) { c.on_train_begin(state_, control_); });
  for_each_callback([&](Callback& c) { c.on_epoch_begin(state_, control_); });
  int64_t evaluated_at = -1;
  while (state_.step < config_.trainer.max_steps && !control_.should_training_stop) {
    const int64_t epoch = epoch_of(state_.step);
    if (epoch != state_.epoch) {
      for_each_callback([&](Callback& c) { c.on_epoch_end(state_, control_); });
      state_.epoch = epoch;
      for_each_callback([&](Callback& c) { c.on_epoch_begin(state_, control_); });
    }
    run_step();
    if (control_.should_log) {
      for_each_callback([&](Callback& c) { c.on_log(state_, control_, state_.metrics); });
    }
    if (control_.should_evaluate) {
      run_evaluation();
      evaluated_at = state_.step;
      agree_on_control();  // an evaluation callback may have asked to stop or save
    }
    if (control_.should_save) run_checkpoint();
  }
  // Every rank takes the same branch below: a signal seen by any rank
  // (perhaps after the last agreement) counts for all.
  {
    auto sig = torch::tensor({static_cast<int64_t>(detail::SignalGuard::received())}, torch::kLong);
    comm_->all_reduce(sig, comm::AllReduceOptions().op(comm::ReduceOp::Max));
    state_.signal = static_cast<int>(sig.item<int64_t>());
  }
  for_each_callback([&](Callback& c) { c.on_epoch_end(state_, control_); });
  if (state_.signal == 0) {
    if (config_.trainer.eval_every > 0 && task_.eval_batch && evaluated_at != state_.step) {
      run_evaluation();
    }
  }
  if (saved_at != state_.step) run_checkpoint();
  // The whole model for `generate` and fine-tuning, converted from the
  // checkpoint just written (LoRA: merged, and the adapter beside it).
  if (state_.signal == 0) export_model(config_.run.dir);
  for_each_callback([&](Callback& c) { c.on_train_end(state_, control_); });
  return state_;
}

}  // namespace shardtrain::train
