// The Llama family of decoders (Llama 2/3, Mistral, Qwen2), computed as
// Hugging Face's LlamaForCausalLM computes it:
//
//   x = embed_tokens(idx)
//   per layer: x += o_proj(attn(rope(q_proj(n)), rope(k_proj(n)), v_proj(n))), n = input_layernorm(x)
//              x += down_proj(silu(gate_proj(n)) * up_proj(n)),           n = post_attention_layernorm(x)
//   logits = lm_head(norm(x))        (lm_head is embed_tokens when tied)
//
// RMSNorm normalises in fp32, casts back, then multiplies by its weight.
// Rotary embeddings pair channel i with channel i + d/2 of each head
// (rotate-half), with base rope_theta and optionally Llama-3's scaling of the
// long wavelengths. Grouped-query attention: query head h reads key/value
// head h / (n_head / n_kv_head). Parameter names are Hugging Face's
// (model.layers.0.self_attn.q_proj.weight, lm_head.weight), in nn.Linear's
// [out, in] layout, so a Hugging Face directory loads name for name.
#pragma once

#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <cstdint>

#include "shardtrain/models/causal_lm.h"
#include "shardtrain/train/choices.h"

namespace shardtrain::config {
struct ModelConfig;
}

namespace shardtrain::models {

struct LlamaConfig {
  int64_t vocab_size = 256;
  int64_t hidden_size = 128;
  int64_t intermediate_size = 384;
  int64_t num_layers = 4;
  int64_t num_heads = 4;
  int64_t num_kv_heads = 4;
  int64_t head_dim = 32;
  int64_t block_size = 64;
  /// Positions the rotary tables cover (>= block_size; generation may run past block_size).
  int64_t max_positions = 64;
  double rope_theta = 10000.0;
  train::RopeScaling rope_scaling = train::RopeScaling::None;
  double rope_factor = 8.0;
  double rope_low_freq_factor = 1.0;
  double rope_high_freq_factor = 4.0;
  int64_t rope_original_max_position = 8192;
  double rms_norm_eps = 1e-5;
  bool tie_word_embeddings = false;
  train::AttentionBias attention_bias = train::AttentionBias::None;
  bool mlp_bias = false;
  double attention_dropout = 0.0;
  bool activation_checkpointing = false;
  /// Build with every parameter deferred (core/deferred.h) as each
  /// submodule is made, and no initialisation: the weights come from files.
  bool deferred = false;

  /// From the model section, defaults resolved (n_kv_head 0, head_dim 0, ...).
  static LlamaConfig from(const config::ModelConfig& m);
  /// ConfigError naming the model.* key of an impossible value.
  void validate() const;
  int64_t num_parameters() const;
};

/// Root-mean-square layer norm, as Hugging Face's LlamaRMSNorm.
class RMSNormImpl : public torch::nn::Module {
 public:
  RMSNormImpl(int64_t dim, double eps);
  at::Tensor forward(const at::Tensor& x);
  at::Tensor weight;

 private:
  double eps_;
};
TORCH_MODULE(RMSNorm);

/// The rotary tables: cos and sin [max_positions, head_dim] (fp32), each
/// frequency repeated for the two halves of a head.
struct RotaryTables {
  at::Tensor cos;
  at::Tensor sin;
};
/// The inverse frequencies [head_dim / 2] (fp32), Llama-3 scaling applied.
at::Tensor rope_inverse_frequencies(const LlamaConfig& c);
RotaryTables rotary_tables(const LlamaConfig& c);
/// x [B, H, T, d] rotated at positions [B, T] (rotate-half pairing).
at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

namespace llama {

class AttentionImpl : public torch::nn::Module {
 public:
  explicit AttentionImpl(const LlamaConfig& c);
  /// x [B, T, C]; cos/sin [B, T, d]; segment as CausalLM::forward; cache
  /// entries (k, v) appended when given.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                     const at::Tensor& segment, at::Tensor* cache_k = nullptr,
                     at::Tensor* cache_v = nullptr);
  torch::nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};

 private:
  int64_t heads_, kv_heads_, head_dim_;
  double dropout_;
};
TORCH_MODULE(Attention);

class MLPImpl : public torch::nn::Module {
 public:
  explicit MLPImpl(const LlamaConfig& c);
  at::Tensor forward(const at::Tensor& x);
  torch::nn::Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
};
TORCH_MODULE(MLP);

/// One decoder layer: the family's wrap unit (named BlockImpl as GPT's is, so
/// the default auto-wrap policy finds both).
class BlockImpl : public torch::nn::Module {
 public:
  explicit BlockImpl(const LlamaConfig& c);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                     const at::Tensor& segment, at::Tensor* cache_k = nullptr,
                     at::Tensor* cache_v = nullptr);
  RMSNorm input_layernorm{nullptr};
  Attention self_attn{nullptr};
  RMSNorm post_attention_layernorm{nullptr};
  MLP mlp{nullptr};
};
TORCH_MODULE(Block);

/// The decoder without its head: Hugging Face's LlamaModel ("model.").
class ModelImpl : public torch::nn::Module {
 public:
  explicit ModelImpl(const LlamaConfig& c);
  torch::nn::Embedding embed_tokens{nullptr};
  torch::nn::ModuleList layers{nullptr};
  RMSNorm norm{nullptr};
};
TORCH_MODULE(Model);

}  // namespace llama

class LlamaImpl : public CausalLMImpl {
 public:
  explicit LlamaImpl(const LlamaConfig& config);
  at::Tensor forward(const at::Tensor& idx, const at::Tensor& position = {},
                     const at::Tensor& segment = {}) override;
  at::Tensor forward_cached(const at::Tensor& idx, KVCache& cache) override;
  int64_t vocab_size() const override { return config_.vocab_size; }
  int64_t context_size() const override { return config_.max_positions; }
  const LlamaConfig& config() const { return config_; }
  std::vector<int64_t> pipeline_unit_parameters() const override;
  at::Tensor forward_units(int first, int end, const at::Tensor& input, const at::Tensor& position,
                           const at::Tensor& segment) override;
  void keep_units(const std::vector<std::pair<int, int>>& ranges) override;

  llama::Model model{nullptr};
  /// Undefined when tie_word_embeddings (the head is model.embed_tokens).
  torch::nn::Linear lm_head{nullptr};

 private:
  // Units [first, end) (see CausalLMImpl::forward_units).
  at::Tensor run(int first, int end, const at::Tensor& input, const at::Tensor& position,
                 const at::Tensor& segment, KVCache* cache);
  LlamaConfig config_;
  RotaryTables rotary_;
  // Per unit, whether this model still holds it (keep_units); empty: all.
  std::vector<bool> kept_;
};
TORCH_MODULE(Llama);

}  // namespace shardtrain::models
