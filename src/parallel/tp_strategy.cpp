// The data-parallel strategy of a tensor-parallel model, seen whole: the
// blocks' places in checkpoints, the gradient norm, sequence-parallel
// gradients of replicated parameters, the whole model on rank 0.
#include <torch/torch.h>

#include <set>

#include "shardtrain/comm/communicator.h"
#include "shardtrain/comm/mesh.h"
#include "shardtrain/core/error.h"
#include "shardtrain/models/lora_peft.h"
#include "shardtrain/parallel/tensor_parallel.h"
#include "strategy/detail.h"

namespace shardtrain::parallel {

namespace {

using strategy::ShardedTensor;

class TensorParallelStrategy final : public strategy::Strategy {
 public:
  TensorParallelStrategy(std::unique_ptr<Strategy> inner, TensorParallelLayout layout,
                         std::shared_ptr<comm::Communicator> tp)
      : inner_(std::move(inner)), layout_(std::move(layout)), tp_(std::move(tp)) {}

  void setup(torch::nn::Module& model, std::shared_ptr<comm::Communicator> comm) override {
    throw InvalidArgument(
        "a tensor-parallel strategy is set up on the device mesh: call setup(model, mesh)");
  }
  void setup(torch::nn::Module& model, const comm::DeviceMesh& mesh) override {
    ST_CHECK(mesh.tp() == tp_, InvalidArgument, "setup: the mesh's tp group is not the one the model was split over");
    inner_->setup(model, mesh);
    // Once: which of the optimizer's tensors have gradients to sum over tp
    // (see finish_gradient_sync), and which count towards this rank's part
    // of the gradient norm (a split block always, a replicated parameter on
    // tp rank 0 only).
    const std::set<std::string> partial(layout_.partial_gradients.begin(), layout_.partial_gradients.end());
    for (const ShardedTensor& p : inner_->optimizer_parameters()) {
      const bool split = layout_.splits.count(p.name) > 0;
      if (!split && (layout_.sequence_parallel || partial.count(p.name) > 0)) summed_.push_back(p.local);
      if (split || tp_->rank() == 0) counted_.push_back(p.local);
    }
  }
  void set_gradient_sync(bool enabled) override { inner_->set_gradient_sync(enabled); }
  void keep_gathered_in_step(bool keep) override { inner_->keep_gathered_in_step(keep); }

  void finish_gradient_sync() override {
    inner_->finish_gradient_sync();
    // Each rank's gradient of a replicated parameter holds its part (under
    // sequence parallelism its tokens'; a LoRA matrix beside a split one,
    // its block's): the sum over tp is the whole.
    if (summed_.empty()) return;
    at::NoGradGuard no_grad;
    std::vector<at::Tensor> grads;
    for (const at::Tensor& p : summed_) {
      if (p.grad().defined()) grads.push_back(p.grad());
    }
    if (grads.empty()) return;
    std::vector<at::Tensor> flat_parts;
    for (const auto& g : grads) flat_parts.push_back(g.reshape({-1}).to(at::kFloat));
    at::Tensor flat = at::cat(flat_parts);
    tp_->all_reduce(flat);
    int64_t at = 0;
    for (auto& g : grads) {
      g.copy_(flat.narrow(0, at, g.numel()).view(g.sizes()));
      at += g.numel();
    }
  }

  std::vector<ShardedTensor> optimizer_parameters() override { return whole_view(inner_->optimizer_parameters()); }
  std::vector<at::Tensor> gradients() override { return inner_->gradients(); }

  // The global norm: a split parameter's blocks each once (summed over tp),
  // a replicated one once (tp rank 0's), the optimizer's slices summed over
  // the group they split the model over; every rank's gradients scaled.
  double clip_grad_norm(double max_norm) override {
    std::vector<at::Tensor> counted;
    for (const at::Tensor& p : counted_) {
      if (p.grad().defined()) counted.push_back(p.grad());
    }
    return strategy::detail::clip_grad_norm(counted, inner_->gradients(), max_norm,
                                            {inner_->optimizer_shard_group(), tp_.get()});
  }

  void optimizer_step(torch::optim::Optimizer& optimizer) override { inner_->optimizer_step(optimizer); }

  std::vector<ShardedTensor> sharded_state_dict() override { return whole_view(inner_->sharded_state_dict()); }

  // The inner strategy's whole tensors (of this rank's blocks, on dp rank
  // 0), then each split tensor assembled from the tp ranks' blocks on rank 0.
  // A LoRA base each rank quantized on its own block has no whole
  // quantized form: its blocks are dequantized and assembled as a weight.
  std::vector<std::pair<std::string, at::Tensor>> full_state_dict() override {
    std::vector<std::pair<std::string, at::Tensor>> out = models::dequantize_lora_bases(inner_->full_state_dict());
    if (out.empty()) return out;  // not dp rank 0: neither are the rest of this tp group
    const int n = tp_->size();
    for (auto& [name, local] : out) {
      const auto it = layout_.splits.find(name);
      if (it == layout_.splits.end()) continue;
      const TensorParallelLayout::Split& s = it->second;
      const auto numel_of = [&](const strategy::TensorChunk& c) {
        return c10::multiply_integers(c.shape(s.global_shape));
      };
      int64_t widest = 0;
      for (const auto& c : s.chunks) widest = std::max(widest, numel_of(c));
      at::Tensor mine = at::zeros({widest}, local.options());
      mine.narrow(0, 0, local.numel()).copy_(local.reshape({-1}));
      at::Tensor all = at::empty({n * widest}, local.options());
      tp_->all_gather(mine, all);
      if (tp_->rank() != 0) continue;
      at::Tensor whole = at::empty(s.global_shape, local.options());
      at::Tensor flat = whole.view({-1});
      for (int k = 0; k < n; ++k) {
        const strategy::TensorChunk& c = s.chunks[static_cast<size_t>(k)];
        for (const auto& run : strategy::chunk_runs(s.global_shape, c, 0, numel_of(c))) {
          flat.narrow(0, run.global, run.count).copy_(all.narrow(0, k * widest + run.local, run.count));
        }
      }
      local = whole;
    }
    if (tp_->rank() != 0) out.clear();
    return out;
  }

  void reload_parameters() override { inner_->reload_parameters(); }
  std::string name() const override { return inner_->name() + "+tp" + std::to_string(tp_->size()); }
  int64_t gradient_collectives() const override { return inner_->gradient_collectives(); }
  strategy::CommStats comm_stats() const override { return inner_->comm_stats(); }
  comm::Communicator* optimizer_shard_group() const override { return inner_->optimizer_shard_group(); }

 private:
  // The inner strategy's tensors with their place in the whole model: a
  // split parameter (or its optimizer state, named after it) records its
  // block; a replicated one is written by tp rank 0 alone.
  std::vector<ShardedTensor> whole_view(std::vector<ShardedTensor> tensors) const {
    for (ShardedTensor& t : tensors) {
      const auto it = layout_.splits.find(t.name);
      if (it == layout_.splits.end()) {
        t.primary = t.primary && tp_->rank() == 0;
        continue;
      }
      t.global_shape = it->second.global_shape;
      t.chunk = it->second.chunks[static_cast<size_t>(tp_->rank())];
    }
    return tensors;
  }

  std::unique_ptr<Strategy> inner_;
  TensorParallelLayout layout_;
  std::shared_ptr<comm::Communicator> tp_;
  std::vector<at::Tensor> summed_, counted_;
};

}  // namespace

std::unique_ptr<strategy::Strategy> tensor_parallel_strategy(std::unique_ptr<strategy::Strategy> inner,
                                                             TensorParallelLayout layout,
                                                             std::shared_ptr<comm::Communicator> tp) {
  ST_CHECK(inner != nullptr && tp != nullptr, InvalidArgument, "tensor_parallel_strategy needs a strategy and a tp group");
  return std::make_unique<TensorParallelStrategy>(std::move(inner), std::move(layout), std::move(tp));
}

}  // namespace shardtrain::parallel
