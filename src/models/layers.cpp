#include "models/layers.h"

#include "shardtrain/core/deferred.h"

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

}  // namespace shardtrain::models::detail
