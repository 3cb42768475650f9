// A small multi-layer perceptron for tests and examples: Linear, GELU,
// Linear, ... with parameter names layers.0.weight, layers.0.bias, ...
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <vector>

namespace shardtrain::models {

class MLPImpl : public torch::nn::Module {
 public:
  /// sizes = {in, hidden..., out}; at least two entries.
  explicit MLPImpl(std::vector<int64_t> sizes);
  /// x: [..., in] -> [..., out]; GELU between layers, none after the last.
  torch::Tensor forward(const torch::Tensor& x);

  torch::nn::ModuleList layers{nullptr};
};
TORCH_MODULE(MLP);

}  // namespace shardtrain::models
