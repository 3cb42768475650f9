// ZeRO-1 and FSDP (FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD): one
// strategy over flat parameters (flat_param.h), configured once at set-up by
// the sharding mode: which units stay whole (unit_gather.h) and how gradients
// are reduced (grad_reducer.h). Internal, visible to tests; not public API.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "shardtrain/comm/communicator.h"
#include "shardtrain/strategy/strategy.h"
#include "strategy/flat_param.h"
#include "strategy/grad_reducer.h"
#include "strategy/unit_gather.h"

namespace torch::autograd {
struct Node;
}

namespace shardtrain::strategy::detail {

/// What a sharding mode keeps of parameters, gradients and optimizer state.
struct ShardingMode {
  std::string name;                    // "zero1", "fsdp/full_shard", ...
  bool shard_params = false;           // between steps only the shard is kept (units gathered on use)
  bool reshard_after_forward = false;  // free a unit's parameters after its forward too
  bool shard_grads = false;            // reduce-scatter into shards (else all-reduce whole gradients)
  bool shard_optimizer = false;        // the optimizer steps this rank's shard only
  bool hybrid = false;                 // shard within a node, replicate across nodes
};

/// The mode for StrategyOptions (zero1, or fsdp with its sharding).
ShardingMode sharding_mode(const StrategyOptions& options);

/// Per step:
///
///   forward   pre_forward(u): gather u, perhaps prefetch the next unit;
///             post_forward(u): free u (FULL_SHARD) and hook the output so
///             that backward gathers it again.
///   backward  pre_backward(u) (output hook): gather u, point its parameters'
///             .grad at a flat gradient buffer, prefetch the next unit (in
///             backward order, BACKWARD_PRE). When every trainable parameter
///             of u has its gradient (accumulator post-hooks): launch its
///             reductions and free u.
///   finish    reduce what no hook reduced, wait for every reduction.
///   step      the optimizer updates the shards; units kept whole are
///             gathered again.
///
/// Every collective is issued from the training thread in an order that is
/// the same on every rank, and runs on the communicator's own thread,
/// overlapping compute.
class ShardedStrategy final : public Strategy {
 public:
  explicit ShardedStrategy(StrategyOptions options);
  ~ShardedStrategy() override;

  void setup(torch::nn::Module& model, std::shared_ptr<comm::Communicator> comm) override;
  void setup(torch::nn::Module& model, const comm::DeviceMesh& mesh) override;
  comm::Communicator* optimizer_shard_group() const override { return shard_comm_.get(); }
  void set_gradient_sync(bool enabled) override { sync_ = enabled; }
  void keep_gathered_in_step(bool keep) override { keep_gathered_ = keep; }
  void finish_gradient_sync() override;
  std::vector<ShardedTensor> optimizer_parameters() override;
  std::vector<at::Tensor> gradients() override;
  double clip_grad_norm(double max_norm) override;
  void optimizer_step(torch::optim::Optimizer& optimizer) override;
  std::vector<ShardedTensor> sharded_state_dict() override;
  std::vector<std::pair<std::string, at::Tensor>> full_state_dict() override;
  void reload_parameters() override;
  std::string name() const override { return mode_.name; }
  int64_t gradient_collectives() const override { return collectives_; }
  CommStats comm_stats() const override { return last_stats_; }

  // ---- hooks (called by autograd and unit_forward) ----
  void pre_forward(size_t u);
  at::Tensor post_forward(size_t u, const at::Tensor& output);
  void pre_backward(size_t u);
  void release_finished_units(size_t v);
  void param_ready(size_t f, size_t p);
  void clear_stale(size_t f) { reducer_->clear_stale(f); }

  // ---- for tests and diagnostics ----
  /// Units in plan order (root first): name and parameter elements.
  std::vector<std::pair<std::string, int64_t>> units() const;
  /// Unit all-gathers issued ahead of need (prefetches) so far.
  int64_t prefetches() const { return gatherer_ ? gatherer_->prefetches() : 0; }
  /// Largest number of unit all-gathers in flight at once so far.
  int max_gathers_in_flight() const { return gatherer_ ? gatherer_->max_in_flight() : 0; }

 private:
  // Where the current accumulation window stands.
  enum class Phase {
    Closed,    // no gradient since the last finish
    Open,      // gradients of the window exist; no backward running
    Backward,  // inside a backward pass
  };

  void make_groups(const comm::DeviceMesh& mesh);
  void build_units(torch::nn::Module& model);
  void build_flat(size_t unit, std::vector<FlatMember> params, bool trainable, at::ScalarType dtype);
  void install_hooks();
  void remove_hooks();
  void begin_backward();
  void end_backward();
  void open_window();
  void launch_reduction(size_t f);
  void check_reduction_order();
  void check_units_called();
  bool primary_params() const;
  double comm_busy() const;
  // The path counts of the shard and replica groups together.
  comm::Communicator::PathCounts comm_paths() const;
  std::vector<ShardedTensor> in_model_order(bool trainable_only, bool optimizer_views) const;
  void need_setup(const char* what) const;

  StrategyOptions options_;
  ShardingMode mode_;
  torch::nn::Module* model_ = nullptr;
  std::shared_ptr<comm::Communicator> world_, shard_comm_, replica_comm_;
  int shard_n_ = 1, shard_rank_ = 0;

  std::vector<Unit> units_;
  std::vector<FlatParam> flats_;
  WaitClock clock_;
  std::unique_ptr<UnitGatherer> gatherer_;
  std::unique_ptr<GradReducer> reducer_;

  // Hooks call back through `self_` and do nothing once it is gone.
  std::shared_ptr<ShardedStrategy*> self_;
  struct PostHook {
    std::shared_ptr<torch::autograd::Node> accumulator;
    uintptr_t key;
  };
  std::vector<PostHook> post_hooks_;

  bool sync_ = true;
  // keep_gathered_in_step: no unit is freed before finish_gradient_sync.
  bool keep_gathered_ = false;
  Phase phase_ = Phase::Closed;
  int64_t collectives_ = 0;
  int64_t forward_tick_ = 0;
  int64_t order_hash_ = 0;  // of the flats reduced since the last finish, in launch order
  double busy_at_finish_ = 0.0;
  comm::Communicator::PathCounts paths_at_finish_;
  CommStats last_stats_;
};

}  // namespace shardtrain::strategy::detail
