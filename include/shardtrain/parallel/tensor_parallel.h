// Tensor parallelism as plain functions over a built model and the mesh's
// tensor-parallel group, applied in this order before the data-parallel
// strategy's setup (torchtitan's parallelize order):
//
//   auto layout = apply_tensor_parallel(*model, family.tensor_parallel_plan(), mesh.tp(), options);
//   auto strategy = tensor_parallel_strategy(make_strategy(so), layout, mesh.tp());
//   strategy->setup(*model, mesh);            // the inner strategy on mesh.dp()
//
// apply_tensor_parallel keeps, of every parameter its family's plan splits,
// this rank's block (models/tensor_parallel.h has the layout), reading only
// that block of a deferred (file-backed) weight. Parameters the plan does
// not split (norms, row-parallel biases, GPT's position embedding) stay
// whole on every rank: "replicated". The strategy wrapper then gives the
// rest of shardtrain one model again:
//   - checkpoints and optimizer state record each block's place in the
//     whole tensor (ShardedTensor::chunk), so any layout loads any other;
//   - the gradient norm counts a split parameter's blocks once each and a
//     replicated one once, not tp times;
//   - under sequence parallelism each rank's gradient of a replicated
//     parameter covers its tokens only: they are summed over the group;
//   - LoRA adapters split with their base (B's rows under a
//     column-parallel layer, A's columns under a row-parallel one); the
//     other, replicated, matrix sees only this rank's part of the layer,
//     so its gradient is summed over the group too;
//   - full_state_dict() assembles the whole tensors on rank 0.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "shardtrain/core/options.h"
#include "shardtrain/strategy/strategy.h"

namespace torch::nn {
class Module;
}
namespace shardtrain::models {
struct TensorParallelPlan;
}

namespace shardtrain::parallel {

struct TensorParallelOptions {
  /// Norms, dropout and the residual stream hold 1/tp of the tokens between
  /// regions: all-gather in, reduce-scatter out instead of one all-reduce.
  ST_ARG(bool, sequence_parallel) = true;
  /// The loss takes vocabulary-sharded logits; no rank holds the whole vocabulary.
  ST_ARG(bool, loss_parallel) = true;
  /// false: the model is a pipeline stage's part, which may lack the embedding.
  ST_ARG(bool, whole_model) = true;
};

/// What apply_tensor_parallel split: per parameter name, the block each
/// tensor-parallel rank holds (index = rank) and the whole shape.
struct TensorParallelLayout {
  struct Split {
    std::vector<int64_t> global_shape;
    std::vector<strategy::TensorChunk> chunks;
  };
  std::map<std::string, Split> splits;
  /// Replicated parameters whose gradient on each rank is a partial sum
  /// over the group even without sequence parallelism: the A of a LoRA
  /// adapter on a column-parallel layer, the B of one on a row-parallel layer.
  std::vector<std::string> partial_gradients;
  bool sequence_parallel = false;
};

/// Keeps, of every parameter `plan` splits, the block of tensor-parallel
/// rank `rank` of `tp` (a deferred weight stays deferred and will read only
/// that block), and says what was split. Registers no group: the layers
/// still compute alone (apply_tensor_parallel does both; a planner sizes a
/// rank's share with this alone). LoRA adapters must be attached unquantized
/// (models::quantize_lora_bases after the split quantizes each block).
/// ConfigError when a `whole_model` lacks the plan's embedding.
TensorParallelLayout split_for_tensor_parallel(torch::nn::Module& model, const models::TensorParallelPlan& plan,
                                              int tp, int rank, bool whole_model = true);

/// Splits `model` over `tp` as `plan` says (every rank of `tp` calls it on
/// the same model) and makes the plan's regions compute over the group.
/// Parameters must not be sharded yet. ConfigError when a split dimension
/// has fewer elements than ranks, or a LoRA base is already quantized.
TensorParallelLayout apply_tensor_parallel(torch::nn::Module& model, const models::TensorParallelPlan& plan,
                                           std::shared_ptr<comm::Communicator> tp,
                                           const TensorParallelOptions& options = {});

/// `inner` (the data-parallel strategy) wrapped so that the trainer,
/// checkpoints and clipping see the whole model; see the top of this file.
std::unique_ptr<strategy::Strategy> tensor_parallel_strategy(std::unique_ptr<strategy::Strategy> inner,
                                                             TensorParallelLayout layout,
                                                             std::shared_ptr<comm::Communicator> tp);

}  // namespace shardtrain::parallel
