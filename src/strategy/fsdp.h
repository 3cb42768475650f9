// Internals of the sharded strategies (zero1 and fsdp), visible to tests
// (tests add src/ to their include path). Not installed, not public API.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "shardtrain/comm/communicator.h"
#include "shardtrain/strategy/strategy.h"

namespace shardtrain::strategy::detail {

/// Bytes held by flat parameter and gradient buffers. They come from mmap
/// and go back to the system with munmap when freed, whatever malloc's
/// thresholds, so freeing a gathered unit really returns its memory.
struct FlatMemoryStats {
  int64_t live_bytes = 0;
  int64_t peak_bytes = 0;
};
FlatMemoryStats flat_memory_stats();
/// Sets peak_bytes to live_bytes (to measure the peak of a later phase).
void reset_flat_memory_peak();

/// How a sharded strategy treats parameters, gradients and optimizer state.
struct ShardingMode {
  std::string name;            // "zero1", "fsdp/full_shard", ...
  bool shard_params = false;   // between steps only the shard is kept (units gathered on use)
  bool reshard_after_forward = false;  // free a unit's parameters after its forward too
  bool shard_grads = false;    // reduce-scatter into shards (else all-reduce whole gradients)
  bool shard_optimizer = false;  // the optimizer steps this rank's shard only
  bool hybrid = false;         // shard within a node, replicate across nodes
};

/// The mode for StrategyOptions (name "zero1", or "fsdp" with its sharding);
/// ConfigError for an unknown sharding.
ShardingMode sharding_mode(const StrategyOptions& options);

class ShardedEngine;

/// ZeRO-1 and FSDP (FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD): one
/// code path, configured by a ShardingMode.
///
/// setup: broadcast rank 0's parameters and buffers; plan units (wrap.h);
/// per unit, one flat buffer per (requires_grad, dtype) group of its
/// parameters, padded to a multiple of the shard group's size; the model's
/// parameters become views of it; each rank keeps its shard as the master.
class ShardedStrategy final : public Strategy {
 public:
  explicit ShardedStrategy(StrategyOptions options);
  ~ShardedStrategy() override;

  void setup(torch::nn::Module& model, std::shared_ptr<comm::Communicator> comm) override;
  void set_gradient_sync(bool enabled) override;
  void finish_gradient_sync() override;
  std::vector<ShardedTensor> optimizer_parameters() override;
  std::vector<at::Tensor> gradients() override;
  double clip_grad_norm(double max_norm) override;
  void optimizer_step(torch::optim::Optimizer& optimizer) override;
  std::vector<ShardedTensor> sharded_state_dict() override;
  std::vector<std::pair<std::string, at::Tensor>> full_state_dict() override;
  void reload_parameters() override;
  std::string name() const override;
  int64_t gradient_collectives() const override;
  CommStats comm_stats() const override;

  // ---- for tests and diagnostics ----
  /// Units in plan order (root first): name and parameter elements.
  std::vector<std::pair<std::string, int64_t>> units() const;
  /// Unit all-gathers issued ahead of need (prefetches) so far.
  int64_t prefetches() const;
  /// Largest number of unit all-gathers in flight at once so far.
  int max_gathers_in_flight() const;

 private:
  StrategyOptions options_;
  ShardingMode mode_;
  std::shared_ptr<ShardedEngine> engine_;
};

}  // namespace shardtrain::strategy::detail
