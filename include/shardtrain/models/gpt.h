// A GPT-2-architecture decoder for the LibTorch C++ frontend.
//
// Learned position embeddings, pre-LayerNorm blocks, causal self-attention
// with a fused qkv projection, GELU (tanh approximation), biases everywhere,
// LayerNorm eps 1e-5, and the output projection tied to the token embedding.
// Parameter names follow Hugging Face GPT-2 (wte.weight, wpe.weight,
// h.0.ln_1.weight, h.0.attn.c_attn.weight, h.0.attn.c_proj.bias,
// h.0.ln_2.*, h.0.mlp.c_fc.*, h.0.mlp.c_proj.*, ln_f.*), but weights keep
// LibTorch's Linear layout [out, in]; HF's Conv1D stores [in, out].
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <cstdint>

#include "shardtrain/models/causal_lm.h"

namespace shardtrain::config {
struct ModelConfig;
}

namespace shardtrain::models {

struct GPTConfig {
  int64_t n_layer = 4;
  int64_t n_head = 4;
  int64_t n_embd = 128;
  int64_t block_size = 128;
  int64_t vocab_size = 256;
  /// Recompute each block's forward during backward (models/checkpoint.h)
  /// instead of keeping its activations; only while training with grad on.
  bool activation_checkpointing = false;
  /// Dropout probability in training mode: on the embeddings, the attention
  /// weights and each residual branch's output (as nanoGPT); 0: none.
  double dropout = 0.0;
  /// Build with every parameter deferred (core/deferred.h) as each
  /// submodule is made, and no initialisation: the weights come from files.
  bool deferred = false;

  /// From the config's model section.
  static GPTConfig from(const config::ModelConfig& m);

  /// Throws ConfigError naming the field when a value is impossible
  /// (non-positive sizes, n_embd not divisible by n_head, dropout outside
  /// [0, 1)).
  void validate() const;
  /// Number of parameters of the model this config builds (tied weights once).
  int64_t num_parameters() const;
};

/// Causal self-attention with one fused qkv projection (c_attn) and an output
/// projection (c_proj).
class CausalSelfAttentionImpl : public torch::nn::Module {
 public:
  explicit CausalSelfAttentionImpl(const GPTConfig& config);
  /// x: [B, T, C] -> [B, T, C]; segment as CausalLMImpl::forward; the
  /// cache entries (keys, values) are appended to when given.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& segment = {},
                        torch::Tensor* cache_k = nullptr, torch::Tensor* cache_v = nullptr);

  torch::nn::Linear c_attn{nullptr};
  torch::nn::Linear c_proj{nullptr};

 private:
  int64_t n_head_;
  double dropout_;
};
TORCH_MODULE(CausalSelfAttention);

/// The position-wise MLP: c_fc (C -> 4C), GELU (tanh), c_proj (4C -> C).
class MLPBlockImpl : public torch::nn::Module {
 public:
  explicit MLPBlockImpl(const GPTConfig& config);
  torch::Tensor forward(const torch::Tensor& x);

  torch::nn::Linear c_fc{nullptr};
  torch::nn::Linear c_proj{nullptr};

 private:
  double dropout_;
};
TORCH_MODULE(MLPBlock);

/// One pre-LayerNorm transformer block: x + attn(ln_1(x)), then + mlp(ln_2(x)).
class BlockImpl : public torch::nn::Module {
 public:
  explicit BlockImpl(const GPTConfig& config);
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& segment = {},
                        torch::Tensor* cache_k = nullptr, torch::Tensor* cache_v = nullptr);

  torch::nn::LayerNorm ln_1{nullptr};
  CausalSelfAttention attn{nullptr};
  torch::nn::LayerNorm ln_2{nullptr};
  MLPBlock mlp{nullptr};
};
TORCH_MODULE(Block);

class GPTImpl : public CausalLMImpl {
 public:
  explicit GPTImpl(const GPTConfig& config);

  /// idx: [B, T] int64 token ids with T <= block_size -> logits [B, T, vocab];
  /// position and segment as CausalLMImpl::forward (positions index wpe).
  torch::Tensor forward(const torch::Tensor& idx, const torch::Tensor& position = {},
                        const torch::Tensor& segment = {}) override;
  torch::Tensor forward_cached(const torch::Tensor& idx, KVCache& cache) override;
  int64_t vocab_size() const override { return config_.vocab_size; }
  int64_t context_size() const override { return config_.block_size; }

  const GPTConfig& config() const { return config_; }
  std::vector<int64_t> pipeline_unit_parameters() const override;
  torch::Tensor forward_units(int first, int end, const torch::Tensor& input, const torch::Tensor& position,
                              const torch::Tensor& segment) override;
  void keep_units(const std::vector<std::pair<int, int>>& ranges) override;

  torch::nn::Embedding wte{nullptr};
  torch::nn::Embedding wpe{nullptr};
  torch::nn::ModuleList h{nullptr};
  torch::nn::LayerNorm ln_f{nullptr};

 private:
  // Units [first, end) (see CausalLMImpl::forward_units).
  torch::Tensor run(int first, int end, const torch::Tensor& input, const torch::Tensor& position,
                    const torch::Tensor& segment);
  GPTConfig config_;
  // Per unit, whether this model still holds it (keep_units); empty: all.
  std::vector<bool> kept_;
};
TORCH_MODULE(GPT);

}  // namespace shardtrain::models
