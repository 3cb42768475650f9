// ZeRO-1 and FSDP: one engine, configured by a ShardingMode.
//
// Per unit (wrap.h), each (requires_grad, dtype) group of its parameters is
// one flat buffer `full`, padded to a multiple of the shard group's size n;
// the module's parameters are views of it. Rank r keeps elements
// [r*S, (r+1)*S), S = padded/n, as its master `shard` (the optimizer steps
// per-parameter slices of it). Per step:
//
//   forward   pre_forward(u): gather u (all_gather shard -> full), perhaps
//             prefetch the next unit; post_forward(u): free u's full buffer
//             (FULL_SHARD) and hook the output so backward gathers it again.
//   backward  pre_backward(u) (output hook): gather u, point its parameters'
//             .grad at a flat gradient buffer, prefetch the next unit (in
//             backward order, BACKWARD_PRE). When every trainable parameter
//             of u has its gradient (accumulator post-hooks): reduce
//             (reduce-scatter into the shard, or all-reduce the whole
//             gradient) asynchronously, and free u's full buffer.
//   finish    reduce what no hook reduced, wait, accumulate into grad shards.
//   step      the optimizer updates the shards; units kept whole (the root,
//             everything under zero1 / no_shard) are gathered again.
//
// Every collective is issued from the training thread in an order that is
// the same on every rank (the forward and backward orders are), and runs on
// the communicator's own thread, overlapping compute.
#include "strategy/fsdp.h"

#include <ATen/native/Resize.h>
#include <sys/mman.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <unordered_map>
#include <unordered_set>

#include "shardtrain/core/error.h"
#include "shardtrain/dist/env.h"
#include "shardtrain/strategy/unit.h"
#include "shardtrain/strategy/wrap.h"
#include "strategy/detail.h"

namespace shardtrain::strategy::detail {

// ---- memory: flat buffers straight from mmap ----------------------------------------------

namespace {

std::atomic<int64_t> g_live_bytes{0};
std::atomic<int64_t> g_peak_bytes{0};

struct MappedBlock {
  void* data;
  size_t bytes;
};

void unmap_block(void* ctx) {
  auto* block = static_cast<MappedBlock*>(ctx);
  munmap(block->data, block->bytes);
  g_live_bytes -= static_cast<int64_t>(block->bytes);
  delete block;
}

class FlatAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t bytes) const override {
    if (bytes == 0) return {nullptr, nullptr, &c10::detail::deleteNothing, c10::Device(c10::kCPU)};
    void* data = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    ST_CHECK(data != MAP_FAILED, Error, "out of memory: cannot map ", bytes,
             " bytes for a flat parameter or gradient buffer; use a sharding mode that keeps "
             "less (distributed.sharding: full_shard), more ranks, or a smaller model");
    const int64_t live = g_live_bytes += static_cast<int64_t>(bytes);
    int64_t peak = g_peak_bytes.load();
    while (live > peak && !g_peak_bytes.compare_exchange_weak(peak, live)) {
    }
    return {data, new MappedBlock{data, bytes}, &unmap_block, c10::Device(c10::kCPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
};

FlatAllocator& flat_allocator() {
  static FlatAllocator allocator;
  return allocator;
}

// A 1-D tensor of `numel` elements whose storage comes from mmap and can be
// released and re-grown in place (views of it stay valid across both).
at::Tensor flat_empty(int64_t numel, at::ScalarType dtype) {
  const size_t bytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
  c10::Storage storage(c10::Storage::use_byte_size_t(), bytes, &flat_allocator(),
                       /*resizable=*/true);
  return at::empty({0}, at::TensorOptions().dtype(dtype)).set_(storage, 0, {numel}, {1});
}

void release_storage(const at::Tensor& flat) {
  at::native::resize_bytes_cpu(flat.storage().unsafeGetStorageImpl(), 0);
}

void regrow_storage(const at::Tensor& flat) {
  at::native::resize_bytes_cpu(flat.storage().unsafeGetStorageImpl(),
                               static_cast<size_t>(flat.numel()) * flat.element_size());
}

// `numel` elements of `flat` from `offset`, shaped `shape`, sharing its
// storage but not an autograd view of it: gradients must be plain tensors,
// because optimizers detach_() them in zero_grad(), which views refuse.
at::Tensor alias_of(const at::Tensor& flat, int64_t offset, at::IntArrayRef shape) {
  return at::empty({0}, flat.options()).set_(flat.storage(), flat.storage_offset() + offset, shape);
}

bool has_storage(const at::Tensor& flat) {
  return flat.storage().nbytes() >= static_cast<size_t>(flat.numel()) * flat.element_size();
}

using Clock = std::chrono::steady_clock;

}  // namespace

FlatMemoryStats flat_memory_stats() { return {g_live_bytes.load(), g_peak_bytes.load()}; }

void reset_flat_memory_peak() { g_peak_bytes = g_live_bytes.load(); }

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

// ---- the engine ---------------------------------------------------------------------------

namespace {

struct ParamInfo {
  std::string name;
  at::Tensor var;  // the module's parameter (its data becomes a view of `full`)
  int64_t offset = 0;
  int64_t numel = 0;
  std::vector<int64_t> shape;
  size_t order = 0;  // position in the model's named_parameters()
  // Its part of this rank's shard: elements [shard_begin, shard_begin +
  // shard_count) of the shard hold its elements from param_offset on.
  int64_t shard_begin = 0, shard_count = 0, param_offset = 0;
};

struct Flat {
  size_t unit = 0;
  bool trainable = false;
  at::ScalarType master_dtype = at::kFloat;
  at::ScalarType compute_dtype = at::kFloat;
  at::ScalarType reduce_dtype = at::kFloat;
  std::vector<ParamInfo> params;
  int64_t numel = 0, padded = 0, shard_numel = 0, shard_offset = 0;

  at::Tensor full;        // compute dtype, [padded]; released while sharded
  at::Tensor shard;       // master dtype, [shard_numel]; a view of full when they coincide
  at::Tensor gather_src;  // what all_gather sends: shard, or its compute-dtype copy
  at::Tensor grad_full;   // compute dtype, [padded]; the parameters' .grad are views of it
  at::Tensor grad_shard;  // master dtype, [shard_numel]: the optimizer's gradients
  bool grad_shard_is_view = false;
  std::vector<at::Tensor> opt_params;  // per parameter: its slice of shard
  std::vector<at::Tensor> opt_grads;   // per parameter: its slice of grad_shard

  bool claimed = false;      // a reduction of this window writes grad_shard directly
  bool accumulated = false;  // grad_shard holds this window's sum so far
  bool reduced = false;      // reduced since the last finish
  bool stale = false;        // grad_full still holds the last window's gradients
};

struct Unit {
  std::string name;
  const torch::nn::Module* module = nullptr;
  int64_t numel = 0;
  std::vector<size_t> flats;
  bool persistent = false;  // kept whole: the root, or every unit when parameters are not sharded
  enum class State { Sharded, Gathering, Gathered } state = State::Gathered;
  std::vector<comm::Work> gathers;
  bool forward_seen = false;
  int trainable_params = 0;
  int ready = 0;
};

struct Reduction {
  size_t flat = 0;
  comm::Work work;
  at::Tensor src;  // kept alive until the reduction finished
  at::Tensor out;
  bool direct = false;  // out is grad_shard itself
};

class ParamReadyHook final : public torch::autograd::FunctionPostHook {
 public:
  ParamReadyHook(std::weak_ptr<ShardedEngine> engine, size_t flat, size_t param)
      : engine_(std::move(engine)), flat_(flat), param_(param) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override;

 private:
  std::weak_ptr<ShardedEngine> engine_;
  size_t flat_, param_;
};

// Pre-hook on a parameter's gradient accumulator under zero1 / no_shard:
// the first gradient of a window into a flat clears what the last window
// left there (whole gradients stay allocated between steps).
class ClearStaleHook final : public torch::autograd::FunctionPreHook {
 public:
  ClearStaleHook(std::weak_ptr<ShardedEngine> engine, size_t flat)
      : engine_(std::move(engine)), flat_(flat) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override;

 private:
  std::weak_ptr<ShardedEngine> engine_;
  size_t flat_;
};

struct PostHookHandle {
  std::shared_ptr<torch::autograd::Node> accumulator;
  uintptr_t key;
};

}  // namespace

class ShardedEngine : public std::enable_shared_from_this<ShardedEngine> {
 public:
  ShardedEngine(StrategyOptions options, ShardingMode mode)
      : options_(std::move(options)), mode_(std::move(mode)) {}

  ~ShardedEngine() {
    for (const auto& u : units_) {
      if (u.module != nullptr && u.module != model_) attach_unit_hooks(*u.module, nullptr);
    }
    for (auto& h : post_hooks_) h.accumulator->del_post_hook(h.key);
    // Reductions still in flight write into buffers they keep alive.
    drain();
    // Parameters of units left sharded point at released storage: make them
    // empty, so a later use fails with a shape error instead of reading freed
    // memory. (Gathering them back would need every rank here at once.)
    for (const auto& u : units_) {
      if (u.state != Unit::State::Sharded) continue;
      for (size_t f : u.flats) {
        for (auto& p : flats_[f].params) p.var.set_data(at::empty({0}, p.var.options()));
      }
    }
  }

  // After an error: wait for what was issued (without rethrowing) and forget it.
  void drain() {
    for (auto* queue : {&pending_, &replica_pending_}) {
      for (auto& r : *queue) {
        try {
          r.work.wait();
        } catch (...) {
        }
      }
      queue->clear();
    }
  }

  void setup(torch::nn::Module& model, std::shared_ptr<comm::Communicator> world);
  void install_hooks();

  // hooks
  void pre_forward(size_t u);
  at::Tensor post_forward(size_t u, const at::Tensor& output);
  void pre_backward(size_t u);
  void param_ready(size_t f, size_t p);
  void end_backward();
  void clear_stale(size_t f);

  // strategy
  void set_sync(bool enabled) { sync_ = enabled; }
  void finish();
  std::vector<ShardedTensor> optimizer_parameters();
  std::vector<at::Tensor> gradients();
  double clip(double max_norm);
  void after_optimizer_step();
  std::vector<ShardedTensor> sharded_state_dict();
  std::vector<std::pair<std::string, at::Tensor>> full_state_dict();
  void reload();

  int64_t collectives() const { return collectives_; }
  int64_t prefetches() const { return prefetches_; }
  int max_in_flight() const { return max_in_flight_; }
  CommStats stats() const { return last_stats_; }
  std::vector<std::pair<std::string, int64_t>> unit_list() const {
    std::vector<std::pair<std::string, int64_t>> out;
    for (const auto& u : units_) out.emplace_back(u.name, u.numel);
    return out;
  }

 private:
  void build_flat(size_t unit, std::vector<ParamInfo> params, bool trainable, at::ScalarType dtype);
  void issue_gather(size_t u);
  void wait_gather(size_t u);
  void gather_now(size_t u);
  void prefetch(long u);
  void reshard(size_t u);
  void begin_backward();
  void ensure_grad_views(size_t f);
  void adopt_grad(Flat& fl, const ParamInfo& p);
  bool reduce_in_backward() const;
  void launch_reduction(size_t f);
  void complete_front();
  void fold(const Reduction& r);
  void complete_all();
  void check_reduction_order();
  void start_window();
  void wait_timed(const comm::Work& w);
  long next_in_order(size_t u, int direction) const;
  bool primary_params() const;
  // The parameters of the flats `which` selects, in the model's order, with
  // `local` as each one's tensor.
  std::vector<ShardedTensor> in_model_order(
      const std::function<bool(const Flat&)>& which,
      const std::function<at::Tensor(const Flat&, size_t)>& local) const;
  // p's elements in this rank's master shard (its own shape when whole).
  at::Tensor shard_slice(const Flat& fl, const ParamInfo& p) const {
    at::Tensor slice = fl.shard.narrow(0, p.shard_begin, p.shard_count);
    return shard_n_ == 1 ? slice.view(p.shape) : slice;
  }
  double comm_busy() const {
    double s = shard_comm_ ? shard_comm_->busy_seconds() : 0.0;
    if (replica_comm_ && replica_comm_ != shard_comm_) s += replica_comm_->busy_seconds();
    return s;
  }

  StrategyOptions options_;
  ShardingMode mode_;
  torch::nn::Module* model_ = nullptr;
  std::shared_ptr<comm::Communicator> world_, shard_comm_, replica_comm_;
  int shard_n_ = 1, shard_rank_ = 0;

  std::vector<Unit> units_;
  std::vector<Flat> flats_;
  std::vector<PostHookHandle> post_hooks_;
  std::vector<size_t> order_;  // units in forward execution order (first step)
  std::vector<long> position_;  // unit -> index in order_, -1 if absent
  bool order_frozen_ = false;

  bool sync_ = true;
  bool in_backward_ = false;
  bool window_open_ = false;  // gradients of the current window exist
  std::deque<Reduction> pending_;          // reductions in flight, in launch order
  std::deque<Reduction> replica_pending_;  // hybrid: inter-node averages in flight
  int in_flight_ = 0;
  int max_in_flight_ = 0;
  int64_t prefetches_ = 0;
  int64_t collectives_ = 0;
  int64_t order_hash_ = 0;  // of the flats reduced since the last finish, in launch order
  double exposed_s_ = 0.0;
  double busy_at_finish_ = 0.0;
  CommStats last_stats_;
  bool checked_units_ = false;
};

namespace {

torch::autograd::variable_list ClearStaleHook::operator()(
    const torch::autograd::variable_list& grads) {
  if (auto e = engine_.lock()) e->clear_stale(flat_);
  return grads;
}

torch::autograd::variable_list ParamReadyHook::operator()(
    const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
  if (auto e = engine_.lock()) e->param_ready(flat_, param_);
  return outputs;
}

class UnitHooksImpl final : public UnitHooks {
 public:
  UnitHooksImpl(std::weak_ptr<ShardedEngine> engine, size_t unit)
      : engine_(std::move(engine)), unit_(unit) {}
  void pre_forward() override {
    if (auto e = engine_.lock()) e->pre_forward(unit_);
  }
  at::Tensor post_forward(const at::Tensor& output) override {
    if (auto e = engine_.lock()) return e->post_forward(unit_, output);
    return output;
  }

 private:
  std::weak_ptr<ShardedEngine> engine_;
  size_t unit_;
};

}  // namespace

// ---- setup --------------------------------------------------------------------------------

void ShardedEngine::setup(torch::nn::Module& model, std::shared_ptr<comm::Communicator> world) {
  at::NoGradGuard no_grad;
  model_ = &model;
  world_ = std::move(world);
  {
    std::vector<at::Tensor> tensors;
    std::vector<std::string> names;
    model_tensors(model, tensors, names);
    broadcast_from_rank0(*world_, tensors, names);
  }

  // Groups: who shards with whom, who replicates.
  const int n = world_->size();
  if (mode_.hybrid) {
    int local = static_cast<int>(options_.local_world_size());
    if (local <= 0) local = dist::ClusterEnv::detect().local_world_size;
    ST_CHECK(local >= 1 && n % local == 0, ConfigError, "hybrid_shard needs the world size (", n,
             ") to be a multiple of the ranks per node (", local,
             "); start the same number of ranks on every node (LOCAL_WORLD_SIZE)");
    const int nodes = n / local;
    for (int k = 0; k < nodes; ++k) {
      std::vector<int> ranks;
      for (int j = 0; j < local; ++j) ranks.push_back(k * local + j);
      if (auto g = world_->new_group(ranks)) shard_comm_ = g;
    }
    for (int j = 0; j < local; ++j) {
      std::vector<int> ranks;
      for (int k = 0; k < nodes; ++k) ranks.push_back(k * local + j);
      if (auto g = world_->new_group(ranks)) replica_comm_ = g;
    }
  } else if (mode_.shard_optimizer) {
    shard_comm_ = world_;
  } else {
    replica_comm_ = world_;  // no_shard: whole copies everywhere
  }
  if (shard_comm_) {
    shard_n_ = shard_comm_->size();
    shard_rank_ = shard_comm_->rank();
  }

  // Units and their flat buffers.
  std::unordered_map<std::string, at::Tensor> by_name;
  std::unordered_map<std::string, size_t> order_of;
  for (const auto& item : model.named_parameters(true)) {
    if (by_name.emplace(item.key(), item.value()).second) order_of.emplace(item.key(), order_of.size());
  }
  const auto plan = plan_units(model, policy_from_options(options_));
  for (const auto& up : plan) {
    Unit unit;
    unit.name = up.name;
    unit.module = up.module;
    unit.numel = up.numel;
    unit.persistent = up.name.empty() || !mode_.shard_params;
    units_.push_back(std::move(unit));
    const size_t u = units_.size() - 1;
    // One flat per (requires_grad, dtype), in order of first appearance.
    std::vector<std::pair<std::pair<bool, at::ScalarType>, std::vector<ParamInfo>>> groups;
    for (const auto& name : up.params) {
      const at::Tensor& t = by_name.at(name);
      ST_CHECK(t.device().is_cpu() && t.layout() == at::kStrided, InvalidArgument,
               "sharded strategies handle dense CPU parameters; '", name, "' is on ", t.device(),
               " with layout ", t.layout());
      ParamInfo p;
      p.name = name;
      p.var = t;
      p.numel = t.numel();
      p.shape = t.sizes().vec();
      p.order = order_of.at(name);
      const std::pair<bool, at::ScalarType> key{t.requires_grad(), t.scalar_type()};
      auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == key; });
      if (it == groups.end()) {
        groups.push_back({key, {}});
        it = groups.end() - 1;
      }
      it->second.push_back(std::move(p));
    }
    for (auto& [key, params] : groups) build_flat(u, std::move(params), key.first, key.second);
  }
  position_.assign(units_.size(), -1);
}

void ShardedEngine::build_flat(size_t u, std::vector<ParamInfo> params, bool trainable,
                               at::ScalarType dtype) {
  Flat fl;
  fl.unit = u;
  fl.trainable = trainable;
  fl.master_dtype = dtype;
  const bool floating = at::isFloatingType(dtype);
  fl.compute_dtype = floating ? scalar_type(options_.param_dtype(), dtype) : dtype;
  fl.reduce_dtype = floating ? scalar_type(options_.reduce_dtype(), fl.compute_dtype) : dtype;
  for (auto& p : params) {
    p.offset = fl.numel;
    fl.numel += p.numel;
  }
  fl.padded = (fl.numel + shard_n_ - 1) / shard_n_ * shard_n_;
  fl.shard_numel = fl.padded / shard_n_;
  fl.shard_offset = static_cast<int64_t>(shard_rank_) * fl.shard_numel;
  for (auto& p : params) {
    const int64_t shard_end = fl.shard_offset + fl.shard_numel;
    const int64_t lo = std::min(std::max(p.offset, fl.shard_offset), shard_end);
    const int64_t hi = std::max(std::min(p.offset + p.numel, shard_end), lo);
    p.shard_begin = lo - fl.shard_offset;
    p.shard_count = hi - lo;
    p.param_offset = p.shard_count > 0 ? lo - p.offset : 0;
  }

  // The master values, padded with zeros.
  at::Tensor master = at::zeros({fl.padded}, at::TensorOptions().dtype(dtype));
  for (const auto& p : params) master.narrow(0, p.offset, p.numel).copy_(p.var.detach().reshape(-1));
  fl.full = flat_empty(fl.padded, fl.compute_dtype);
  fl.full.copy_(master);
  const bool shard_in_full = !mode_.shard_params && fl.compute_dtype == dtype;
  fl.shard = shard_in_full ? fl.full.narrow(0, fl.shard_offset, fl.shard_numel)
                           : master.narrow(0, fl.shard_offset, fl.shard_numel).clone();
  fl.gather_src = fl.compute_dtype == dtype ? fl.shard : at::empty({fl.shard_numel}, fl.full.options());
  master = at::Tensor();
  for (auto& p : params) p.var.set_data(fl.full.narrow(0, p.offset, p.numel).view(p.shape));

  if (trainable) {
    if (!mode_.shard_grads) {
      // zero1 / no_shard: whole gradients, all-reduced, kept across steps.
      fl.grad_full = flat_empty(fl.padded, fl.compute_dtype);
    }
    fl.grad_shard_is_view = !mode_.shard_grads && fl.compute_dtype == dtype;
    fl.grad_shard = fl.grad_shard_is_view
                        ? fl.grad_full.narrow(0, fl.shard_offset, fl.shard_numel)
                        : at::zeros({fl.shard_numel}, at::TensorOptions().dtype(dtype));
    for (const auto& p : params) {
      at::Tensor slice = shard_slice(fl, p);
      at::Tensor grad = alias_of(fl.grad_shard, p.shard_begin, slice.sizes());
      slice.mutable_grad() = grad;
      fl.opt_params.push_back(slice);
      fl.opt_grads.push_back(grad);
    }
    units_[u].trainable_params += static_cast<int>(params.size());
  }
  fl.params = std::move(params);
  units_[u].flats.push_back(flats_.size());
  flats_.push_back(std::move(fl));
  if (flats_.back().grad_full.defined()) ensure_grad_views(flats_.size() - 1);
}

void ShardedEngine::install_hooks() {
  const std::weak_ptr<ShardedEngine> self = shared_from_this();
  for (size_t u = 0; u < units_.size(); ++u) {
    if (units_[u].module != model_) {
      attach_unit_hooks(*units_[u].module, std::make_shared<UnitHooksImpl>(self, u));
    }
  }
  for (size_t f = 0; f < flats_.size(); ++f) {
    if (!flats_[f].trainable) continue;
    for (size_t i = 0; i < flats_[f].params.size(); ++i) {
      auto acc = torch::autograd::impl::grad_accumulator(flats_[f].params[i].var);
      ST_ASSERT(acc != nullptr, "no gradient accumulator for a parameter that requires grad");
      const uintptr_t key = acc->add_post_hook(std::make_unique<ParamReadyHook>(self, f, i));
      if (!mode_.shard_grads) acc->add_pre_hook(std::make_unique<ClearStaleHook>(self, f));
      post_hooks_.push_back({std::move(acc), key});
    }
  }
}

// ---- gathering ----------------------------------------------------------------------------

void ShardedEngine::wait_timed(const comm::Work& w) {
  if (w.is_completed()) {
    w.wait();
    return;
  }
  const auto start = Clock::now();
  w.wait();
  exposed_s_ += std::chrono::duration<double>(Clock::now() - start).count();
}

void ShardedEngine::issue_gather(size_t u) {
  Unit& unit = units_[u];
  ST_ASSERT(unit.state == Unit::State::Sharded, "unit gathered twice");
  at::NoGradGuard no_grad;
  for (size_t f : unit.flats) {
    Flat& fl = flats_[f];
    if (!has_storage(fl.full)) regrow_storage(fl.full);
    if (!fl.gather_src.is_same(fl.shard)) fl.gather_src.copy_(fl.shard);
    unit.gathers.push_back(
        shard_comm_->all_gather(fl.gather_src, fl.full, comm::AllGatherOptions().async(true)));
  }
  unit.state = Unit::State::Gathering;
  max_in_flight_ = std::max(max_in_flight_, ++in_flight_);
}

void ShardedEngine::wait_gather(size_t u) {
  Unit& unit = units_[u];
  for (auto& w : unit.gathers) wait_timed(w);
  unit.gathers.clear();
  unit.state = Unit::State::Gathered;
  --in_flight_;
}

void ShardedEngine::gather_now(size_t u) {
  if (units_[u].state == Unit::State::Sharded) issue_gather(u);
  if (units_[u].state == Unit::State::Gathering) wait_gather(u);
}

void ShardedEngine::prefetch(long u) {
  if (u < 0 || units_[static_cast<size_t>(u)].state != Unit::State::Sharded) return;
  if (in_flight_ >= options_.limit_all_gathers()) return;
  issue_gather(static_cast<size_t>(u));
  ++prefetches_;
}

void ShardedEngine::reshard(size_t u) {
  Unit& unit = units_[u];
  if (unit.persistent || unit.state == Unit::State::Sharded) return;
  if (unit.state == Unit::State::Gathering) wait_gather(u);
  for (size_t f : unit.flats) release_storage(flats_[f].full);
  unit.state = Unit::State::Sharded;
}

long ShardedEngine::next_in_order(size_t u, int direction) const {
  if (!order_frozen_ || position_[u] < 0) return -1;
  const long next = position_[u] + direction;
  if (next < 0 || next >= static_cast<long>(order_.size())) return -1;
  return static_cast<long>(order_[static_cast<size_t>(next)]);
}

// ---- forward hooks ------------------------------------------------------------------------

void ShardedEngine::pre_forward(size_t u) {
  Unit& unit = units_[u];
  unit.forward_seen = true;
  if (!order_frozen_ && !in_backward_ && torch::GradMode::is_enabled() && position_[u] < 0) {
    position_[u] = static_cast<long>(order_.size());
    order_.push_back(u);
  }
  gather_now(u);
  if (options_.forward_prefetch() && !in_backward_) prefetch(next_in_order(u, +1));
}

at::Tensor ShardedEngine::post_forward(size_t u, const at::Tensor& output) {
  const bool backward_follows =
      torch::GradMode::is_enabled() && output.defined() && output.requires_grad();
  if (backward_follows) {
    std::weak_ptr<ShardedEngine> self = shared_from_this();
    output.register_hook([self, u](const at::Tensor&) {
      if (auto e = self.lock()) e->pre_backward(u);
    });
  }
  // During backward (a recomputation) the unit's own backward is next.
  if (!in_backward_ && (mode_.reshard_after_forward || !backward_follows)) reshard(u);
  return output;
}

// ---- backward hooks -----------------------------------------------------------------------

void ShardedEngine::start_window() {
  // First backward after a finish (or ever): drop the last window's sums.
  window_open_ = true;
  for (auto& fl : flats_) fl.claimed = fl.accumulated = false;
}

void ShardedEngine::clear_stale(size_t f) {
  Flat& fl = flats_[f];
  if (!fl.stale) return;
  fl.grad_full.zero_();
  fl.stale = false;
}

void ShardedEngine::begin_backward() {
  if (in_backward_) return;
  in_backward_ = true;
  if (!window_open_) start_window();
  std::weak_ptr<ShardedEngine> self = shared_from_this();
  torch::autograd::Engine::get_default_engine().queue_callback([self] {
    if (auto e = self.lock()) e->end_backward();
  });
  // Units kept whole (the root) have no pre-backward hook: give them
  // gradient buffers now, so accumulation happens in place.
  for (size_t f = 0; f < flats_.size(); ++f) {
    if (flats_[f].trainable && units_[flats_[f].unit].persistent) ensure_grad_views(f);
  }
}

void ShardedEngine::ensure_grad_views(size_t f) {
  Flat& fl = flats_[f];
  if (!fl.grad_full.defined()) fl.grad_full = flat_empty(fl.padded, fl.compute_dtype);  // zeros
  for (const auto& p : fl.params) adopt_grad(fl, p);
}

// Makes p's .grad a view of the flat gradient buffer, keeping its value.
void ShardedEngine::adopt_grad(Flat& fl, const ParamInfo& p) {
  at::Tensor& g = p.var.mutable_grad();
  at::Tensor view = alias_of(fl.grad_full, p.offset, p.shape);
  if (g.defined() && g.data_ptr() == view.data_ptr()) return;
  if (g.defined()) view.add_(g);
  g = view;
}

void ShardedEngine::pre_backward(size_t u) {
  begin_backward();
  gather_now(u);
  for (size_t f : units_[u].flats) {
    if (flats_[f].trainable) ensure_grad_views(f);
  }
  if (options_.backward_prefetch() == BackwardPrefetch::BackwardPre) prefetch(next_in_order(u, -1));
}

bool ShardedEngine::reduce_in_backward() const {
  if (mode_.shard_grads && options_.accumulation() == Accumulation::Sharded) return true;  // every micro-step
  return sync_;
}

void ShardedEngine::param_ready(size_t f, size_t p) {
  begin_backward();
  Flat& fl = flats_[f];
  if (!fl.grad_full.defined()) fl.grad_full = flat_empty(fl.padded, fl.compute_dtype);
  adopt_grad(fl, fl.params[p]);
  const size_t u = fl.unit;
  Unit& unit = units_[u];
  if (++unit.ready < unit.trainable_params) return;
  // Every trainable parameter of the unit has its gradient.
  if (options_.backward_prefetch() == BackwardPrefetch::BackwardPost) prefetch(next_in_order(u, -1));
  if (reduce_in_backward()) {
    for (size_t g : unit.flats) {
      if (flats_[g].trainable) launch_reduction(g);
    }
  }
  reshard(u);
}

void ShardedEngine::end_backward() {
  for (size_t u = 0; u < units_.size(); ++u) {
    reshard(u);
    units_[u].ready = 0;
  }
  in_backward_ = false;
}

// ---- reductions: the one place that picks reduce-scatter or all-reduce --------------------

void ShardedEngine::launch_reduction(size_t f) {
  Flat& fl = flats_[f];
  at::NoGradGuard no_grad;
  Reduction r;
  r.flat = f;
  r.src = fl.reduce_dtype == fl.compute_dtype ? fl.grad_full : fl.grad_full.to(fl.reduce_dtype);
  const auto avg = comm::ReduceOp::Avg;
  if (mode_.shard_grads) {
    r.direct = !fl.claimed && fl.reduce_dtype == fl.master_dtype;
    fl.claimed = true;
    r.out = r.direct ? fl.grad_shard
                     : at::empty({fl.shard_numel}, at::TensorOptions().dtype(fl.reduce_dtype));
    r.work = shard_comm_->reduce_scatter(r.src, r.out,
                                         comm::ReduceScatterOptions().op(avg).async(true));
    // The whole gradient lives on only in r.src until the reduction is done.
    fl.grad_full = at::Tensor();
    for (auto& p : fl.params) p.var.mutable_grad() = at::Tensor();
  } else {
    r.out = r.src;
    r.work = replica_comm_ ? replica_comm_->all_reduce(r.src, comm::AllReduceOptions().op(avg).async(true))
             : shard_comm_->all_reduce(r.src, comm::AllReduceOptions().op(avg).async(true));
  }
  fl.reduced = true;
  ++collectives_;
  order_hash_ = order_hash_ * 1000003 + static_cast<int64_t>(f) + 1;
  pending_.push_back(std::move(r));
  // Finished reductions are folded in at once; at most two stay in flight
  // with their whole-gradient buffers (bounded memory under sharding).
  while (!pending_.empty() &&
         (pending_.front().work.is_completed() || (mode_.shard_grads && pending_.size() > 2))) {
    complete_front();
  }
}

void ShardedEngine::complete_front() {
  Reduction r = std::move(pending_.front());
  pending_.pop_front();
  wait_timed(r.work);
  if (mode_.shard_grads && replica_comm_ && replica_comm_->size() > 1) {
    // hybrid: average the shard over the nodes too. Never waited for before
    // finish: a rank blocked on the inter-node group while its node peers
    // wait for it on the intra-node group could close a cycle of waits.
    r.src = at::Tensor();
    r.work = replica_comm_->all_reduce(r.out,
                                       comm::AllReduceOptions().op(comm::ReduceOp::Avg).async(true));
    replica_pending_.push_back(std::move(r));
    return;
  }
  fold(r);
}

void ShardedEngine::fold(const Reduction& r) {
  Flat& fl = flats_[r.flat];
  at::NoGradGuard no_grad;
  if (mode_.shard_grads) {
    if (!r.direct) {
      if (fl.accumulated) {
        fl.grad_shard.add_(r.out);
      } else {
        fl.grad_shard.copy_(r.out);
      }
    }
  } else {
    if (!r.src.is_same(fl.grad_full)) fl.grad_full.copy_(r.src);
    if (!fl.grad_shard_is_view) fl.grad_shard.copy_(fl.grad_full.narrow(0, fl.shard_offset, fl.shard_numel));
  }
  fl.accumulated = true;
}

void ShardedEngine::complete_all() {
  while (!pending_.empty()) complete_front();
  while (!replica_pending_.empty()) {
    Reduction r = std::move(replica_pending_.front());
    replica_pending_.pop_front();
    wait_timed(r.work);
    fold(r);
  }
}

// Every rank must reduce the same flats in the same order, or collectives
// pair up wrongly (silently, when sizes match). That holds when every rank
// uses the same parameters in each step; this checks it, for one tiny
// all-reduce per step, and names the likely cause.
void ShardedEngine::check_reduction_order() {
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

void ShardedEngine::finish() {
  if (!sync_) return;  // accumulation micro-step: nothing is final yet
  try {
    // What no hook reduced (units some of whose parameters got no gradient),
    // in plan order, so that every rank issues the same collectives.
    if (!window_open_) start_window();
    for (size_t f = 0; f < flats_.size(); ++f) {
      Flat& fl = flats_[f];
      if (!fl.trainable) continue;
      const bool has_grads = fl.grad_full.defined();
      if (fl.reduced && !has_grads) continue;
      if (!mode_.shard_grads && fl.reduced) continue;
      clear_stale(f);
      ensure_grad_views(f);
      launch_reduction(f);
    }
    complete_all();
    check_reduction_order();
  } catch (...) {
    drain();
    throw;
  }
  for (auto& fl : flats_) {
    fl.reduced = false;
    fl.stale = fl.trainable && !mode_.shard_grads;
    for (size_t i = 0; i < fl.opt_params.size(); ++i) {
      // The optimizer's zero_grad may have replaced or dropped them.
      at::Tensor& g = fl.opt_params[i].mutable_grad();
      if (!g.defined() || g.data_ptr() != fl.opt_grads[i].data_ptr()) g = fl.opt_grads[i];
    }
  }
  window_open_ = false;
  // Finish to finish: this step's gathers, reductions and waits.
  const double busy = comm_busy();
  last_stats_.busy_s = busy - busy_at_finish_;
  last_stats_.exposed_s = exposed_s_;
  busy_at_finish_ = busy;
  exposed_s_ = 0.0;
  if (!checked_units_) {
    checked_units_ = true;
    std::string missing;
    for (const auto& u : units_) {
      if (u.module != model_ && !u.forward_seen) missing += (missing.empty() ? "'" : ", '") + u.name + "'";
    }
    ST_CHECK(missing.empty(), ConfigError, "fsdp: unit(s) ", missing,
             " were not called through shardtrain::strategy::unit_forward in the first step, so "
             "their parameters cannot be gathered just in time. Call their forward through "
             "unit_forward (strategy/unit.h), or choose an auto-wrap policy that leaves them to "
             "their parent (distributed.auto_wrap_policy, distributed.wrap_module_types)");
    order_frozen_ = true;
  }
}

// ---- optimizer side -----------------------------------------------------------------------

bool ShardedEngine::primary_params() const {
  if (mode_.hybrid) return replica_comm_->rank() == 0;
  if (!mode_.shard_optimizer) return world_->rank() == 0;
  return true;
}

std::vector<ShardedTensor> ShardedEngine::in_model_order(
    const std::function<bool(const Flat&)>& which,
    const std::function<at::Tensor(const Flat&, size_t)>& local) const {
  std::vector<std::pair<size_t, ShardedTensor>> out;
  for (const auto& fl : flats_) {
    if (!which(fl)) continue;
    for (size_t i = 0; i < fl.params.size(); ++i) {
      const ParamInfo& p = fl.params[i];
      ShardedTensor s;
      s.name = p.name;
      s.global_shape = p.shape;
      s.offset = p.param_offset;
      s.local = local(fl, i);
      s.primary = primary_params();
      out.emplace_back(p.order, std::move(s));
    }
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<ShardedTensor> result;
  for (auto& e : out) result.push_back(std::move(e.second));
  return result;
}

std::vector<ShardedTensor> ShardedEngine::optimizer_parameters() {
  return in_model_order([](const Flat& fl) { return fl.trainable; },
                        [](const Flat& fl, size_t i) { return fl.opt_params[i]; });
}

std::vector<at::Tensor> ShardedEngine::gradients() {
  std::vector<at::Tensor> out;
  for (const auto& fl : flats_) {
    if (fl.trainable) out.push_back(fl.grad_shard);
  }
  return out;
}

double ShardedEngine::clip(double max_norm) {
  return clip_grad_norm(gradients(), max_norm, shard_comm_.get());
}

void ShardedEngine::after_optimizer_step() { reload(); }

void ShardedEngine::reload() {
  at::NoGradGuard no_grad;
  std::vector<size_t> regather;
  for (size_t u = 0; u < units_.size(); ++u) {
    Unit& unit = units_[u];
    if (unit.state == Unit::State::Gathering) wait_gather(u);
    if (!unit.persistent && unit.state == Unit::State::Sharded) continue;  // gathered on use
    if (!shard_comm_ || shard_n_ == 1) {
      for (size_t f : unit.flats) {
        Flat& fl = flats_[f];
        if (!fl.shard.is_same(fl.full) && fl.shard.data_ptr() != fl.full.data_ptr()) fl.full.copy_(fl.shard);
      }
      continue;
    }
    // Whole units: all-gather the updated shards (async, all issued first).
    unit.state = Unit::State::Sharded;
    issue_gather(u);
    regather.push_back(u);
  }
  for (size_t u : regather) wait_gather(u);
}

std::vector<ShardedTensor> ShardedEngine::sharded_state_dict() {
  // Every parameter (frozen ones too): this rank's slice of its master.
  std::vector<ShardedTensor> result =
      in_model_order([](const Flat&) { return true; },
                     [this](const Flat& fl, size_t i) { return shard_slice(fl, fl.params[i]); });
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

std::vector<std::pair<std::string, at::Tensor>> ShardedEngine::full_state_dict() {
  at::NoGradGuard no_grad;
  const bool keep = world_->rank() == 0;
  std::unordered_map<const void*, at::Tensor> values;
  for (const auto& fl : flats_) {
    // One flat at a time: the master values of the whole flat, kept on rank 0 only.
    at::Tensor whole;
    if (shard_n_ == 1) {
      whole = fl.shard;
    } else {
      whole = at::empty({fl.padded}, at::TensorOptions().dtype(fl.master_dtype));
      shard_comm_->all_gather(fl.shard, whole);
    }
    if (!keep) continue;
    for (const auto& p : fl.params) {
      values[p.var.unsafeGetTensorImpl()] = whole.narrow(0, p.offset, p.numel).view(p.shape).clone();
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

// ---- ShardedStrategy ----------------------------------------------------------------------

ShardedStrategy::ShardedStrategy(StrategyOptions options)
    : options_(std::move(options)), mode_(sharding_mode(options_)) {
  (void)policy_from_options(options_);  // validates the policy's name early
}

ShardedStrategy::~ShardedStrategy() = default;

void ShardedStrategy::setup(torch::nn::Module& model, std::shared_ptr<comm::Communicator> comm) {
  ST_CHECK(comm != nullptr, InvalidArgument,
           "sharded setup needs a communicator; pass Communicator::create(CommOptions::from_env())");
  auto engine = std::make_shared<ShardedEngine>(options_, mode_);
  engine->setup(model, std::move(comm));
  engine->install_hooks();
  engine_ = std::move(engine);
}

#define ST_NEED_SETUP(what) \
  ST_CHECK(engine_ != nullptr, InvalidArgument, what, " called before setup(); call strategy->setup(model, comm) first")

void ShardedStrategy::set_gradient_sync(bool enabled) {
  if (engine_) engine_->set_sync(enabled);
}

void ShardedStrategy::finish_gradient_sync() {
  ST_NEED_SETUP("finish_gradient_sync");
  engine_->finish();
}

std::vector<ShardedTensor> ShardedStrategy::optimizer_parameters() {
  ST_NEED_SETUP("optimizer_parameters");
  return engine_->optimizer_parameters();
}

std::vector<at::Tensor> ShardedStrategy::gradients() {
  ST_NEED_SETUP("gradients");
  return engine_->gradients();
}

double ShardedStrategy::clip_grad_norm(double max_norm) {
  ST_NEED_SETUP("clip_grad_norm");
  return engine_->clip(max_norm);
}

void ShardedStrategy::optimizer_step(torch::optim::Optimizer& optimizer) {
  ST_NEED_SETUP("optimizer_step");
  optimizer.step();
  engine_->after_optimizer_step();
}

std::vector<ShardedTensor> ShardedStrategy::sharded_state_dict() {
  ST_NEED_SETUP("sharded_state_dict");
  return engine_->sharded_state_dict();
}

std::vector<std::pair<std::string, at::Tensor>> ShardedStrategy::full_state_dict() {
  ST_NEED_SETUP("full_state_dict");
  return engine_->full_state_dict();
}

void ShardedStrategy::reload_parameters() {
  ST_NEED_SETUP("reload_parameters");
  engine_->reload();
}

std::string ShardedStrategy::name() const { return mode_.name; }

int64_t ShardedStrategy::gradient_collectives() const {
  return engine_ ? engine_->collectives() : 0;
}

CommStats ShardedStrategy::comm_stats() const { return engine_ ? engine_->stats() : CommStats{}; }

std::vector<std::pair<std::string, int64_t>> ShardedStrategy::units() const {
  return engine_ ? engine_->unit_list() : std::vector<std::pair<std::string, int64_t>>{};
}

int64_t ShardedStrategy::prefetches() const { return engine_ ? engine_->prefetches() : 0; }

int ShardedStrategy::max_gathers_in_flight() const {
  return engine_ ? engine_->max_in_flight() : 0;
}

}  // namespace shardtrain::strategy::detail
