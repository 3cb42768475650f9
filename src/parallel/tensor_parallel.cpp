// apply_tensor_parallel: each rank keeps its block of every parameter the
// family's plan splits, and the plan's regions learn their group.
#include "shardtrain/parallel/tensor_parallel.h"

#include <torch/torch.h>

#include "models/tensor_parallel.h"
#include "shardtrain/comm/communicator.h"
#include "shardtrain/core/deferred.h"
#include "shardtrain/core/error.h"
#include "shardtrain/models/family.h"

namespace shardtrain::parallel {

namespace {

using strategy::TensorChunk;

// Whether module path `path` is the plan's `entry` or ends in "." + entry.
bool matches(const std::string& path, const std::string& entry) {
  if (entry.empty()) return false;
  if (path == entry) return true;
  return path.size() > entry.size() && path.compare(path.size() - entry.size(), entry.size(), entry) == 0 &&
         path[path.size() - entry.size() - 1] == '.';
}

// The blocks of `size` elements along a dimension that rank r holds when
// each of `parts` equal consecutive blocks is split over tp ranks.
TensorChunk split(int64_t dim, int64_t size, int parts, int tp, int r, const std::string& name) {
  const int64_t part = size / parts;
  ST_CHECK(part >= tp, ConfigError, "tensor parallelism splits ", name, " (", size,
           " along dimension ", dim, parts > 1 ? ", per third" : "", ") over distributed.tensor_parallel=",
           tp, " ranks; lower distributed.tensor_parallel");
  TensorChunk c;
  c.dim = dim;
  for (int q = 0; q < parts; ++q) {
    const comm::ShardRange s = comm::shard_range(part, tp, r);
    c.ranges.emplace_back(q * part + s.offset, s.count);
  }
  return c;
}

// Replaces `param`'s values by this rank's block of them. A deferred
// weight stays deferred: its reader is asked for the block's runs only.
void keep_block(const at::Tensor& param, const TensorChunk& chunk) {
  at::NoGradGuard no_grad;
  const std::vector<int64_t> global = param.sizes().vec();
  const std::vector<int64_t> local_shape = chunk.shape(global);
  if (is_deferred(param)) {
    const at::Tensor whole = param.variable_data();  // keeps the reader of the whole tensor
    param.set_data(deferred_tensor(local_shape, param.scalar_type(),
                                   [whole, global, chunk](int64_t first, const at::Tensor& out) {
                                     for (const auto& run : strategy::chunk_runs(global, chunk, first, out.numel())) {
                                       read_deferred(whole, run.global, out.narrow(0, run.local, run.count));
                                     }
                                   }));
    return;
  }
  std::vector<at::Tensor> blocks;
  for (const auto& [start, length] : chunk.ranges) blocks.push_back(param.narrow(chunk.dim, start, length));
  param.set_data(at::cat(blocks, chunk.dim).contiguous());
}

// The adapter matrix `name` (lora_A or lora_B) of an adapted Linear, or null.
torch::nn::LinearImpl* adapter(torch::nn::LinearImpl& layer, const char* name) {
  for (const auto& child : layer.named_children()) {
    if (child.key() == name) return dynamic_cast<torch::nn::LinearImpl*>(child.value().get());
  }
  return nullptr;
}

}  // namespace

TensorParallelLayout split_for_tensor_parallel(torch::nn::Module& model, const models::TensorParallelPlan& plan,
                                              int tp, int rank, bool whole_model) {
  ST_CHECK(tp >= 1 && rank >= 0 && rank < tp, InvalidArgument, "split_for_tensor_parallel: rank ", rank,
           " of ", tp);
  ST_CHECK(!plan.regions.empty(), ConfigError, "distributed.tensor_parallel=", tp,
           ": this model family has no tensor-parallel plan (gpt and llama have one); set it to 1");
  TensorParallelLayout layout;
  // Every rank's block of a parameter, this rank's kept.
  const auto keep = [&](const std::string& name, const at::Tensor& param, int64_t dim, int parts) {
    TensorParallelLayout::Split s;
    s.global_shape = param.sizes().vec();
    for (int k = 0; k < tp; ++k) s.chunks.push_back(split(dim, s.global_shape[dim], parts, tp, k, name));
    keep_block(param, s.chunks[static_cast<size_t>(rank)]);
    layout.splits[name] = std::move(s);
  };
  // A Linear split along its output (dim 0) or its input (dim 1), with its
  // adapter: B's rows follow the output, A's columns the input; the other
  // matrix stays whole and its gradient is partial.
  const auto split_linear = [&](const std::string& path, torch::nn::LinearImpl& linear, int64_t dim, int parts) {
    ST_CHECK(linear.weight.defined(), ConfigError, "tensor parallelism splits '", path,
             "', whose LoRA base is already quantized; quantize after the split (models::quantize_lora_bases)");
    keep(path + ".weight", linear.weight, dim, parts);
    if (dim == 0 && linear.bias.defined()) keep(path + ".bias", linear.bias, 0, parts);
    torch::nn::LinearImpl* a = adapter(linear, "lora_A");
    torch::nn::LinearImpl* b = adapter(linear, "lora_B");
    if (a == nullptr || b == nullptr) return;
    if (dim == 0) {
      keep(path + ".lora_B.weight", b->weight, 0, parts);
      layout.partial_gradients.push_back(path + ".lora_A.weight");
    } else {
      keep(path + ".lora_A.weight", a->weight, 1, parts);
      layout.partial_gradients.push_back(path + ".lora_B.weight");
    }
  };
  bool embedding_found = false;
  for (const auto& item : model.named_modules(/*name_prefix=*/"", /*include_self=*/false)) {
    const std::string& path = item.key();
    torch::nn::Module& m = *item.value();
    if (auto* linear = dynamic_cast<torch::nn::LinearImpl*>(&m)) {
      for (const auto& [entry, parts] : plan.column) {
        if (matches(path, entry)) split_linear(path, *linear, 0, parts);
      }
      for (const auto& entry : plan.row) {
        if (matches(path, entry)) split_linear(path, *linear, 1, 1);
      }
      if (path == plan.head) split_linear(path, *linear, 0, 1);
    }
    if (auto* embedding = dynamic_cast<torch::nn::EmbeddingImpl*>(&m); embedding != nullptr && path == plan.embedding) {
      keep(path + ".weight", embedding->weight, 0, 1);
      embedding_found = true;
    }
  }
  ST_CHECK(embedding_found || !whole_model, ConfigError, "the tensor-parallel plan's embedding '", plan.embedding,
           "' is no Embedding of this model");
  return layout;
}

TensorParallelLayout apply_tensor_parallel(torch::nn::Module& model, const models::TensorParallelPlan& plan,
                                           std::shared_ptr<comm::Communicator> tp,
                                           const TensorParallelOptions& options) {
  ST_CHECK(tp != nullptr, InvalidArgument, "apply_tensor_parallel needs the mesh's tp group");
  TensorParallelLayout layout = split_for_tensor_parallel(model, plan, tp->size(), tp->rank(), options.whole_model());
  layout.sequence_parallel = options.sequence_parallel();
  auto group = std::make_shared<models::detail::TensorParallelGroup>();
  group->comm = tp;
  group->sequence_parallel = options.sequence_parallel();
  group->loss_parallel = options.loss_parallel();
  // The vocabulary's split, from the embedding or the head (split alike); a
  // pipeline stage that holds neither never uses it.
  auto vocab = layout.splits.find(plan.embedding + ".weight");
  if (vocab == layout.splits.end()) vocab = layout.splits.find(plan.head + ".weight");
  if (vocab != layout.splits.end()) {
    const strategy::TensorChunk& mine = vocab->second.chunks[static_cast<size_t>(tp->rank())];
    group->vocab_size = vocab->second.global_shape[0];
    group->vocab_start = mine.ranges[0].first;
    group->vocab_local = mine.ranges[0].second;
  }
  for (const auto& item : model.named_modules(/*name_prefix=*/"", /*include_self=*/false)) {
    for (const auto& region : plan.regions) {
      if (matches(item.key(), region)) models::detail::set_tensor_parallel(*item.value(), group);
    }
  }
  models::detail::set_tensor_parallel(model, group);
  return layout;
}

}  // namespace shardtrain::parallel
