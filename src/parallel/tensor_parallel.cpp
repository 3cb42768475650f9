// apply_tensor_parallel: each rank keeps its block of every parameter the
// family's plan splits, and the plan's regions learn their group.
#include "shardtrain/parallel/tensor_parallel.h"

#include <torch/torch.h>

#include "models/tensor_parallel.h"
#include "shardtrain/comm/communicator.h"
#include "shardtrain/core/deferred.h"
#include "shardtrain/core/error.h"
#include "shardtrain/models/family.h"
#include "shardtrain/models/lora.h"

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

}  // namespace

TensorParallelLayout apply_tensor_parallel(torch::nn::Module& model, const models::TensorParallelPlan& plan,
                                           std::shared_ptr<comm::Communicator> tp,
                                           const TensorParallelOptions& options) {
  ST_CHECK(tp != nullptr, InvalidArgument, "apply_tensor_parallel needs the mesh's tp group");
  ST_CHECK(!plan.regions.empty(), ConfigError, "distributed.tensor_parallel=", tp->size(),
           ": this model family has no tensor-parallel plan (gpt and llama have one); set it to 1");
  const int n = tp->size(), r = tp->rank();
  TensorParallelLayout layout;
  layout.sequence_parallel = options.sequence_parallel();
  auto group = std::make_shared<models::detail::TensorParallelGroup>();
  group->comm = tp;
  group->sequence_parallel = options.sequence_parallel();
  group->loss_parallel = options.loss_parallel();

  // Every rank's block of a parameter, this rank's kept.
  const auto keep = [&](const std::string& name, const at::Tensor& param, int64_t dim, int parts) {
    TensorParallelLayout::Split s;
    s.global_shape = param.sizes().vec();
    for (int k = 0; k < n; ++k) s.chunks.push_back(split(dim, s.global_shape[dim], parts, n, k, name));
    keep_block(param, s.chunks[static_cast<size_t>(r)]);
    layout.splits[name] = std::move(s);
  };
  std::vector<torch::nn::Module*> regions;
  for (const auto& item : model.named_modules(/*name_prefix=*/"", /*include_self=*/false)) {
    const std::string& path = item.key();
    torch::nn::Module& m = *item.value();
    ST_CHECK(!models::has_lora(m), ConfigError, "distributed.tensor_parallel does not split LoRA adapters yet (",
             path, " carries one); set distributed.tensor_parallel: 1 with lora.r > 0");
    for (const auto& region : plan.regions) {
      if (matches(path, region)) regions.push_back(&m);
    }
    if (auto* linear = dynamic_cast<torch::nn::LinearImpl*>(&m)) {
      for (const auto& [entry, parts] : plan.column) {
        if (!matches(path, entry)) continue;
        keep(path + ".weight", linear->weight, 0, parts);
        if (linear->bias.defined()) keep(path + ".bias", linear->bias, 0, parts);
      }
      for (const auto& entry : plan.row) {
        if (matches(path, entry)) keep(path + ".weight", linear->weight, 1, 1);
      }
      if (path == plan.head) keep(path + ".weight", linear->weight, 0, 1);
    }
    if (auto* embedding = dynamic_cast<torch::nn::EmbeddingImpl*>(&m); embedding != nullptr && path == plan.embedding) {
      group->vocab_size = embedding->weight.size(0);
      keep(path + ".weight", embedding->weight, 0, 1);
      group->vocab_start = layout.splits[path + ".weight"].chunks[static_cast<size_t>(r)].ranges[0].first;
      group->vocab_local = embedding->weight.size(0);
    }
  }
  ST_CHECK(group->vocab_size > 0, ConfigError, "the tensor-parallel plan's embedding '", plan.embedding,
           "' is no Embedding of this model");
  for (torch::nn::Module* m : regions) models::detail::set_tensor_parallel(*m, group);
  models::detail::set_tensor_parallel(model, group);
  return layout;
}

}  // namespace shardtrain::parallel
