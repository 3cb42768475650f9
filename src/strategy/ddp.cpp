// DDP: whole model on every rank, gradients averaged over ranks in buckets.
//
// setup (once):  broadcast parameters and buffers from rank 0; plan buckets
//                (reverse registration order, greedy by bytes, one dtype and
//                one flat buffer each); install a post-hook on every
//                parameter's gradient accumulator.
// backward:      each hook copies its gradient into its bucket view; when a
//                bucket is full and every earlier bucket was launched, its
//                async all_reduce(Avg) starts while backward keeps running.
// finish:        fill in unused parameters (or name them in an error), launch
//                what is left, wait bucket by bucket and copy back to grad().
//
// Where a bucket's dtype is the parameters' (the default: fp32 reduced in
// fp32), each grad() is an alias of its place in the bucket, so the hook's
// copy and the copy back are skipped; a gradient replaced by the user falls
// back to the copies.
//
// Buckets are launched strictly in index order, so every rank issues the same
// collectives in the same order even when hooks fire in a different order.
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <chrono>

#include "shardtrain/core/deferred.h"
#include "shardtrain/core/error.h"
#include "strategy/detail.h"

namespace shardtrain::strategy::detail {

std::vector<std::vector<size_t>> plan_buckets(const std::vector<at::Tensor>& tensors,
                                              int64_t first_bucket_bytes,
                                              int64_t bucket_cap_bytes) {
  std::vector<std::vector<size_t>> buckets;
  std::vector<size_t> current;
  int64_t current_bytes = 0;
  at::ScalarType current_dtype = at::kFloat;
  for (size_t k = tensors.size(); k-- > 0;) {
    const int64_t bytes = tensors[k].numel() * static_cast<int64_t>(tensors[k].element_size());
    const int64_t cap = buckets.empty() ? first_bucket_bytes : bucket_cap_bytes;
    if (!current.empty() &&
        (tensors[k].scalar_type() != current_dtype || current_bytes + bytes > cap)) {
      buckets.push_back(std::move(current));
      current.clear();
      current_bytes = 0;
    }
    if (current.empty()) current_dtype = tensors[k].scalar_type();
    current.push_back(k);
    current_bytes += bytes;
  }
  if (!current.empty()) buckets.push_back(std::move(current));
  return buckets;
}

// ---- the reducer: per-step state, touched by hooks and by finish ---------------------

class Reducer {
 public:
  Reducer(std::shared_ptr<comm::Communicator> comm, NamedParams params,
          const StrategyOptions& options)
      : comm_(std::move(comm)),
        names_(std::move(params.names)),
        params_(std::move(params.tensors)),
        find_unused_(options.find_unused_parameters()) {
    const auto plan = plan_buckets(params_, mib_to_bytes(options.first_bucket_mb()),
                                   mib_to_bytes(options.bucket_cap_mb()));
    views_.resize(params_.size());
    bucket_of_.resize(params_.size());
    for (const auto& members : plan) {
      Bucket b;
      int64_t numel = 0;
      for (size_t i : members) numel += params_[i].numel();
      const auto& first = params_[members.front()];
      // Gradients are reduced in the configured dtype (fp32 by default, so
      // bf16 gradients are summed in fp32); copies in and out convert. On
      // the CPU the bucket comes from the communicator, so that where ranks
      // share this host the all_reduce works on the buckets in place.
      const at::ScalarType dtype = scalar_type(options.reduce_dtype(), first.scalar_type());
      b.flat = first.device().is_cpu() ? comm_->allocate(numel, dtype)
                                       : at::zeros({numel}, first.options().dtype(dtype).requires_grad(false));
      int64_t offset = 0;
      for (size_t i : members) {
        const auto& p = params_[i];
        views_[i] = b.flat.narrow(0, offset, p.numel()).view(p.sizes());
        bucket_of_[i] = buckets_.size();
        offset += p.numel();
      }
      // Each gradient lives in its bucket when the dtypes agree: backward
      // accumulates straight into it and the reduced result needs no copy
      // back. A storage alias (set_), not a view: zero_grad() detaches it.
      if (b.flat.scalar_type() == first.scalar_type()) {
        at::NoGradGuard no_grad;
        for (size_t i : members) {
          at::Tensor& g = params_[i].mutable_grad();
          at::Tensor alias = at::empty({0}, b.flat.options());
          alias.set_(b.flat.storage(), views_[i].storage_offset(), views_[i].sizes(), views_[i].strides());
          if (g.defined()) alias.copy_(g);
          g = alias;
        }
      }
      b.params = members;
      b.bytes = numel * static_cast<int64_t>(first.element_size());
      bucket_params_.push_back(static_cast<int>(members.size()));
      buckets_.push_back(std::move(b));
    }
    pending_ = bucket_params_;
    ready_.assign(params_.size(), 0);
    works_.resize(buckets_.size());
    allreduce_options_ = comm::AllReduceOptions().op(comm::ReduceOp::Avg).async(true);
  }

  // From the gradient accumulator's post-hook: param.grad() now holds this
  // backward's gradient (plus what earlier non-syncing micro-steps added).
  void mark_ready(size_t i) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!sync_) return;  // accumulation micro-step: grads just accumulate
    ST_CHECK(!ready_[i], Error, "DDP: parameter '", names_[i],
             "' received a second gradient in the same synchronising step. Call "
             "finish_gradient_sync() after each backward that synchronises, and "
             "set_gradient_sync(false) for the accumulation micro-steps before it");
    ready_[i] = 1;
    fill_view(i);
    if (--pending_[bucket_of_[i]] == 0) launch_ready_buckets(/*from_hook=*/true);
  }

  void set_sync(bool enabled) {
    std::lock_guard<std::mutex> lock(mu_);
    sync_ = enabled;
  }

  void finish() {
    std::lock_guard<std::mutex> lock(mu_);
    if (!sync_) return;  // documented no-op: nothing was reduced
    try {
      // Parameters whose hook did not fire in this backward.
      size_t missing = 0;
      for (size_t i = 0; i < params_.size(); ++i) missing += ready_[i] ? 0 : 1;
      if (missing > 0 && !find_unused_) throw_unused(missing);
      if (missing > 0) {
        // Their accumulated gradient (earlier micro-steps) or zeros: every
        // rank launches the same buckets, whatever it used.
        for (size_t i = 0; i < params_.size(); ++i) {
          if (ready_[i]) continue;
          ready_[i] = 1;
          fill_view(i);
          --pending_[bucket_of_[i]];
        }
      }
      launch_ready_buckets(/*from_hook=*/false);
      ST_ASSERT(next_launch_ == buckets_.size(), "bucket ", next_launch_, " of ", buckets_.size(),
                " still has ", pending_[next_launch_], " parameters pending");
      // Wait in order; copying bucket b back overlaps the reduction of b+1.
      at::NoGradGuard no_grad;
      for (size_t b = 0; b < buckets_.size(); ++b) {
        works_[b].wait();
        for (size_t i : buckets_[b].params) {
          if (in_bucket(i)) continue;
          at::Tensor& g = params_[i].mutable_grad();
          if (g.defined()) {
            g.copy_(views_[i]);
          } else {
            g = views_[i].clone();  // only for a parameter no rank-local grad existed for
          }
        }
      }
    } catch (...) {
      drain_and_reset();
      throw;
    }
    reset();
  }

  int64_t collectives() const { return collectives_.load(); }
  /// Bytes of the buckets all-reduced so far.
  int64_t bytes() const { return bytes_.load(); }
  int64_t launched_in_backward() const { return in_backward_.load(); }
  size_t num_buckets() const { return buckets_.size(); }
  std::vector<std::string> bucket_names(size_t b) const {
    std::vector<std::string> out;
    for (size_t i : buckets_.at(b).params) out.push_back(names_[i]);
    return out;
  }
  const std::vector<at::Tensor>& params() const { return params_; }

 private:
  // Whether parameter i's gradient is (still) its bucket's memory.
  bool in_bucket(size_t i) const {
    const at::Tensor& g = params_[i].grad();
    return g.defined() && g.data_ptr() == views_[i].data_ptr();
  }

  void fill_view(size_t i) {
    if (in_bucket(i)) return;
    at::NoGradGuard no_grad;
    const at::Tensor& g = params_[i].grad();
    if (g.defined()) {
      views_[i].copy_(g);
    } else {
      views_[i].zero_();
    }
  }

  // Launches buckets in index order, as far as they are complete.
  void launch_ready_buckets(bool from_hook) {
    while (next_launch_ < buckets_.size() && pending_[next_launch_] == 0) {
      works_[next_launch_] = comm_->all_reduce(buckets_[next_launch_].flat, allreduce_options_);
      bytes_ += buckets_[next_launch_].flat.nbytes();
      ++collectives_;
      if (from_hook) ++in_backward_;
      ++next_launch_;
    }
  }

  [[noreturn]] void throw_unused(size_t missing) {
    std::string list;
    size_t listed = 0;
    for (size_t i = 0; i < params_.size() && listed < 8; ++i) {
      if (ready_[i]) continue;
      list += (listed++ ? ", '" : "'") + names_[i] + "'";
    }
    if (missing > listed) list += " and " + std::to_string(missing - listed) + " more";
    throw Error(::shardtrain::detail::str_cat(
        "DDP: ", missing, " parameter(s) received no gradient in this step: ", list,
        ". Every parameter that requires grad must take part in the loss of a synchronising "
        "backward. If some are legitimately unused, set distributed.find_unused_parameters: true "
        "(StrategyOptions::find_unused_parameters), or call requires_grad_(false) on them before "
        "setup"));
  }

  // After an error: wait for what was launched (the ranks issued it too), so
  // no reduction still writes into a bucket, and start the next step clean.
  void drain_and_reset() {
    for (size_t b = 0; b < next_launch_; ++b) {
      try {
        works_[b].wait();
      } catch (...) {
      }
    }
    reset();
  }

  void reset() {
    std::fill(ready_.begin(), ready_.end(), 0);
    std::copy(bucket_params_.begin(), bucket_params_.end(), pending_.begin());
    for (auto& w : works_) w = comm::Work();
    next_launch_ = 0;
  }

  std::mutex mu_;
  std::shared_ptr<comm::Communicator> comm_;
  std::vector<std::string> names_;
  std::vector<at::Tensor> params_;
  bool find_unused_;

  std::vector<Bucket> buckets_;
  std::vector<at::Tensor> views_;     // per parameter, shaped like it, into its bucket
  std::vector<size_t> bucket_of_;     // per parameter
  std::vector<int> bucket_params_;    // per bucket: how many parameters
  comm::AllReduceOptions allreduce_options_;

  // Per-step state, reset by finish().
  std::vector<int> pending_;          // per bucket: parameters not yet ready
  std::vector<char> ready_;           // per parameter
  std::vector<comm::Work> works_;     // per bucket
  size_t next_launch_ = 0;
  bool sync_ = true;

  std::atomic<int64_t> collectives_{0};
  std::atomic<int64_t> bytes_{0};
  std::atomic<int64_t> in_backward_{0};
};

namespace {

// Post-hook on a parameter's AccumulateGrad node. Holds the reducer weakly:
// a graph that outlives the strategy then finds it gone and does nothing.
class ReadyHook final : public torch::autograd::FunctionPostHook {
 public:
  ReadyHook(std::weak_ptr<Reducer> reducer, size_t index)
      : reducer_(std::move(reducer)), index_(index) {}

  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    if (auto r = reducer_.lock()) r->mark_ready(index_);
    return outputs;
  }

 private:
  std::weak_ptr<Reducer> reducer_;
  size_t index_;
};

}  // namespace

// ---- DDPStrategy -----------------------------------------------------------------------

struct HookHandle {
  std::shared_ptr<torch::autograd::Node> accumulator;  // held, or the hook never fires
  uintptr_t key;                                       // for del_post_hook
};

DDPStrategy::DDPStrategy(StrategyOptions options) : options_(std::move(options)) {}

DDPStrategy::~DDPStrategy() { remove_hooks(); }

void DDPStrategy::remove_hooks() {
  for (auto& h : hooks_) h.accumulator->del_post_hook(h.key);
  hooks_.clear();
}

void DDPStrategy::setup(torch::nn::Module& model, std::shared_ptr<comm::Communicator> comm) {
  ST_CHECK(comm != nullptr, InvalidArgument,
           "DDP setup needs a communicator; pass Communicator::create(CommOptions::from_env())");
  comm_ = std::move(comm);
  model_ = &model;

  // 1. Same starting point on every rank: parameters and buffers from rank 0
  //    (weights still in their files are read first: every rank keeps them whole).
  materialize(model);
  {
    std::vector<at::Tensor> tensors;
    std::vector<std::string> names;
    model_tensors(model, tensors, names);
    broadcast_from_rank0(*comm_, tensors, names);
  }

  // 2. Buckets, planned once.
  auto named = trainable_parameters(model);
  for (const auto& p : named.tensors) {
    ST_CHECK(p.device().is_cpu() && p.layout() == at::kStrided, InvalidArgument,
             "DDP here handles dense CPU parameters; got one on ", p.device(),
             " with layout ", p.layout());
  }
  auto reducer = std::make_shared<Reducer>(comm_, std::move(named), options_);

  // 3. Hooks on the gradient accumulators (replacing those of an earlier setup).
  std::vector<HookHandle> handles;
  const auto& params = reducer->params();
  for (size_t i = 0; i < params.size(); ++i) {
    auto acc = torch::autograd::impl::grad_accumulator(params[i]);
    ST_ASSERT(acc != nullptr, "no gradient accumulator for a leaf that requires grad");
    const uintptr_t key = acc->add_post_hook(std::make_unique<ReadyHook>(reducer, i));
    handles.push_back({std::move(acc), key});
  }
  remove_hooks();
  hooks_ = std::move(handles);
  reducer_ = std::move(reducer);
  paths_at_finish_ = comm_->path_counts();  // the first step counts its own collectives only
  params_ = reducer_->params();
}

void DDPStrategy::set_gradient_sync(bool enabled) {
  if (reducer_) reducer_->set_sync(enabled);
}

void DDPStrategy::finish_gradient_sync() {
  ST_CHECK(reducer_ != nullptr, InvalidArgument,
           "finish_gradient_sync called before setup(); call strategy->setup(model, comm) first");
  // What backward did not hide: the wait for the buckets (and their copy back).
  const auto start = std::chrono::steady_clock::now();
  reducer_->finish();
  const double busy = comm_->busy_seconds();
  stats_.exposed_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  stats_.busy_s = busy - busy_at_finish_;
  busy_at_finish_ = busy;
  stats_.reduced_bytes = reducer_->bytes() - bytes_at_finish_;
  bytes_at_finish_ = reducer_->bytes();
  const comm::Communicator::PathCounts paths = comm_->path_counts();
  stats_.in_place_ops = paths.in_place - paths_at_finish_.in_place;
  stats_.staged_ops = paths.staged - paths_at_finish_.staged;
  paths_at_finish_ = paths;
}

double DDPStrategy::clip_grad_norm(double max_norm) {
  ST_CHECK(reducer_ != nullptr, InvalidArgument,
           "clip_grad_norm called before setup(); call strategy->setup(model, comm) first");
  // Gradients are identical on every rank after finish_gradient_sync, so the
  // local norm is the global norm and every rank clips by the same factor.
  return detail::clip_grad_norm(defined_grads(params_), max_norm);
}

void DDPStrategy::optimizer_step(torch::optim::Optimizer& optimizer) { optimizer.step(); }

std::vector<ShardedTensor> DDPStrategy::optimizer_parameters() {
  ST_CHECK(model_ != nullptr, InvalidArgument, "optimizer_parameters called before setup()");
  return whole_optimizer_parameters(*model_, comm_->rank());
}

std::vector<ShardedTensor> DDPStrategy::sharded_state_dict() {
  ST_CHECK(model_ != nullptr, InvalidArgument, "sharded_state_dict called before setup()");
  return whole_model_state(*model_, comm_->rank());
}

std::vector<std::pair<std::string, at::Tensor>> DDPStrategy::full_state_dict() {
  ST_CHECK(model_ != nullptr, InvalidArgument, "full_state_dict called before setup()");
  return whole_state_dict(*model_, comm_->rank());
}

int64_t DDPStrategy::gradient_collectives() const {
  return reducer_ ? reducer_->collectives() : 0;
}

size_t DDPStrategy::num_buckets() const { return reducer_ ? reducer_->num_buckets() : 0; }

std::vector<std::string> DDPStrategy::bucket_parameter_names(size_t b) const {
  ST_CHECK(reducer_ != nullptr, InvalidArgument, "bucket_parameter_names called before setup()");
  return reducer_->bucket_names(b);
}

int64_t DDPStrategy::buckets_launched_in_backward() const {
  return reducer_ ? reducer_->launched_in_backward() : 0;
}

}  // namespace shardtrain::strategy::detail
