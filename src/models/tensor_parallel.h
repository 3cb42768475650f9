// The tensor-parallel layers the families call (Megatron's layout). A
// family's forward calls these at the edges of each region; without a
// tensor-parallel group registered for the module they are the plain layer
// (column_input is x itself, row_parallel is lora_forward), so the model
// code is one code path and never calls a collective itself.
//
//   region (attention, MLP): x ──column_input──▶ column-parallel linears (local heads)
//                              ──▶ row_parallel (partial sums reduced, bias once) ──▶ y
//   root: vocab_embedding ─▶ layers ─▶ norm ─▶ column_input ─▶ head ─▶ vocab_logits
//
//                          forward            backward
//   column_input           identity           all-reduce        (sequence parallel: all-gather / reduce-scatter)
//   row_parallel           all-reduce         identity          (sequence parallel: reduce-scatter / all-gather)
//   vocab_embedding        all-reduce         identity          (sequence parallel: reduce-scatter / all-gather)
//   vocab_logits           all-gather over the vocabulary, unless the loss is vocabulary-parallel
//
// Under sequence parallelism the residual stream between regions holds a
// contiguous 1/tp of the micro-batch's tokens (row-major over [B, T]), shaped
// [B, T/tp, C]: norms, dropout and residual additions are per token, so any
// split of the tokens serves, and this one needs no permutation around the
// collectives.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>
#include <memory>

namespace torch::nn {
class Module;
class LinearImpl;
class EmbeddingImpl;
}  // namespace torch::nn
namespace shardtrain::comm {
class Communicator;
}

namespace shardtrain::models::detail {

/// A tensor-parallel group as the layers see it; shared by the modules of
/// one model that apply_tensor_parallel registered.
struct TensorParallelGroup {
  std::shared_ptr<comm::Communicator> comm;
  bool sequence_parallel = false;
  /// The loss takes vocabulary-sharded logits (vocab_logits keeps them local).
  bool loss_parallel = false;
  /// The whole vocabulary and this rank's rows of it [vocab_start, + vocab_local).
  int64_t vocab_size = 0;
  int64_t vocab_start = 0;
  int64_t vocab_local = 0;
  /// Collectives the layers issued, by kind (forward and backward): what the
  /// tests count per layer.
  mutable std::atomic<int64_t> all_reduces{0}, all_gathers{0}, reduce_scatters{0};
};

/// Makes `module`'s layer calls tensor-parallel over `group`: a child
/// module without parameters ("tensor_parallel") holds it, so it lives as
/// long as the model (apply_tensor_parallel registers every region of a
/// family's plan and the model's root). InvalidArgument when already set.
void set_tensor_parallel(torch::nn::Module& module, std::shared_ptr<const TensorParallelGroup> group);
/// The group registered for `module`, or null.
const TensorParallelGroup* tensor_parallel_of(const torch::nn::Module& module);

/// The input of `region`'s column-parallel linears: x itself (the backward
/// all-reduces its gradient), or under sequence parallelism the whole
/// sequence gathered from the ranks' token shards [B, T/tp, C] -> [B, T, C].
at::Tensor column_input(const torch::nn::Module& region, const at::Tensor& x);

/// A row-parallel linear of `region`: the partial products of this rank's
/// input features summed over the group (reduce-scattered to the token
/// shards under sequence parallelism), then the bias, once.
at::Tensor row_parallel(const torch::nn::Module& region, torch::nn::LinearImpl& layer, const at::Tensor& x);

/// The token embedding of `root`, vocabulary-parallel: each rank looks up
/// the ids in its rows (zeros elsewhere) and the partial embeddings are
/// summed (reduce-scattered under sequence parallelism).
at::Tensor vocab_embedding(const torch::nn::Module& root, torch::nn::EmbeddingImpl& embedding,
                           const at::Tensor& idx);

/// `t` [B, T, ...] as the residual stream holds it: under sequence
/// parallelism this rank's token shard (a replicated input such as GPT's
/// position embedding), else t.
at::Tensor sequence_shard(const torch::nn::Module& root, const at::Tensor& t);

/// The head's output [..., vocab_local] as the model returns it: the whole
/// vocabulary gathered, or this rank's columns when the loss is
/// vocabulary-parallel.
at::Tensor vocab_logits(const torch::nn::Module& root, const at::Tensor& logits);

/// The summed cross-entropy of `model`'s logits [N, V or V/tp] (from its
/// forward) against global target ids [N], rows whose target is
/// ignore_index left out; an fp32 scalar. Vocabulary-parallel logits take
/// three reductions over the group (the rows' maximum, their sums of
/// exponentials and their target logits, the last two in one) and never
/// the whole vocabulary on any rank.
at::Tensor lm_cross_entropy_sum(const torch::nn::Module& model, const at::Tensor& logits,
                                const at::Tensor& target, int64_t ignore_index);

}  // namespace shardtrain::models::detail
