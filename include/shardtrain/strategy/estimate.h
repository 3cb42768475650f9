// Memory and communication estimates per strategy, before anything runs.
//
// Pure arithmetic over a few numbers (parameter counts, world size, dtype
// widths); no communicator, no model. `shardtrain estimate` prints these for
// a config, and distributed.strategy "auto" resolves through choose_strategy().
//
// Model state follows the ZeRO paper (Rajbhandari et al., 2020) for Adam:
// per parameter, mixed precision keeps a 16-bit copy (2 bytes), a 16-bit
// gradient (2) and fp32 master weight, momentum and variance (12); fp32
// keeps weight (4), gradient (4), momentum and variance (8). Each strategy
// shards some of these over N ranks:
//
//                        mixed precision     fp32
//   ddp, fsdp/no_shard   16Ψ                 16Ψ
//   zero1                4Ψ + 12Ψ/N          8Ψ + 8Ψ/N
//   fsdp/shard_grad_op   2Ψ + 14Ψ/N          4Ψ + 12Ψ/N
//   fsdp/full_shard      16Ψ/N               16Ψ/N
//   fsdp/hybrid_shard    full_shard with N = ranks per node
//
// Ψ/N is rounded up (ceil): the largest rank's shard. These are estimates:
// allocator slack, communication buffers and temporaries are not counted.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "shardtrain/strategy/options.h"

namespace shardtrain::models {
struct GPTConfig;
}

namespace shardtrain::strategy {

struct EstimateInput {
  /// Ψ: trainable parameters (elements), tied ones counted once.
  int64_t num_params = 0;
  /// Elements of the largest fsdp unit and of the second largest (see
  /// plan_units in strategy/wrap.h); 0 when there is none.
  int64_t largest_unit_params = 0;
  int64_t second_unit_params = 0;
  /// N: ranks in the job.
  int world_size = 1;
  /// Ranks per node (hybrid_shard shards within a node); divides world_size.
  int local_world_size = 1;
  /// A 16-bit compute copy of the parameters (param_dtype bf16/fp16, or
  /// precision fp16-mixed): the "mixed precision" formulas, 2-byte gathered
  /// units. false: the fp32 formulas, 4-byte gathered units.
  bool mixed_precision = false;
  /// Activation memory per rank for one micro-batch, in bytes.
  int64_t activation_bytes = 0;
  /// Bytes of the frozen parameters (a LoRA run's base: fp32, or int8/nf4
  /// codes and scales): no gradient and no optimizer state, held whole where
  /// parameters are replicated and sharded where they are (full_shard over N,
  /// hybrid_shard over the ranks per node).
  int64_t frozen_bytes = 0;
};

struct StrategyEstimate {
  /// The strategy (ddp, zero1 or fsdp) and, for fsdp, its sharding.
  StrategyKind kind = StrategyKind::Ddp;
  Sharding sharding = Sharding::FullShard;
  /// Its display name: "ddp", "zero1", "fsdp/shard_grad_op",
  /// "fsdp/full_shard", "fsdp/hybrid_shard" or "fsdp/no_shard".
  std::string strategy;
  /// Parameters, gradients and Adam state per rank (the table above), plus
  /// the frozen parameters, bytes.
  double model_state_bytes = 0.0;
  /// fsdp full_shard / hybrid_shard: the two largest units gathered at once
  /// (the one computing and the one prefetched), parameters and gradients in
  /// the compute dtype, bytes; 0 for the other strategies.
  double gathered_bytes = 0.0;
  /// EstimateInput::activation_bytes.
  double activation_bytes = 0.0;
  /// model_state_bytes + gathered_bytes + activation_bytes.
  double total_bytes = 0.0;
  /// Gradient and parameter traffic per rank per optimizer step, in units of
  /// Ψ elements (large-N limit): ddp, fsdp/no_shard 2 (all-reduce);
  /// fsdp/shard_grad_op 2 (reduce-scatter + all-gather); zero1 3 (all-reduce
  /// + all-gather); fsdp/full_shard 3 (two all-gathers + reduce-scatter);
  /// fsdp/hybrid_shard 3 within a node + 2/(ranks per node) across nodes
  /// (3 when the job has one node).
  double comm_volume = 0.0;
  /// Collectives over the model per optimizer step (1 for an all-reduce
  /// strategy, 3 for full_shard); choose_strategy's first tie-break.
  int collectives = 0;
};

/// One estimate per strategy, in the order of StrategyEstimate::strategy's
/// list. InvalidArgument for negative sizes, world_size < 1, or a
/// local_world_size that is < 1 or does not divide world_size.
std::vector<StrategyEstimate> estimate_all(const EstimateInput& in);

/// What distributed.strategy "auto" runs: the strategy with the least
/// communication whose total fits `budget_bytes` (per rank); among equal
/// communication, the one with fewer collectives per step (each is a
/// synchronisation point; this keeps ddp ahead of fsdp/shard_grad_op), then
/// the least memory, then the order of estimate_all(). ConfigError naming the
/// smallest total and the budget if none fits.
StrategyEstimate choose_strategy(const EstimateInput& in, double budget_bytes);

/// This machine's MemAvailable (/proc/meminfo) divided by local_world_size,
/// in bytes: the default memory budget of one rank. ConfigError when
/// /proc/meminfo cannot be read; InvalidArgument for local_world_size < 1.
double default_memory_budget_bytes(int local_world_size);

/// An estimate of the activation memory of one micro-batch of the built-in
/// GPT (models/gpt.h) at full context (T = block_size), in bytes, from
/// Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
/// Transformer Models"): per layer B·T·C·(34 + 5·n_head·T/C) bytes in 16-bit,
/// scaled by bytes_per_element/2, plus the logits and their gradient
/// (B·T·V·bytes_per_element·2). With activation checkpointing, a layer keeps
/// only 2·B·T·C·bytes_per_element (its input) and one layer at a time holds
/// its full activations while it is recomputed. Not a measurement: kernels'
/// workspaces and the allocator's slack are not in it. Saturates at
/// INT64_MAX for sizes no machine holds.
int64_t gpt_activation_bytes(const models::GPTConfig& config, int64_t micro_batch,
                             int bytes_per_element);

/// The same estimate for the built-in MLP (models/mlp.h) with layer widths
/// `sizes`: each Linear keeps its input and each GELU its input, plus the
/// output and its gradient: B·bytes·(Σ sizes[0..n-2] + Σ hidden + 2·out).
/// Saturates at INT64_MAX.
int64_t mlp_activation_bytes(const std::vector<int64_t>& sizes, int64_t micro_batch,
                             int bytes_per_element);

}  // namespace shardtrain::strategy
