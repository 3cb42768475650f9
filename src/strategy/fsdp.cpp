#include "strategy/fsdp.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <unordered_map>
#include <unordered_set>

#include "shardtrain/comm/mesh.h"
#include "shardtrain/core/deferred.h"
#include "shardtrain/core/error.h"
#include "shardtrain/launch/env.h"
#include "shardtrain/strategy/unit.h"
#include "shardtrain/strategy/wrap.h"
#include "strategy/detail.h"
#include "strategy/flat_memory.h"

namespace shardtrain::strategy::detail {

ShardingMode sharding_mode(const StrategyOptions& options) {
  ShardingMode m;
  m.name = options.display_name();
  if (options.strategy() == StrategyKind::Zero1) {
    m.shard_optimizer = true;
    return m;
  }
  ST_CHECK(options.strategy() == StrategyKind::Fsdp, ConfigError, "sharded strategy '",
           enum_name(options.strategy()), "' is not one of zero1, fsdp");
  switch (options.sharding()) {
    case Sharding::HybridShard:
      m.hybrid = true;
      [[fallthrough]];
    case Sharding::FullShard:
      m.shard_params = m.reshard_after_forward = m.shard_grads = m.shard_optimizer = true;
      break;
    case Sharding::ShardGradOp:
      m.shard_params = m.shard_grads = m.shard_optimizer = true;
      break;
    case Sharding::NoShard:
      break;
  }
  return m;
}

// ---- hooks: call back while the strategy lives ----------------------------------------------

namespace {

using Self = std::weak_ptr<ShardedStrategy*>;

template <typename Fn>
void with(const Self& self, Fn&& fn) {
  if (auto s = self.lock()) fn(**s);
}

class ParamReadyHook final : public torch::autograd::FunctionPostHook {
 public:
  ParamReadyHook(Self self, size_t flat, size_t param) : self_(std::move(self)), flat_(flat), param_(param) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    with(self_, [&](ShardedStrategy& s) { s.param_ready(flat_, param_); });
    return outputs;
  }

 private:
  Self self_;
  size_t flat_, param_;
};

// Pre-hook on a parameter's gradient accumulator where whole gradients are
// kept between steps: the window's first gradient clears the last one's.
class ClearStaleHook final : public torch::autograd::FunctionPreHook {
 public:
  ClearStaleHook(Self self, size_t flat) : self_(std::move(self)), flat_(flat) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    with(self_, [&](ShardedStrategy& s) { s.clear_stale(flat_); });
    return grads;
  }

 private:
  Self self_;
  size_t flat_;
};

class UnitHooksImpl final : public UnitHooks {
 public:
  UnitHooksImpl(Self self, size_t unit) : self_(std::move(self)), unit_(unit) {}
  void pre_forward() override {
    with(self_, [&](ShardedStrategy& s) { s.pre_forward(unit_); });
  }
  at::Tensor post_forward(const at::Tensor& output) override {
    at::Tensor out = output;
    with(self_, [&](ShardedStrategy& s) { out = s.post_forward(unit_, output); });
    return out;
  }

 private:
  Self self_;
  size_t unit_;
};

}  // namespace

// ---- set-up -------------------------------------------------------------------------------

ShardedStrategy::ShardedStrategy(StrategyOptions options)
    : options_(std::move(options)), mode_(sharding_mode(options_)) {
  (void)policy_from_options(options_);  // refuses impossible policy values before set-up
}

ShardedStrategy::~ShardedStrategy() {
  self_.reset();
  remove_hooks();
  // Reductions still in flight write into buffers they keep alive.
  if (reducer_) reducer_->drain();
  // Parameters of units left sharded point at released storage: make them
  // empty, so a later use fails with a shape error instead of reading freed
  // memory. (Gathering them back would need every rank here at once.)
  for (const auto& u : units_) {
    if (u.state != Unit::State::Sharded) continue;
    for (size_t f : u.flats) {
      for (auto& p : flats_[f].params) p.var.set_data(at::empty({0}, p.var.options()));
    }
  }
  // The kept mappings go back with the buffers (a later strategy may need other sizes).
  gatherer_.reset();
  reducer_.reset();
  flats_.clear();
  trim_flat_memory();
}

void ShardedStrategy::need_setup(const char* what) const {
  ST_CHECK(model_ != nullptr, InvalidArgument, what,
           " called before setup(); call strategy->setup(model, comm) first");
}

void ShardedStrategy::setup(torch::nn::Module& model, std::shared_ptr<comm::Communicator> comm) {
  ST_CHECK(comm != nullptr, InvalidArgument,
           "sharded setup needs a communicator; pass Communicator::create(CommOptions::from_env())");
  // The whole world is data-parallel; hybrid sharding's nodes come from
  // the ranks per node.
  int local = static_cast<int>(options_.local_world_size());
  if (local <= 0) local = dist::ClusterEnv::detect().local_world_size;
  setup(model, comm::DeviceMesh::create(comm, comm::mesh_shape_for(comm->size(), local, 1, 1, mode_.hybrid)));
}

void ShardedStrategy::setup(torch::nn::Module& model, const comm::DeviceMesh& mesh) {
  ST_CHECK(model_ == nullptr, InvalidArgument, "setup() called twice on one strategy");
  at::NoGradGuard no_grad;
  world_ = mesh.dp();
  {
    std::vector<at::Tensor> tensors;
    std::vector<std::string> names;
    model_tensors(model, tensors, names);
    // Deferred weights are read from their files by every rank alike.
    for (size_t i = tensors.size(); i-- > 0;) {
      if (!is_deferred(tensors[i])) continue;
      tensors.erase(tensors.begin() + static_cast<long>(i));
      names.erase(names.begin() + static_cast<long>(i));
    }
    broadcast_from_rank0(*world_, tensors, names);
  }
  make_groups(mesh);
  build_units(model);
  paths_at_finish_ = comm_paths();  // the first step counts its own collectives only
  model_ = &model;
  gatherer_ = std::make_unique<UnitGatherer>(units_, flats_, shard_comm_.get(),
                                             options_.limit_all_gathers(), clock_);
  reducer_ = mode_.shard_grads
                 ? make_reduce_scatter_reducer(flats_, *shard_comm_, replica_comm_.get(), clock_)
                 : make_all_reduce_reducer(flats_, replica_comm_ ? *replica_comm_ : *shard_comm_, clock_);
  install_hooks();
}

// Who shards with whom, who replicates: the mesh's data-parallel dimensions.
void ShardedStrategy::make_groups(const comm::DeviceMesh& mesh) {
  if (mode_.hybrid) {
    shard_comm_ = mesh.dp_shard();
    replica_comm_ = mesh.dp_replicate();
  } else if (mode_.shard_optimizer) {
    shard_comm_ = world_;
  } else {
    replica_comm_ = world_;  // no_shard: whole copies everywhere
  }
  if (shard_comm_) {
    shard_n_ = shard_comm_->size();
    shard_rank_ = shard_comm_->rank();
  }
}

// Units (wrap.h) and, per unit, one flat per (requires_grad, dtype) group of
// its parameters, in order of first appearance.
void ShardedStrategy::build_units(torch::nn::Module& model) {
  std::unordered_map<std::string, at::Tensor> by_name;
  std::unordered_map<std::string, size_t> order_of;
  for (const auto& item : model.named_parameters(true)) {
    if (by_name.emplace(item.key(), item.value()).second) order_of.emplace(item.key(), order_of.size());
  }
  for (const auto& up : plan_units(model, policy_from_options(options_))) {
    Unit unit;
    unit.name = up.name;
    unit.module = up.module;
    unit.numel = up.numel;
    unit.persistent = up.name.empty() || !mode_.shard_params;
    units_.push_back(std::move(unit));
    std::vector<std::pair<std::pair<bool, at::ScalarType>, std::vector<FlatMember>>> groups;
    bool deferred = false;
    for (const auto& name : up.params) {
      const at::Tensor& t = by_name.at(name);
      deferred = deferred || is_deferred(t);
      ST_CHECK(t.device().is_cpu() && t.layout() == at::kStrided, InvalidArgument,
               "sharded strategies handle dense CPU parameters; '", name, "' is on ", t.device(),
               " with layout ", t.layout());
      const std::pair<bool, at::ScalarType> key{t.requires_grad(), t.scalar_type()};
      auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == key; });
      if (it == groups.end()) it = groups.insert(groups.end(), {key, {}});
      it->second.push_back(FlatMember{name, t, t.sizes().vec(), order_of.at(name), {}});
    }
    for (auto& [key, params] : groups) build_flat(units_.size() - 1, std::move(params), key.first, key.second);
    // A unit whose weights were read as shards starts sharded.
    Unit& made = units_.back();
    if (deferred && !made.persistent) {
      for (size_t f : made.flats) release_storage(flats_[f].full);
      made.state = Unit::State::Sharded;
    }
  }
}

namespace {

// Elements [first, first + out.numel()) of parameter p into `out`:
// deferred parameters (weights still in their files) read just those.
void read_member(const FlatMember& p, int64_t first, const at::Tensor& out) {
  if (is_deferred(p.var)) return read_deferred(p.var, first, out, p.name.c_str());
  out.copy_(p.var.detach().reshape(-1).narrow(0, first, out.numel()));
}

// The flat's values from its parameters: this rank's shard only, or the
// whole flat (`fl.full`) with the shard in it or beside it.
void fill_values(FlatParam& fl, const std::vector<FlatMember>& params, at::ScalarType dtype, bool shard_only,
                 bool shard_in_full) {
  const FlatLayout& l = fl.layout;
  if (shard_only) {
    // Only this rank's shard is read; the unit starts sharded, so no rank
    // ever holds the whole model.
    // Its pages faulted in at once (one by one as the reads land costs more
    // than the reads), then every element written.
    fl.shard = populated_empty(l.shard_numel, dtype);
    int64_t filled = 0;
    for (const auto& p : params) {
      read_member(p, p.slot.param_offset, fl.shard.narrow(0, p.slot.shard_begin, p.slot.shard_count));
      filled = std::max(filled, p.slot.shard_begin + p.slot.shard_count);
    }
    fl.shard.narrow(0, filled, l.shard_numel - filled).zero_();  // the padding
    return;
  }
  // The master values, padded with zeros.
  at::Tensor master = at::zeros({l.padded}, at::TensorOptions().dtype(dtype));
  for (const auto& p : params) read_member(p, 0, master.narrow(0, p.slot.offset, p.slot.numel));
  fl.full.copy_(master);
  fl.shard = shard_in_full ? fl.full.narrow(0, l.shard_offset, l.shard_numel)
                           : master.narrow(0, l.shard_offset, l.shard_numel).clone();
}

// A trainable flat's gradient buffers, and its shard's slices as the
// optimizer sees them, each with its slice of the shard's gradient.
// `whole_from`: whole gradients kept across steps (all-reduced) exist from
// the start, zero-filled, from that group's shared memory; null: none kept,
// or from the pool.
void attach_gradients(FlatParam& fl, bool whole_grads, comm::Communicator* whole_from, bool whole_param,
                      at::ScalarType dtype) {
  const FlatLayout& l = fl.layout;
  if (whole_grads) {
    if (whole_from != nullptr) {
      fl.grad_full = whole_from->allocate(l.padded, fl.compute_dtype);
      fl.grad_unwritten.assign(fl.params.size(), true);
    }
    fl.adopt_grads();
  }
  fl.grad_shard_is_view = whole_grads && fl.compute_dtype == dtype;
  fl.grad_shard = fl.grad_shard_is_view ? fl.grad_full.narrow(0, l.shard_offset, l.shard_numel)
                                        : populated_empty(l.shard_numel, dtype).zero_();
  for (size_t i = 0; i < fl.params.size(); ++i) {
    at::Tensor slice = fl.shard_slice(i, whole_param);
    at::Tensor grad = alias_of(fl.grad_shard, fl.params[i].slot.shard_begin, slice.sizes());
    slice.mutable_grad() = grad;
    fl.opt_params.push_back(slice);
    fl.opt_grads.push_back(grad);
  }
}

}  // namespace

void ShardedStrategy::build_flat(size_t u, std::vector<FlatMember> params, bool trainable,
                                 at::ScalarType dtype) {
  FlatParam fl;
  fl.unit = u;
  fl.trainable = trainable;
  fl.master_dtype = dtype;
  const bool floating = at::isFloatingType(dtype);
  fl.compute_dtype = floating ? scalar_type(options_.param_dtype(), dtype) : dtype;
  fl.reduce_dtype = floating ? scalar_type(options_.reduce_dtype(), fl.compute_dtype) : dtype;
  std::vector<int64_t> numels;
  for (const auto& p : params) numels.push_back(p.var.numel());
  fl.layout = plan_flat(numels, shard_n_, shard_rank_, word_multiple(dtype));
  for (size_t i = 0; i < params.size(); ++i) params[i].slot = fl.layout.slots[i];
  const FlatLayout& l = fl.layout;

  const bool deferred = std::any_of(params.begin(), params.end(), [](const FlatMember& p) {
    return is_deferred(p.var);
  });
  const bool shard_only = deferred && !units_[u].persistent;
  // Flats that stay whole for the run (ZeRO-1's and NO_SHARD's parameters
  // and gradients) live in memory every data-parallel rank maps
  // (Communicator::allocate): the all-reduce of a gradient and the
  // all-gather of the parameters after a step then read the peers' buffers
  // in place, with no staging copies. Flats that come and go per unit
  // (FULL_SHARD, SHARD_GRAD_OP) stay in flat_memory's pool: allocate is
  // collective and holds its memory for the run, which those modes free.
  const bool shared = !mode_.shard_params && at::isFloatingType(fl.compute_dtype);
  // A unit read as shards releases `full` before anything uses it.
  fl.full = shared ? world_->allocate(l.padded, fl.compute_dtype)
                   : flat_empty(l.padded, fl.compute_dtype, /*populate=*/!shard_only);
  fill_values(fl, params, dtype, shard_only, /*shard_in_full=*/!mode_.shard_params && fl.compute_dtype == dtype);
  fl.gather_src = fl.compute_dtype == dtype ? fl.shard : at::empty({l.shard_numel}, fl.full.options());
  for (auto& p : params) p.var.set_data(fl.full.narrow(0, p.slot.offset, p.slot.numel).view(p.shape));
  fl.params = std::move(params);

  if (trainable) {
    attach_gradients(fl, !mode_.shard_grads, shared ? world_.get() : nullptr, shard_n_ == 1, dtype);
    units_[u].trainable_params += static_cast<int>(fl.params.size());
  }
  if (!trainable) units_[u].has_frozen = true;
  units_[u].flats.push_back(flats_.size());
  flats_.push_back(std::move(fl));
}

void ShardedStrategy::install_hooks() {
  self_ = std::make_shared<ShardedStrategy*>(this);
  const Self self = self_;
  for (size_t u = 0; u < units_.size(); ++u) {
    if (units_[u].module != model_) attach_unit_hooks(*units_[u].module, std::make_shared<UnitHooksImpl>(self, u));
  }
  for (size_t f = 0; f < flats_.size(); ++f) {
    if (!flats_[f].trainable) continue;
    for (size_t i = 0; i < flats_[f].params.size(); ++i) {
      auto acc = torch::autograd::impl::grad_accumulator(flats_[f].params[i].var);
      ST_ASSERT(acc != nullptr, "no gradient accumulator for a parameter that requires grad");
      const uintptr_t key = acc->add_post_hook(std::make_unique<ParamReadyHook>(self, f, i));
      if (reducer_->keeps_whole_gradients()) acc->add_pre_hook(std::make_unique<ClearStaleHook>(self, f));
      post_hooks_.push_back({std::move(acc), key});
    }
  }
}

void ShardedStrategy::remove_hooks() {
  for (const auto& u : units_) {
    if (u.module != nullptr && u.module != model_) attach_unit_hooks(*u.module, nullptr);
  }
  for (auto& h : post_hooks_) h.accumulator->del_post_hook(h.key);
  post_hooks_.clear();
}

// ---- forward ------------------------------------------------------------------------------

void ShardedStrategy::pre_forward(size_t u) {
  units_[u].forward_seen = true;
  const bool in_backward = phase_ == Phase::Backward;
  if (!in_backward) units_[u].forward_begin = ++forward_tick_;
  if (!in_backward && torch::GradMode::is_enabled()) gatherer_->record(u);
  gatherer_->gather_now(u);
  if (options_.forward_prefetch() && !in_backward) gatherer_->prefetch(gatherer_->next_in_order(u, +1));
}

at::Tensor ShardedStrategy::post_forward(size_t u, const at::Tensor& output) {
  if (phase_ != Phase::Backward) units_[u].forward_end = ++forward_tick_;
  const bool backward_follows = torch::GradMode::is_enabled() && output.defined() && output.requires_grad();
  if (backward_follows) {
    const Self self = self_;
    output.register_hook([self, u](const at::Tensor&) {
      with(self, [&](ShardedStrategy& s) { s.pre_backward(u); });
    });
  }
  // During backward (a recomputation) the unit's own backward is next. So
  // is the backward of the unit whose forward ran last: it stays gathered.
  const bool last = backward_follows && gatherer_->last_in_order(u);
  if (phase_ != Phase::Backward && (mode_.reshard_after_forward || !backward_follows) && !last &&
      !(keep_gathered_ && backward_follows)) {
    gatherer_->reshard(u);
  }
  return output;
}

// ---- backward -----------------------------------------------------------------------------

void ShardedStrategy::open_window() {
  reducer_->start_window();
  phase_ = Phase::Open;
}

void ShardedStrategy::begin_backward() {
  if (phase_ == Phase::Backward) return;
  if (phase_ == Phase::Closed) open_window();
  phase_ = Phase::Backward;
  const Self self = self_;
  torch::autograd::Engine::get_default_engine().queue_callback(
      [self] { with(self, [](ShardedStrategy& s) { s.end_backward(); }); });
  // Units kept whole (the root) have no pre-backward hook: give them
  // gradient buffers now, so accumulation happens in place.
  for (auto& fl : flats_) {
    if (fl.trainable && units_[fl.unit].persistent) fl.adopt_grads();
  }
}

void ShardedStrategy::end_backward() {
  for (size_t u = 0; u < units_.size(); ++u) {
    if (!keep_gathered_) gatherer_->reshard(u);
    units_[u].ready = 0;
    units_[u].reshard_deferred = false;
  }
  phase_ = Phase::Open;
}

// Backward runs a unit's nodes before any node created before the unit's
// forward began (CPU autograd executes the ready node of the highest
// sequence number, and a node only waits for later-created ones). So when
// unit v's output node is reached, every unit whose forward began after v's
// ended is finished, frozen weights included.
void ShardedStrategy::release_finished_units(size_t v) {
  for (Unit& w : units_) {
    if (!w.reshard_deferred || w.forward_begin <= units_[v].forward_end) continue;
    gatherer_->reshard(static_cast<size_t>(&w - units_.data()));
    w.reshard_deferred = false;
  }
}

void ShardedStrategy::pre_backward(size_t u) {
  begin_backward();
  release_finished_units(u);
  gatherer_->gather_now(u);
  // Gradients kept whole across micro-steps accumulate in place; a new
  // buffer takes each gradient by copy when it is ready (param_ready).
  for (size_t f : units_[u].flats) {
    if (flats_[f].trainable && flats_[f].grad_full.defined()) flats_[f].adopt_grads();
  }
  if (options_.backward_prefetch() == BackwardPrefetch::BackwardPre) {
    gatherer_->prefetch(gatherer_->next_in_order(u, -1));
  }
}

void ShardedStrategy::param_ready(size_t f, size_t p) {
  begin_backward();
  FlatParam& fl = flats_[f];
  fl.adopt_grad(p);
  const size_t u = fl.unit;
  Unit& unit = units_[u];
  if (++unit.ready < unit.trainable_params) return;
  // Every trainable parameter of the unit has its gradient.
  if (options_.backward_prefetch() == BackwardPrefetch::BackwardPost) {
    gatherer_->prefetch(gatherer_->next_in_order(u, -1));
  }
  if (sync_ || reducer_->reduces_every_micro_step(options_.accumulation())) {
    for (size_t g : unit.flats) {
      if (!flats_[g].trainable) continue;
      launch_reduction(g);
    }
  }
  // Frozen weights of the unit may still be needed for its input gradient.
  if (keep_gathered_) return;
  if (unit.has_frozen) {
    unit.reshard_deferred = true;
  } else {
    gatherer_->reshard(u);
  }
}

// Every reduction goes through here, counted and folded into the order check.
void ShardedStrategy::launch_reduction(size_t f) {
  reducer_->launch(f);
  ++collectives_;
  order_hash_ = order_hash_ * 1000003 + static_cast<int64_t>(f) + 1;
}

// ---- finish -------------------------------------------------------------------------------

void ShardedStrategy::finish_gradient_sync() {
  need_setup("finish_gradient_sync");
  if (!sync_) return;  // accumulation micro-step: nothing is final yet
  try {
    // What no hook reduced (units some of whose parameters got no gradient),
    // in plan order, so that every rank issues the same collectives.
    if (phase_ == Phase::Closed) open_window();
    for (size_t f = 0; f < flats_.size(); ++f) {
      if (!flats_[f].trainable || !reducer_->needs_reduction(f)) continue;
      reducer_->clear_stale(f);
      flats_[f].adopt_grads();
      launch_reduction(f);
    }
    reducer_->complete_all();
    check_reduction_order();
  } catch (...) {
    reducer_->drain();
    throw;
  }
  for (auto& fl : flats_) {
    for (size_t i = 0; i < fl.opt_params.size(); ++i) {
      // The optimizer's zero_grad may have replaced or dropped them.
      at::Tensor& g = fl.opt_params[i].mutable_grad();
      if (!g.defined() || g.data_ptr() != fl.opt_grads[i].data_ptr()) g = fl.opt_grads[i];
    }
  }
  phase_ = Phase::Closed;
  if (keep_gathered_) {
    for (size_t u = 0; u < units_.size(); ++u) gatherer_->reshard(u);
  }
  // Finish to finish: this step's gathers, reductions and waits.
  const double busy = comm_busy();
  const comm::Communicator::PathCounts paths = comm_paths();
  last_stats_ = {busy - busy_at_finish_,
                 clock_.exposed_s,
                 clock_.reduced_bytes,
                 clock_.gathered_bytes,
                 paths.in_place - paths_at_finish_.in_place,
                 paths.staged - paths_at_finish_.staged};
  busy_at_finish_ = busy;
  paths_at_finish_ = paths;
  clock_.exposed_s = 0.0;
  clock_.reduced_bytes = clock_.gathered_bytes = 0;
  if (!gatherer_->order_frozen()) {
    check_units_called();
    gatherer_->freeze_order();
  }
}

// Every rank must reduce the same flats in the same order, or collectives
// pair up wrongly (silently, when sizes match). That holds when every rank
// uses the same parameters in each step; this checks it, for one tiny
// all-reduce per step, and names the likely cause.
void ShardedStrategy::check_reduction_order() {
  const int64_t mine = order_hash_;
  order_hash_ = 0;
  if (world_->size() == 1) return;
  auto t = torch::tensor({mine, -mine}, torch::kLong);
  world_->all_reduce(t, comm::AllReduceOptions().op(comm::ReduceOp::Max));
  const auto v = t.accessor<int64_t, 1>();
  ST_CHECK(v[0] == mine && v[1] == -mine, ConfigError,
           "fsdp: the ranks reduced gradients of their units in different orders in this step, so "
           "the reductions were paired wrongly. This happens when some parameters get no gradient "
           "on some ranks only (data-dependent control flow). Every rank must use the same "
           "parameters in each step, or such parameters must be frozen or left to the root unit");
}

void ShardedStrategy::check_units_called() {
  std::string missing;
  for (const auto& u : units_) {
    if (u.module != model_ && !u.forward_seen) missing += (missing.empty() ? "'" : ", '") + u.name + "'";
  }
  ST_CHECK(missing.empty(), ConfigError, "fsdp: unit(s) ", missing,
           " were not called through shardtrain::strategy::unit_forward in the first step, so "
           "their parameters cannot be gathered just in time. Call their forward through "
           "unit_forward (strategy/unit.h), or choose an auto-wrap policy that leaves them to "
           "their parent (distributed.auto_wrap_policy, distributed.wrap_module_types)");
}

double ShardedStrategy::comm_busy() const {
  double s = shard_comm_ ? shard_comm_->busy_seconds() : 0.0;
  if (replica_comm_ && replica_comm_ != shard_comm_) s += replica_comm_->busy_seconds();
  return s;
}

comm::Communicator::PathCounts ShardedStrategy::comm_paths() const {
  comm::Communicator::PathCounts sum;
  for (const auto* c : {shard_comm_.get(), replica_comm_ != shard_comm_ ? replica_comm_.get() : nullptr}) {
    if (c == nullptr) continue;
    const comm::Communicator::PathCounts p = c->path_counts();
    sum.in_place += p.in_place;
    sum.staged += p.staged;
  }
  return sum;
}

// ---- optimizer side and state -------------------------------------------------------------

std::vector<at::Tensor> ShardedStrategy::gradients() {
  need_setup("gradients");
  std::vector<at::Tensor> out;
  for (const auto& fl : flats_) {
    if (fl.trainable) out.push_back(fl.grad_shard);
  }
  return out;
}

double ShardedStrategy::clip_grad_norm(double max_norm) {
  return detail::clip_grad_norm(gradients(), max_norm, shard_comm_.get());
}

void ShardedStrategy::optimizer_step(torch::optim::Optimizer& optimizer) {
  need_setup("optimizer_step");
  optimizer.step();
  gatherer_->refresh_from_shards();
}

void ShardedStrategy::reload_parameters() {
  need_setup("reload_parameters");
  gatherer_->refresh_from_shards();
}

bool ShardedStrategy::primary_params() const {
  if (mode_.hybrid) return replica_comm_->rank() == 0;
  if (!mode_.shard_optimizer) return world_->rank() == 0;
  return true;
}

// The parameters of every flat (or the trainable ones), in the model's
// order, with this rank's shard slice (or the optimizer's view of it).
std::vector<ShardedTensor> ShardedStrategy::in_model_order(bool trainable_only,
                                                           bool optimizer_views) const {
  std::vector<std::pair<size_t, ShardedTensor>> out;
  for (const auto& fl : flats_) {
    if (trainable_only && !fl.trainable) continue;
    for (size_t i = 0; i < fl.params.size(); ++i) {
      const FlatMember& p = fl.params[i];
      ShardedTensor s;
      s.name = p.name;
      s.global_shape = p.shape;
      s.offset = p.slot.param_offset;
      s.local = optimizer_views ? fl.opt_params[i] : fl.shard_slice(i, shard_n_ == 1);
      s.primary = primary_params();
      out.emplace_back(p.order, std::move(s));
    }
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<ShardedTensor> result;
  for (auto& e : out) result.push_back(std::move(e.second));
  return result;
}

std::vector<ShardedTensor> ShardedStrategy::optimizer_parameters() {
  need_setup("optimizer_parameters");
  return in_model_order(/*trainable_only=*/true, /*optimizer_views=*/true);
}

std::vector<ShardedTensor> ShardedStrategy::sharded_state_dict() {
  need_setup("sharded_state_dict");
  // Every parameter (frozen ones too): this rank's slice of its master.
  std::vector<ShardedTensor> result = in_model_order(false, false);
  std::unordered_set<const void*> seen;
  for (const auto& b : model_->named_buffers(true)) {
    if (!b.value().defined() || !seen.insert(b.value().unsafeGetTensorImpl()).second) continue;
    ShardedTensor s;
    s.name = b.key();
    s.global_shape = b.value().sizes().vec();
    s.local = b.value();
    s.primary = world_->rank() == 0;
    s.is_parameter = false;
    result.push_back(std::move(s));
  }
  return result;
}

std::vector<std::pair<std::string, at::Tensor>> ShardedStrategy::full_state_dict() {
  need_setup("full_state_dict");
  at::NoGradGuard no_grad;
  const bool keep = world_->rank() == 0;
  std::unordered_map<const void*, at::Tensor> values;
  for (const auto& fl : flats_) {
    // One flat at a time: the master values of the whole flat, kept on rank 0 only.
    at::Tensor whole = fl.shard;
    if (shard_n_ > 1) {
      whole = at::empty({fl.layout.padded}, at::TensorOptions().dtype(fl.master_dtype));
      shard_comm_->all_gather(as_words(fl.shard), as_words(whole));
    }
    if (!keep) continue;
    for (const auto& p : fl.params) {
      values[p.var.unsafeGetTensorImpl()] = whole.narrow(0, p.slot.offset, p.slot.numel).view(p.shape).clone();
    }
  }
  std::vector<std::pair<std::string, at::Tensor>> out;
  if (!keep) return out;
  for (const auto& p : model_->named_parameters(true)) {
    out.emplace_back(p.key(), values.at(p.value().unsafeGetTensorImpl()));
  }
  for (const auto& b : model_->named_buffers(true)) {
    if (b.value().defined()) out.emplace_back(b.key(), b.value());
  }
  return out;
}

std::vector<std::pair<std::string, int64_t>> ShardedStrategy::units() const {
  std::vector<std::pair<std::string, int64_t>> out;
  for (const auto& u : units_) out.emplace_back(u.name, u.numel);
  return out;
}

}  // namespace shardtrain::strategy::detail
