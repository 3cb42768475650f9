// The Trainer's set-up (named steps, in order) and Trainer::fit, the loop
// every strategy runs under; one step is train/step.cpp.
#include "shardtrain/train/trainer.h"

#include <malloc.h>
#include <unistd.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cmath>
#include <filesystem>
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
#include "shardtrain/strategy/strategy.h"
#include "shardtrain/train/callbacks.h"
#include "shardtrain/train/plan.h"
#include "train/balance.h"
#include "train/config_digest.h"
#include "train/fused_adamw.h"
#include "train/lora.h"
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

// Tensor parallelism, before the data-parallel strategy plans over the
// parameters: each rank keeps its blocks of the split layers (a QLoRA base
// is quantized per block after).
parallel::TensorParallelLayout split_for_tensor_parallel(TrainTask& task, const config::Config& config,
                                                         const comm::DeviceMesh& mesh, bool whole_model) {
  parallel::TensorParallelLayout layout = parallel::apply_tensor_parallel(
      *task.model, models::family_of(config.model.type).tensor_parallel_plan(), mesh.tp(),
      parallel::TensorParallelOptions()
          .sequence_parallel(config.distributed.sequence_parallel())
          .loss_parallel(config.distributed.loss_parallel())
          .whole_model(whole_model));
  detail::quantize_lora(*task.model, config);
  return layout;
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
  set_up_mesh(env);
  set_up_load_balance(env);
  set_up_precision();
  // Fine-tuning: weights from a safetensors file or a Hugging Face directory
  // (the family's names and layouts). Checked here; make_task built the
  // model deferred, so the strategy reads each tensor, or only the slices a
  // rank keeps, from the files in its setup (every rank reads them).
  detail::load_init_weights(*task_.model, config_);
  set_up_pipeline();
  set_up_strategy(env);
  check_pipeline_schedule();
  set_up_callbacks();
}

void Trainer::set_up_mesh(const dist::ClusterEnv& env) {
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
  if (comm_->rank() == 0) {
    const std::string warning = blas_coretype_warning();
    if (!warning.empty()) std::fprintf(stderr, "warning: %s\n", warning.c_str());
  }
}

void Trainer::set_up_load_balance(const dist::ClusterEnv& env) {
  // The shares of each step's batch: equal under load_balance even; under
  // measured distributed.shares, else each data-parallel rank's threads, so
  // hosts of different core counts start apart.
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

void Trainer::set_up_precision() {
  // `auto` is decided once, here: everything after (memory plans, the
  // strategy's dtypes, checkpoints, the run's config.yaml) sees what runs.
  // On a CPU with native bf16, whether its bf16 GEMMs outrun fp32 ones is
  // measured, and the ranks average their figures so that all decide alike.
  const precision::ResolvedPrecision resolved =
      precision::resolve_precision_measured(config_.precision, torch::cuda::is_available(), comm_.get());
  config_.precision = resolved.kind;
  precision_reason_ = resolved.reason;
  precision_ = precision::Precision::create(config_.precision, config_.loss_scaler, torch::cuda::is_available());
}

void Trainer::set_up_pipeline() {
  // Each rank keeps its stages' modules (a deferred model's other weights
  // are never read).
  if (mesh_->shape().pp() == 1) return;
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
  run_window_ = &Trainer::pipeline_window;
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

void Trainer::set_up_strategy(const dist::ClusterEnv& env) {
  // LoRA: freeze the (loaded) base and attach the adapters before anything
  // plans over the parameters. Under tensor parallelism the adapters split
  // with their layers, and a quantized base is quantized per block after.
  const bool tensor_parallel = mesh_->shape().tp() > 1;
  detail::prepare_lora(*task_.model, config_, /*quantize=*/!tensor_parallel, /*stage_part=*/pipeline_ != nullptr);
  std::optional<parallel::TensorParallelLayout> tp_layout;
  if (tensor_parallel) tp_layout = split_for_tensor_parallel(task_, config_, *mesh_, pipeline_ == nullptr);
  // After QLoRA's quantization of a base built whole, which returns the
  // fp32 base first; before the strategy reads deferred weights, whose
  // per-tensor scratch memory is then reused instead of mapped afresh.
  keep_freed_memory();
  detail::FrozenBase base = detail::frozen_base(*task_.model, config_);
  frozen_names_ = std::move(base.names);
  base_identity_ = std::move(base.identity);
  reference_base_ = base.referenced;
  precision_->prepare_model(*task_.model);

  strategy::StrategyOptions so = strategy_options(config_, *task_.model, comm_->size(), env.local_world_size);
  // Interleaved: a rank's other stages finish their backward before the
  // step's last one, so their gradients are reduced with the last, as
  // parameters that took no part in it.
  if (pipeline_ && pipeline_->local_stages().size() > 1) so.find_unused_parameters(true);
  strategy_ = strategy::make_strategy(so);
  if (tp_layout) strategy_ = parallel::tensor_parallel_strategy(std::move(strategy_), std::move(*tp_layout), mesh_->tp());
  if (pipeline_) strategy_ = pipeline_->wrap(std::move(strategy_));
  strategy_->setup(*task_.model, *mesh_);
  // A stage's forwards and backwards of the window's micro-batches
  // interleave: its units stay gathered for the step (sharded strategies).
  if (pipeline_) strategy_->keep_gathered_in_step(true);
  // After setup: the optimizer must see the parameters as the strategy left them.
  optimizer_ = make_optimizer(strategy_->optimizer_parameters(), config_.optimizer);
}

void Trainer::check_pipeline_schedule() {
  if (!pipeline_) return;
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

void Trainer::set_up_callbacks() {
  // What every callback sees of the run, then the built-in callbacks.
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
  const std::string spec = resume_spec();
  // One job per run directory, and never in someone else's files
  // (train/run_dir.h): rank 0 holds the lock for fit unless the process
  // that started this job already does; every rank fails alike.
  const auto run_lock = hold_run_dir(*comm_, config_, /*resuming=*/!spec.empty());
  FitMarks marks;
  if (!spec.empty() && !resume(spec).empty()) {
    marks.saved_at = state_.step;  // never rewrite the checkpoint we resumed from
    if (comm_->rank() == 0 && restarts_ > 0) {
      std::printf("resumed from step %lld after restart %d\n", static_cast<long long>(state_.step), restarts_);
      std::fflush(stdout);
    }
  }
  train_steps(marks);
  finish_fit(marks);
  return state_;
}

std::string Trainer::resume_spec() const {
  // A restarted job continues from its newest checkpoint unless told never to.
  const std::string& spec = config_.checkpoint.resume;
  if (spec == "never") return "";
  if (spec.empty() && restarts_ > 0) return "auto";
  return spec;
}

void Trainer::train_steps(FitMarks& marks) {
  const auto epoch_of = [this](int64_t step) { return task_.epoch_of ? task_.epoch_of(step) : 0; };
  state_.epoch = epoch_of(state_.step);
  for_each_callback([&](Callback& c) { c.on_train_begin(state_, control_); });
  for_each_callback([&](Callback& c) { c.on_epoch_begin(state_, control_); });
  while (state_.step < config_.trainer.max_steps && !control_.should_training_stop) {
    const int64_t epoch = epoch_of(state_.step);
    if (epoch != state_.epoch) {
      for_each_callback([&](Callback& c) { c.on_epoch_end(state_, control_); });
      state_.epoch = epoch;
      for_each_callback([&](Callback& c) { c.on_epoch_begin(state_, control_); });
    }
    run_step();
    if (control_.should_log) for_each_callback([&](Callback& c) { c.on_log(state_, control_, state_.metrics); });
    if (control_.should_evaluate) {
      evaluate_now(marks);
      agree_on_control();  // an evaluation callback may have asked to stop or save
    }
    if (control_.should_save) checkpoint_now(marks);
  }
}

void Trainer::finish_fit(FitMarks& marks) {
  // Every rank takes the same branch below: a signal seen by any rank
  // (perhaps after the last agreement) counts for all.
  auto sig = torch::tensor({static_cast<int64_t>(detail::SignalGuard::received())}, torch::kLong);
  comm_->all_reduce(sig, comm::AllReduceOptions().op(comm::ReduceOp::Max));
  state_.signal = static_cast<int>(sig.item<int64_t>());
  for_each_callback([&](Callback& c) { c.on_epoch_end(state_, control_); });
  if (state_.signal == 0 && config_.trainer.eval_every > 0 && task_.eval_batch && marks.evaluated_at != state_.step) {
    evaluate_now(marks);
  }
  if (marks.saved_at != state_.step) checkpoint_now(marks);
  // The whole model for `generate` and fine-tuning, converted from the
  // checkpoint just written (LoRA: merged, and the adapter beside it).
  if (state_.signal == 0) export_model(config_.run.dir);
  for_each_callback([&](Callback& c) { c.on_train_end(state_, control_); });
}

void Trainer::evaluate_now(FitMarks& marks) {
  evaluate();
  for_each_callback([&](Callback& c) { c.on_evaluate(state_, control_, state_.eval_metrics); });
  note_evaluation();
  marks.evaluated_at = state_.step;
}

void Trainer::checkpoint_now(FitMarks& marks) {
  const std::string path = save_checkpoint();
  marks.saved_at = state_.step;
  for_each_callback([&](Callback& c) { c.on_save(state_, control_, path); });
}

}  // namespace shardtrain::train
