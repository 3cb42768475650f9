// StrategyOptions: how gradients, parameters and optimizer state are shared
// between ranks. This struct is also the `distributed` section of the YAML
// config (config/config.h extends it with the launch keys), so every field
// here is a config key of the same name; docs/config.md lists them.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "shardtrain/core/enum_names.h"
#include "shardtrain/core/options.h"

namespace torch::nn {
class Module;
}

namespace shardtrain::strategy {

/// Which strategy trains the model.
enum class StrategyKind {
  Single,  // one process, no communication
  Ddp,     // whole model on every rank, gradients all-reduced in buckets
  Zero1,   // whole parameters, sharded optimizer state
  Fsdp,    // sharded parameters too, as `sharding` says
  Auto,    // resolved by the caller with choose_strategy() (strategy/estimate.h)
};
ST_ENUM_NAMES(StrategyKind, {StrategyKind::Single, "single"}, {StrategyKind::Ddp, "ddp"},
              {StrategyKind::Zero1, "zero1"}, {StrategyKind::Fsdp, "fsdp"},
              {StrategyKind::Auto, "auto"});

/// fsdp: what is sharded (PyTorch FSDP's names).
enum class Sharding {
  FullShard,    // parameters, gradients, optimizer state; units freed after forward
  ShardGradOp,  // gradients and optimizer state; parameters kept from forward to backward
  NoShard,      // nothing (DDP through the sharded engine)
  HybridShard,  // full_shard within a node, replicated across nodes
};
ST_ENUM_NAMES(Sharding, {Sharding::FullShard, "full_shard"}, {Sharding::ShardGradOp, "shard_grad_op"},
              {Sharding::NoShard, "no_shard"}, {Sharding::HybridShard, "hybrid_shard"});

/// A floating dtype for communication or computation; Auto keeps each
/// parameter's own dtype.
enum class DType { Auto, Fp32, Bf16, Fp16 };
ST_ENUM_NAMES(DType, {DType::Auto, "auto"}, {DType::Fp32, "fp32"}, {DType::Bf16, "bf16"},
              {DType::Fp16, "fp16"});

/// fsdp: which submodules become units (strategy/wrap.h).
enum class AutoWrapPolicy {
  ModuleType,  // modules whose type name is one of wrap_module_types
  Size,        // post-order, a module whose unwrapped parameters reach min_num_params
  None,        // one unit: the root
};
ST_ENUM_NAMES(AutoWrapPolicy, {AutoWrapPolicy::ModuleType, "module_type"},
              {AutoWrapPolicy::Size, "size"}, {AutoWrapPolicy::None, "none"});

/// fsdp: when the next unit is gathered during backward.
enum class BackwardPrefetch {
  BackwardPre,   // before computing this unit's gradients
  BackwardPost,  // after them
  None,
};
ST_ENUM_NAMES(BackwardPrefetch, {BackwardPrefetch::BackwardPre, "backward_pre"},
              {BackwardPrefetch::BackwardPost, "backward_post"}, {BackwardPrefetch::None, "none"});

/// fsdp with sharded gradients: how accumulation micro-steps are reduced.
enum class Accumulation {
  Sharded,    // reduce-scatter every micro-step (low memory)
  Unsharded,  // keep whole gradients until the last micro-step (one reduction per step)
};
ST_ENUM_NAMES(Accumulation, {Accumulation::Sharded, "sharded"},
              {Accumulation::Unsharded, "unsharded"});

/// (dotted module path, module, parameters no nested unit claimed) -> make it
/// a unit. See strategy/wrap.h.
using WrapPolicy = std::function<bool(const std::string& name, const torch::nn::Module& module,
                                      int64_t unwrapped_params)>;

struct StrategyOptions {
  /// Which strategy; Auto must be resolved before make_strategy().
  ST_ARG(StrategyKind, strategy) = StrategyKind::Ddp;
  /// fsdp only.
  ST_ARG(Sharding, sharding) = Sharding::FullShard;
  /// ddp: largest gradient bucket, and the first (smaller, so the first
  /// reduction starts early in backward), in MiB.
  ST_ARG(double, bucket_cap_mb) = 25.0;
  ST_ARG(double, first_bucket_mb) = 1.0;
  /// true: parameters without a gradient in a step are reduced as zeros;
  /// false: such a parameter is an error that names it.
  ST_ARG(bool, find_unused_parameters) = false;
  /// dtype gradients are reduced in (Auto: each parameter's own).
  ST_ARG(DType, reduce_dtype) = DType::Fp32;
  /// zero1/fsdp: dtype of the gathered (compute) copy of the parameters
  /// (Auto: the parameter's own). The sharded master keeps its own dtype.
  ST_ARG(DType, param_dtype) = DType::Auto;
  /// fsdp: which submodules become units.
  ST_ARG(AutoWrapPolicy, auto_wrap_policy) = AutoWrapPolicy::ModuleType;
  /// fsdp, module_type: class names (without namespaces) of the units.
  ST_ARG(std::vector<std::string>, wrap_module_types) = {"BlockImpl"};
  /// fsdp, size: parameters a unit needs at least.
  ST_ARG(int64_t, min_num_params) = int64_t{1} << 20;
  /// fsdp: a user predicate that replaces auto_wrap_policy when set (not a
  /// config key).
  ST_ARG(WrapPolicy, wrap_policy);
  ST_ARG(BackwardPrefetch, backward_prefetch) = BackwardPrefetch::BackwardPre;
  /// fsdp: gather the next unit while this one's forward runs.
  ST_ARG(bool, forward_prefetch) = false;
  /// fsdp: unit all-gathers in flight at most (prefetches included), >= 1.
  ST_ARG(int64_t, limit_all_gathers) = 2;
  ST_ARG(Accumulation, accumulation) = Accumulation::Sharded;
  /// hybrid_shard: ranks per node (the intra-node shard group); 0 means
  /// LOCAL_WORLD_SIZE from the environment (not a config key).
  ST_ARG(int64_t, local_world_size) = 0;

 public:
  /// "ddp", "zero1", "fsdp/full_shard", ...: the strategy and, for fsdp, its sharding.
  std::string display_name() const;
};

}  // namespace shardtrain::strategy
