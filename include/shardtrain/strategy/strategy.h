// How gradients (and later parameters and optimizer state) are shared
// between ranks. The trainer, or a hand-written loop, drives a Strategy:
//
//   strategy->setup(model, comm);                 // once, on every rank
//   for each optimizer step:
//     for each micro-step j of k:
//       strategy->set_gradient_sync(j == k - 1);  // communicate on the last only
//       loss.backward();                          // reductions start from hooks
//     strategy->finish_gradient_sync();           // gradients are final here
//     norm = strategy->clip_grad_norm(max_norm);
//     strategy->optimizer_step(optimizer);   // optimizer over optimizer_parameters()
//     optimizer.zero_grad();
//
// Sharded strategies (zero1, fsdp) replace the model's parameters by views
// of flat buffers and keep each rank's slice; see docs/strategies.md. Under
// fsdp, a unit's forward must be called through strategy/unit.h's
// unit_forward() so that its parameters are gathered just in time.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "shardtrain/strategy/options.h"

namespace torch {
namespace nn {
class Module;
}
namespace optim {
class Optimizer;
}
}  // namespace torch

namespace shardtrain::comm {
class Communicator;
class DeviceMesh;
}

namespace shardtrain::strategy {

/// A block of a whole tensor along one dimension: the elements whose index
/// along `dim` lies in one of `ranges` ({global start, length}, in this
/// order). What a tensor-parallel rank holds of a split parameter: rows
/// [r·V/tp, ...) of an embedding, the columns of its input features of a
/// row-parallel weight, three row blocks of GPT's fused q|k|v.
struct TensorChunk {
  /// -1: the whole tensor (no ranges).
  int64_t dim = -1;
  std::vector<std::pair<int64_t, int64_t>> ranges;
  bool whole() const { return dim < 0; }
  /// The chunk's shape: `global_shape` with `dim` the ranges' total length.
  std::vector<int64_t> shape(const std::vector<int64_t>& global_shape) const;
};

/// Where `count` elements of a chunk, from its row-major element `first`,
/// lie in the whole tensor: runs of {whole-tensor offset, offset from
/// `first`, length}, in order. One run for a whole tensor or a split of dim 0.
struct ElementRun {
  int64_t global = 0;
  int64_t local = 0;
  int64_t count = 0;
};
std::vector<ElementRun> chunk_runs(const std::vector<int64_t>& global_shape, const TensorChunk& chunk,
                                   int64_t first, int64_t count);

/// One tensor of the model's state as this rank holds it: the whole tensor,
/// or a contiguous run of its row-major (flattened) elements.
struct ShardedTensor {
  /// named_parameters() / named_buffers() name, e.g. "h.0.attn.c_attn.weight".
  std::string name;
  /// Shape of the whole tensor.
  std::vector<int64_t> global_shape;
  /// First row-major element of the whole tensor held here.
  int64_t offset = 0;
  /// The elements held: the whole tensor in its own shape, or a 1-D run of
  /// `local.numel()` elements starting at `offset` (possibly empty). Writing
  /// into it (then reload_parameters()) changes the model.
  at::Tensor local;
  /// true on exactly one rank per element: the rank that should write it
  /// when every rank saves its part (replicas elsewhere say false).
  bool primary = true;
  /// A parameter (true) or a buffer (false).
  bool is_parameter = true;
  /// Under tensor parallelism, the block of the whole tensor this rank's
  /// parameter is: `offset` and `local` then count the chunk's row-major
  /// elements, and chunk_runs() tells where they lie in the whole tensor.
  TensorChunk chunk;
};

/// Time a strategy spent on communication in the last optimizer step.
struct CommStats {
  /// Seconds the communication threads were busy with this strategy's
  /// collectives (gathers, reductions).
  double busy_s = 0.0;
  /// Seconds the training thread waited for them (not hidden by compute).
  double exposed_s = 0.0;
  /// Bytes of the gradient buffers handed to reductions (all-reduce,
  /// reduce-scatter input) and of the parameter buffers filled by
  /// all-gathers (whole output), from one finish_gradient_sync to the next.
  /// Frozen parameters are never reduced; a frozen int8/uint8 flat counts its
  /// stored bytes.
  int64_t reduced_bytes = 0;
  int64_t gathered_bytes = 0;
  /// The large collectives on one host's shared memory over the same span
  /// that read the peers' buffers in place, and those staged because some
  /// rank's buffer was not allocated memory (Communicator::path_counts).
  int64_t in_place_ops = 0;
  int64_t staged_ops = 0;
};

class Strategy {
 public:
  virtual ~Strategy() = default;

  /// Called once on every rank before training, after the model is built and
  /// before the optimizer sees its parameters. Starts every rank from rank
  /// 0's parameters and buffers, then plans buckets or shards and installs
  /// its autograd hooks.
  virtual void setup(torch::nn::Module& model, std::shared_ptr<comm::Communicator> comm) = 0;

  /// The same on the data-parallel dimensions of `mesh` (comm/mesh.h):
  /// gradients are averaged over mesh.dp(), and hybrid sharding shards
  /// within mesh.dp_shard() and replicates across mesh.dp_replicate().
  virtual void setup(torch::nn::Module& model, const comm::DeviceMesh& mesh);

  /// The group over which optimizer_parameters() split the model (each rank
  /// holding its own slices), or null where every rank holds them all.
  virtual comm::Communicator* optimizer_shard_group() const { return nullptr; }

  /// Whether the next backward synchronises gradients. Off on accumulation
  /// micro-steps, on for the last one; on by default.
  virtual void set_gradient_sync(bool enabled) = 0;

  /// After the backward of a synchronising micro-step: blocks until every
  /// gradient is reduced (averaged over ranks) and in place in the .grad()
  /// of optimizer_parameters().
  virtual void finish_gradient_sync() = 0;

  /// The tensors the optimizer must be built over, after setup(): the
  /// model's parameters for single and ddp, this rank's 1-D shard of each
  /// parameter for sharded strategies (global_shape tells which were
  /// matrices, e.g. for weight-decay groups). Frozen parameters are absent.
  virtual std::vector<ShardedTensor> optimizer_parameters() = 0;

  /// The gradients this rank holds after finish_gradient_sync (whole or
  /// sharded): what precision plugins unscale and check for infs.
  virtual std::vector<at::Tensor> gradients() = 0;

  /// The global L2 norm of all gradients before clipping; scales them so the
  /// norm is at most max_norm when max_norm > 0. Same value on every rank.
  virtual double clip_grad_norm(double max_norm) = 0;

  /// Applies the optimizer (built over optimizer_parameters()); sharded
  /// strategies then bring the model's parameters up to date.
  virtual void optimizer_step(torch::optim::Optimizer& optimizer) = 0;

  /// Parameters (master copy) and buffers as this rank holds them, with the
  /// slice of each whole tensor; what checkpoints save and load.
  virtual std::vector<ShardedTensor> sharded_state_dict() = 0;

  /// The whole model's parameters and buffers, in named_parameters() then
  /// named_buffers() order, on rank 0 (other ranks get an empty list).
  /// Sharded strategies gather one unit at a time. Every rank must call it.
  virtual std::vector<std::pair<std::string, at::Tensor>> full_state_dict() = 0;

  /// After writing into sharded_state_dict() tensors: makes the model use
  /// them (sharded strategies re-gather what they keep whole). Every rank.
  virtual void reload_parameters() = 0;

  /// "single", "ddp", "zero1" or "fsdp/<sharding>".
  virtual std::string name() const = 0;

  /// Gradient collectives launched so far; tests count communication with it.
  virtual int64_t gradient_collectives() const = 0;

  /// Communication time of the last optimizer step (zeros where not measured).
  virtual CommStats comm_stats() const { return {}; }
  /// Sharded strategies: keep each unit's parameters gathered from its first
  /// gather in a step until finish_gradient_sync, instead of freeing them
  /// after every forward and backward. For a pipeline stage, whose forwards
  /// and backwards of several micro-batches interleave (torchtitan's
  /// reshard_after_forward=False under pipelining): one gather per unit and
  /// step, at the memory of a gathered stage. A no-op elsewhere.
  virtual void keep_gathered_in_step(bool keep) {}
};

/// Builds the strategy `options` describe; ConfigError for StrategyKind::Auto
/// (resolve it with choose_strategy first) and for impossible values.
std::unique_ptr<Strategy> make_strategy(const StrategyOptions& options);

}  // namespace shardtrain::strategy
