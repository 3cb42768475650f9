// The tensor-parallel layers: four autograd functions at the edges of the
// regions, the vocabulary-parallel embedding, logits and loss.
#include "models/tensor_parallel.h"

#include <torch/torch.h>

#include <atomic>
#include <vector>

#include "shardtrain/comm/communicator.h"
#include "shardtrain/core/error.h"
#include "models/activations.h"
#include "shardtrain/models/lora.h"

namespace shardtrain::models::detail {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

// ---- which modules are tensor-parallel ------------------------------------------------------

// The group rides on the module as a child without parameters (as LoRA's
// state does), so it lives and dies with the model.
constexpr const char* kChildName = "tensor_parallel";

class TensorParallelChildImpl : public torch::nn::Module {
 public:
  explicit TensorParallelChildImpl(std::shared_ptr<const TensorParallelGroup> g) : group(std::move(g)) {}
  std::shared_ptr<const TensorParallelGroup> group;
};

// Groups ever registered in this process (never decreases).
std::atomic<int64_t>& registrations() {
  static std::atomic<int64_t> count{0};
  return count;
}

// The group travels through autograd's saved data as an address: the
// model holds it (its child) as long as the model lives.
int64_t as_word(const TensorParallelGroup* g) { return reinterpret_cast<int64_t>(g); }
const TensorParallelGroup& group_at(int64_t word) { return *reinterpret_cast<const TensorParallelGroup*>(word); }
const TensorParallelGroup& group_of(AutogradContext* ctx) { return group_at(ctx->saved_data["group"].toInt()); }

// ---- the collectives --------------------------------------------------------------------

at::Tensor all_reduced(const TensorParallelGroup& g, const at::Tensor& x) {
  at::Tensor out = x.contiguous().clone();
  ++g.all_reduces;
  g.comm->all_reduce(out);
  return out;
}

// [B, T/tp, ...] token shards -> [B, T, ...]: shards are consecutive runs of
// the row-major tokens, so the gathered buffer is the whole tensor as it is.
at::Tensor gathered_tokens(const TensorParallelGroup& g, const at::Tensor& x) {
  const int tp = g.comm->size();
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes[1] *= tp;
  at::Tensor out = at::empty(sizes, x.options().memory_format(at::MemoryFormat::Contiguous));
  ++g.all_gathers;
  g.comm->all_gather(x.contiguous().view({-1}), out.view({-1}));
  return out;
}

// [B, T, ...] -> this rank's summed token shard [B, T/tp, ...].
at::Tensor scattered_tokens(const TensorParallelGroup& g, const at::Tensor& x) {
  const int tp = g.comm->size();
  std::vector<int64_t> sizes = x.sizes().vec();
  ST_CHECK(sizes.size() >= 2 && sizes[1] % tp == 0, InvalidArgument, "sequence parallelism splits the ",
           sizes.size() >= 2 ? sizes[1] : 0, " tokens of each row over tensor_parallel=", tp,
           " ranks, which does not divide them; hint: use rows of model.block_size tokens, a multiple "
           "of distributed.tensor_parallel, or set distributed.sequence_parallel: false");
  sizes[1] /= tp;
  at::Tensor out = at::empty(sizes, x.options().memory_format(at::MemoryFormat::Contiguous));
  ++g.reduce_scatters;
  g.comm->reduce_scatter(x.contiguous().view({-1}), out.view({-1}));
  return out;
}

// ---- the region edges as autograd functions -----------------------------------------------

// Into a region: identity forward, gradients summed backward; under
// sequence parallelism the tokens gathered forward, reduce-scattered backward.
struct EnterRegion : torch::autograd::Function<EnterRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t group) {
    ctx->saved_data["group"] = group;
    const auto& g = group_at(group);
    return g.sequence_parallel ? gathered_tokens(g, x) : x;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const auto& g = group_of(ctx);
    return {g.sequence_parallel ? scattered_tokens(g, grad[0]) : all_reduced(g, grad[0]), at::Tensor()};
  }
};

// Out of a region: partial sums reduced forward, identity backward; under
// sequence parallelism reduce-scattered forward, gathered backward.
struct LeaveRegion : torch::autograd::Function<LeaveRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t group) {
    ctx->saved_data["group"] = group;
    const auto& g = group_at(group);
    return g.sequence_parallel ? scattered_tokens(g, x) : all_reduced(g, x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const auto& g = group_of(ctx);
    return {g.sequence_parallel ? gathered_tokens(g, grad[0]) : grad[0], at::Tensor()};
  }
};

// This rank's columns [..., Vl] -> the whole vocabulary [..., V]; backward
// keeps this rank's columns of the gradient (every rank computes the same
// loss from the same whole logits).
struct GatherVocab : torch::autograd::Function<GatherVocab> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits, int64_t group) {
    ctx->saved_data["group"] = group;
    const auto& g = group_at(group);
    const int tp = g.comm->size();
    const int64_t widest = comm::shard_range(g.vocab_size, tp, 0).count;
    const int64_t rows = logits.numel() / std::max<int64_t>(1, g.vocab_local);
    // Uneven splits (the first V % tp ranks hold a row more) travel padded.
    at::Tensor mine = at::zeros({rows, widest}, logits.options());
    mine.narrow(1, 0, g.vocab_local).copy_(logits.reshape({rows, g.vocab_local}));
    at::Tensor all = at::empty({tp, rows, widest}, logits.options());
    ++g.all_gathers;
    g.comm->all_gather(mine.view({-1}), all.view({-1}));
    std::vector<at::Tensor> parts;
    for (int r = 0; r < tp; ++r) parts.push_back(all[r].narrow(1, 0, comm::shard_range(g.vocab_size, tp, r).count));
    std::vector<int64_t> sizes = logits.sizes().vec();
    sizes.back() = g.vocab_size;
    return at::cat(parts, 1).view(sizes);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const auto& g = group_of(ctx);
    return {grad[0].narrow(-1, g.vocab_start, g.vocab_local).contiguous(), at::Tensor()};
  }
};

// Cross-entropy over vocabulary-sharded logits [N, Vl] (fp32 or bf16,
// computed in fp32): the row maximum (MAX over the group), then the sums of
// exponentials and the target logits (one SUM over the group). The
// gradient is local: softmax minus the one-hot target, in this rank's columns.
struct VocabParallelCrossEntropy : torch::autograd::Function<VocabParallelCrossEntropy> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& target,
                            int64_t group, int64_t ignore_index) {
    const auto& g = group_at(group);
    const at::Tensor x = logits.to(at::kFloat);
    const at::Tensor valid = target.ne(ignore_index);
    ST_CHECK(target.ge(0).logical_and(target.lt(g.vocab_size)).logical_or(valid.logical_not()).all().item<bool>(),
             InvalidArgument, "cross-entropy: a target is outside the vocabulary [0, ", g.vocab_size,
             ") and is not the ignore index ", ignore_index);
    at::Tensor max = std::get<0>(x.max(1));
    ++g.all_reduces;
    g.comm->all_reduce(max, comm::AllReduceOptions().op(comm::ReduceOp::Max));
    const at::Tensor shifted = x - max.unsqueeze(1);
    // This rank's part of each row's target logit (0 where another rank holds it).
    const at::Tensor local = target - g.vocab_start;
    const at::Tensor mine = valid.logical_and(local.ge(0)).logical_and(local.lt(g.vocab_local));
    const at::Tensor picked =
        shifted.gather(1, local.masked_fill(mine.logical_not(), 0).unsqueeze(1)).squeeze(1) * mine;
    at::Tensor sums = at::stack({shifted.exp().sum(1), picked});  // [2, N]
    ++g.all_reduces;
    g.comm->all_reduce(sums);
    const at::Tensor sum_exp = sums[0], target_logit = sums[1];
    const at::Tensor rows = (sum_exp.log() - target_logit) * valid;
    ctx->save_for_backward({logits, max, sum_exp, local, mine, valid});
    return rows.to(at::kDouble).sum().to(at::kFloat);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& logits = saved[0];
    const at::Tensor &max = saved[1], &sum_exp = saved[2], &local = saved[3], &mine = saved[4], &valid = saved[5];
    at::Tensor d = (logits.to(at::kFloat) - max.unsqueeze(1)).exp() / sum_exp.unsqueeze(1);
    d.scatter_add_(1, local.masked_fill(mine.logical_not(), 0).unsqueeze(1),
                   -mine.to(at::kFloat).unsqueeze(1));
    d.mul_(valid.to(at::kFloat).unsqueeze(1) * grad[0]);
    return {d.to(logits.scalar_type()), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

// ---- where the group lives ---------------------------------------------------------------------------

void set_tensor_parallel(torch::nn::Module& module, std::shared_ptr<const TensorParallelGroup> group) {
  ST_CHECK(tensor_parallel_of(module) == nullptr, InvalidArgument, "module ", module.name(),
           " is already tensor-parallel");
  module.register_module(kChildName, std::make_shared<TensorParallelChildImpl>(std::move(group)));
  registrations().fetch_add(1, std::memory_order_relaxed);
}

const TensorParallelGroup* tensor_parallel_of(const torch::nn::Module& module) {
  // Every layer call of every model asks: a process that never split a
  // model answers without walking the module's children.
  if (registrations().load(std::memory_order_relaxed) == 0) return nullptr;
  for (const auto& child : module.named_children()) {
    if (child.key() != kChildName) continue;
    const auto* held = dynamic_cast<const TensorParallelChildImpl*>(child.value().get());
    return held == nullptr ? nullptr : held->group.get();
  }
  return nullptr;
}

// ---- the layers -------------------------------------------------------------------------------

at::Tensor column_input(const torch::nn::Module& region, const at::Tensor& x) {
  const TensorParallelGroup* g = tensor_parallel_of(region);
  return g == nullptr ? x : EnterRegion::apply(x, as_word(g));
}

at::Tensor row_parallel(const torch::nn::Module& region, torch::nn::LinearImpl& layer, const at::Tensor& x) {
  const TensorParallelGroup* g = tensor_parallel_of(region);
  if (g == nullptr) return lora_forward(layer, x);
  const at::Tensor y = LeaveRegion::apply(lora_forward(layer, x, /*with_bias=*/false), as_word(g));
  return layer.bias.defined() ? y + layer.bias : y;
}

at::Tensor vocab_embedding(const torch::nn::Module& root, torch::nn::EmbeddingImpl& embedding,
                           const at::Tensor& idx) {
  const TensorParallelGroup* g = tensor_parallel_of(root);
  if (g == nullptr) return embedding.forward(idx);
  const at::Tensor local = idx - g->vocab_start;
  const at::Tensor mine = local.ge(0).logical_and(local.lt(g->vocab_local));
  const at::Tensor rows = embedding.forward(local.masked_fill(mine.logical_not(), 0));
  return LeaveRegion::apply(rows * mine.unsqueeze(-1).to(rows.scalar_type()), as_word(g));
}

at::Tensor sequence_shard(const torch::nn::Module& root, const at::Tensor& t) {
  const TensorParallelGroup* g = tensor_parallel_of(root);
  if (g == nullptr || !g->sequence_parallel) return t;
  const int tp = g->comm->size();
  const int64_t rows = t.size(1) / tp;
  const int64_t tokens = t.size(0) * t.size(1);
  // Consecutive runs of the row-major tokens, as the reduce-scatter leaves them.
  std::vector<int64_t> flat_sizes = t.sizes().vec();
  flat_sizes.erase(flat_sizes.begin());
  flat_sizes[0] = tokens;
  std::vector<int64_t> sizes = t.sizes().vec();
  sizes[1] = rows;
  return t.reshape(flat_sizes).narrow(0, g->comm->rank() * (tokens / tp), tokens / tp).view(sizes);
}

at::Tensor vocab_logits(const torch::nn::Module& root, const at::Tensor& logits) {
  const TensorParallelGroup* g = tensor_parallel_of(root);
  if (g == nullptr || g->loss_parallel) return logits;
  return GatherVocab::apply(logits, as_word(g));
}

at::Tensor lm_cross_entropy_sum(const torch::nn::Module& model, const at::Tensor& logits,
                                const at::Tensor& target, int64_t ignore_index) {
  const TensorParallelGroup* g = tensor_parallel_of(model);
  const int64_t width = logits.size(-1);
  if (g == nullptr || !g->loss_parallel) {
    return cross_entropy_sum(logits.reshape({-1, width}), target.reshape({-1}), ignore_index);
  }
  return VocabParallelCrossEntropy::apply(logits.reshape({-1, width}), target.reshape({-1}).to(at::kLong),
                                          as_word(g), ignore_index);
}

}  // namespace shardtrain::models::detail
