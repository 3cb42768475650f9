// A small multi-layer perceptron for tests and examples.
#include "shardtrain/models/mlp.h"

#include <torch/torch.h>

#include "shardtrain/core/error.h"
#include "shardtrain/models/lora.h"

namespace shardtrain::models {

MLPImpl::MLPImpl(std::vector<int64_t> sizes) {
  ST_CHECK(sizes.size() >= 2, InvalidArgument, "MLP needs at least two sizes {in, out}, got ",
           sizes.size(), "; hint: pass {in, hidden..., out}");
  for (size_t i = 0; i < sizes.size(); ++i) {
    ST_CHECK(sizes[i] > 0, InvalidArgument, "MLP size ", i, " is ", sizes[i],
             "; every layer width must be positive");
  }
  layers = register_module("layers", torch::nn::ModuleList());
  for (size_t i = 0; i + 1 < sizes.size(); ++i) {
    layers->push_back(torch::nn::Linear(sizes[i], sizes[i + 1]));
  }
}

torch::Tensor MLPImpl::forward(const torch::Tensor& x) {
  auto y = x;
  const size_t n = layers->size();
  for (size_t i = 0; i < n; ++i) {
    y = lora_forward(*layers[i]->as<torch::nn::LinearImpl>(), y);
    if (i + 1 < n) y = torch::gelu(y, "tanh");
  }
  return y;
}

}  // namespace shardtrain::models
