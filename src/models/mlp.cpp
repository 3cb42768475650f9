// A small multi-layer perceptron for tests and examples.
#include "shardtrain/models/mlp.h"

#include <torch/torch.h>

#include "shardtrain/core/deferred.h"
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

// ---- the family ------------------------------------------------------------------------

#include "models/families.h"
#include "shardtrain/config/config.h"
#include "shardtrain/strategy/estimate.h"

namespace shardtrain::models {

namespace {

class MlpFamily final : public ModelFamily {
 public:
  train::ModelType type() const override { return train::ModelType::Mlp; }
  void validate(const config::ModelConfig& m) const override {
    ST_CHECK(m.mlp_sizes.size() >= 2, ConfigError, "model.mlp_sizes needs at least two widths");
  }
  std::shared_ptr<torch::nn::Module> build(const config::ModelConfig& m, bool deferred) const override {
    auto model = std::make_shared<MLPImpl>(m.mlp_sizes);
    if (deferred) defer_parameters(*model);  // small: built whole, then deferred
    return model;
  }
  double num_parameters(const config::ModelConfig& m) const override {
    double n = 0.0;
    for (size_t i = 0; i + 1 < m.mlp_sizes.size(); ++i) {
      const double in = static_cast<double>(m.mlp_sizes[i]);
      const double out = static_cast<double>(m.mlp_sizes[i + 1]);
      n += in * out + out;  // weight and bias
    }
    return n;
  }
  double activation_bytes(const config::ModelConfig& m, int64_t micro, int bytes) const override {
    return static_cast<double>(strategy::mlp_activation_bytes(m.mlp_sizes, micro, bytes));
  }
  std::string size_text(const config::ModelConfig& m) const override {
    std::string widths;
    for (const int64_t w : m.mlp_sizes) widths += (widths.empty() ? "" : ", ") + std::to_string(w);
    return "model.mlp_sizes=[" + widths + "]";
  }
  std::vector<std::string> lora_targets() const override { return {"layers"}; }
  std::string peft_prefix() const override { return "base_model.model."; }
  bool language_model() const override { return false; }
  std::string unit_type() const override { return "LinearImpl"; }
};

}  // namespace

const ModelFamily& mlp_family() {
  static const MlpFamily family;
  return family;
}

}  // namespace shardtrain::models
