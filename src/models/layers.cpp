#include "models/layers.h"

#include <algorithm>

#include "shardtrain/core/deferred.h"
#include "shardtrain/core/error.h"

namespace shardtrain::models::detail {

torch::nn::Linear make_linear(int64_t in, int64_t out, bool bias, bool deferred) {
  if (!deferred) return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(bias));
  torch::nn::Linear layer(torch::nn::LinearOptions(1, 1).bias(bias));
  layer->options.in_features(in).out_features(out);
  layer->weight.set_data(deferred_tensor({out, in}, at::kFloat, nullptr));
  if (bias) layer->bias.set_data(deferred_tensor({out}, at::kFloat, nullptr));
  return layer;
}

torch::nn::Embedding make_embedding(int64_t count, int64_t dim, bool deferred) {
  if (!deferred) return torch::nn::Embedding(count, dim);
  torch::nn::Embedding layer(1, 1);
  layer->options.num_embeddings(count).embedding_dim(dim);
  layer->weight.set_data(deferred_tensor({count, dim}, at::kFloat, nullptr));
  return layer;
}

std::vector<bool> kept_units(const std::vector<std::pair<int, int>>& ranges, int units, const char* model) {
  std::vector<bool> kept(static_cast<size_t>(units), false);
  for (const auto& [first, end] : ranges) {
    ST_CHECK(0 <= first && first < end && end <= units, InvalidArgument, model, "::keep_units: units [", first,
             ", ", end, ") are not a non-empty range of the model's ", units);
    for (int u = first; u < end; ++u) kept[static_cast<size_t>(u)] = true;
  }
  ST_CHECK(!ranges.empty(), InvalidArgument, model, "::keep_units: no unit to keep");
  return kept;
}

void check_units(const std::vector<bool>& kept, int first, int end, int units, const char* model) {
  ST_CHECK(0 <= first && first < end && end <= units, InvalidArgument, model, ": units [", first, ", ", end,
           ") are not a non-empty range of the model's ", units);
  if (kept.empty()) return;
  for (int u = first; u < end; ++u) {
    ST_CHECK(kept[static_cast<size_t>(u)], InvalidArgument, model, ": unit ", u,
             " is not held here (this rank keeps other pipeline stages); forward() runs whole models only");
  }
}

std::pair<int, int> unit_layers(int first, int end, int layers) {
  return {std::max(first, 1) - 1, std::min(end, layers + 1) - 1};
}

void keep_layers(torch::nn::Module& parent, const std::string& name, torch::nn::ModuleList& list,
                 const std::vector<bool>& kept) {
  auto held = std::make_shared<torch::nn::Module>("ModuleList");
  for (size_t i = 0; i < list->size(); ++i) {
    auto layer = list->ptr(i);
    if (kept[i + 1]) {
      held->register_module(std::to_string(i), layer);
    } else {
      defer_parameters(*layer);
    }
  }
  parent.replace_module(name, held);
}

void drop_module(torch::nn::Module& parent, const std::string& name, torch::nn::Module& module) {
  defer_parameters(module);
  parent.unregister_module(name);
}

}  // namespace shardtrain::models::detail
