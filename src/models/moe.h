// The mixture-of-experts decoder both MoE families build (mixtral.cpp,
// qwen3_moe.cpp): the Llama decoder (models/llama.h: RMSNorm, rotary
// embeddings, grouped-query attention) whose MLP is, in the layers the family
// chooses, a sparse block:
//
//   logits = gate(x)                       [N, E] for the N tokens of the forward
//   p = softmax(logits) in fp32; (w, e) = top-k of p; w /= sum(w) when renormalised
//   y[t] = sum over t's k slots of w * down(silu(gate_proj(x[t])) * up_proj(x[t]))
//
// computed grouped by expert: the (token, slot) assignments are sorted by
// expert, each expert runs one matmul chain over its gathered tokens (zero
// rows when none reach it: nothing computed, and its gradients are zeros
// rather than missing, so every data-parallel strategy reduces the same
// tensors), and the weighted outputs are summed back into place with one
// index_add.
//
// Load balance (the Switch / Mixtral auxiliary loss): over the tokens of one
// forward, pooled over every MoE layer as Hugging Face concatenates the
// layers' router logits, aux = E * sum_e f_e * P_e with f_e the token slots
// routed to e per token and P_e the mean router probability of e.
#pragma once

#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "shardtrain/models/causal_lm.h"
#include "shardtrain/models/family.h"
#include "shardtrain/models/llama.h"

namespace shardtrain::models::moe {

struct MoeConfig {
  /// Attention, norms, rotary tables and the dense layers' MLP (intermediate_size).
  LlamaConfig base;
  int64_t num_experts = 8;
  int64_t top_k = 2;
  /// Each expert's SwiGLU width.
  int64_t expert_size = 0;
  /// Renormalise the top-k weights to sum 1.
  bool norm_topk = true;
  /// Qwen3: RMSNorm over each query and key head (q_norm, k_norm) before rotary.
  bool qk_norm = false;
  /// Per layer: the sparse block (true) or the dense MLP.
  std::vector<bool> sparse;
  /// The sparse block's module name ("block_sparse_moe", "mlp") and its
  /// experts' gate, up and down projections ({"w1", "w3", "w2"}, ...).
  std::string block_name = "mlp";
  std::array<std::string, 3> expert_names = {"gate_proj", "up_proj", "down_proj"};
  /// Weight of the load-balancing loss in the training loss; 0: logged only.
  double aux_weight = 0.0;

  int64_t sparse_layers() const;
  /// Parameters, every expert counted.
  int64_t num_parameters() const;
  /// ConfigError naming the model.* key of an impossible value.
  void validate() const;
};

/// The routers' statistics over the forward so far: token slots per expert
/// (no graph), router probabilities summed per expert (with their graph when
/// the loss trains) and the router rows seen (tokens x MoE layers).
struct RouterStats {
  at::Tensor slots;
  at::Tensor probs;
  int64_t rows = 0;
  /// E * sum_e (slots_e / rows) * (probs_e / rows); undefined when no row.
  at::Tensor aux_loss(int64_t num_experts) const;
};

/// One expert: down(silu(gate(x)) * up(x)), under the family's names.
class ExpertImpl : public torch::nn::Module {
 public:
  explicit ExpertImpl(const MoeConfig& c);
  at::Tensor forward(const at::Tensor& x);
  torch::nn::Linear gate{nullptr}, up{nullptr}, down{nullptr};
};
TORCH_MODULE(Expert);

/// The router (`gate`, [E, hidden]) and the experts.
class SparseMoeImpl : public torch::nn::Module {
 public:
  explicit SparseMoeImpl(const MoeConfig& c);
  /// x [..., C] -> [..., C]; adds the router's statistics to `stats` when given.
  at::Tensor forward(const at::Tensor& x, RouterStats* stats = nullptr);
  torch::nn::Linear gate{nullptr};
  torch::nn::ModuleList experts{nullptr};

 private:
  // The tokens flat [N, C] through their experts, summed back in place.
  at::Tensor grouped_experts(const at::Tensor& flat, const at::Tensor& top_w, const at::Tensor& top_e);
  int64_t top_k_;
  bool norm_topk_;
  bool train_aux_;
};
TORCH_MODULE(SparseMoe);

/// Grouped-query attention as the Llama family's, with Qwen3's per-head
/// q_norm and k_norm when configured.
class AttentionImpl : public torch::nn::Module {
 public:
  explicit AttentionImpl(const MoeConfig& c);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& segment,
                     at::Tensor* cache_k = nullptr, at::Tensor* cache_v = nullptr);
  torch::nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
  RMSNorm q_norm{nullptr}, k_norm{nullptr};

 private:
  int64_t head_dim_;
  double dropout_;
};
TORCH_MODULE(Attention);

/// One decoder layer (the wrap unit, named BlockImpl as the other families').
class BlockImpl : public torch::nn::Module {
 public:
  BlockImpl(const MoeConfig& c, bool sparse);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& segment,
                     RouterStats* stats, at::Tensor* cache_k = nullptr, at::Tensor* cache_v = nullptr);
  RMSNorm input_layernorm{nullptr};
  Attention self_attn{nullptr};
  RMSNorm post_attention_layernorm{nullptr};
  /// One of the two, registered under the family's name.
  SparseMoe moe{nullptr};
  llama::MLP mlp{nullptr};
};
TORCH_MODULE(Block);

class ModelImpl : public torch::nn::Module {
 public:
  explicit ModelImpl(const MoeConfig& c);
  torch::nn::Embedding embed_tokens{nullptr};
  torch::nn::ModuleList layers{nullptr};
  RMSNorm norm{nullptr};
};
TORCH_MODULE(Model);

/// The decoder with its head; parameter names are Hugging Face's.
class MoeCausalLMImpl : public CausalLMImpl {
 public:
  explicit MoeCausalLMImpl(const MoeConfig& config);
  at::Tensor forward(const at::Tensor& idx, const at::Tensor& position = {},
                     const at::Tensor& segment = {}) override;
  at::Tensor forward_cached(const at::Tensor& idx, KVCache& cache) override;
  int64_t vocab_size() const override { return config_.base.vocab_size; }
  int64_t context_size() const override { return config_.base.max_positions; }
  at::Tensor auxiliary_loss() const override { return aux_; }
  bool has_auxiliary_loss() const override { return true; }
  double auxiliary_loss_weight() const override { return config_.aux_weight; }

  Model model{nullptr};
  torch::nn::Linear lm_head{nullptr};

 private:
  at::Tensor run(const at::Tensor& idx, const at::Tensor& position, const at::Tensor& segment, KVCache* cache);
  MoeConfig config_;
  RotaryTables rotary_;
  at::Tensor aux_;
};
TORCH_MODULE(MoeCausalLM);

/// What the two MoE families share; each gives its config, its names and
/// its config.json. Tensor and pipeline parallelism, expert parallelism and
/// LoRA are not written for them yet: refused when the config is read.
class MoeFamily : public ModelFamily {
 public:
  /// The decoder's config from the model section.
  virtual MoeConfig moe_config(const config::ModelConfig& m) const = 0;
  void validate(const config::ModelConfig& m) const override;
  std::shared_ptr<torch::nn::Module> build(const config::ModelConfig& m, bool deferred) const override;
  double num_parameters(const config::ModelConfig& m) const override;
  double activation_bytes(const config::ModelConfig& m, int64_t micro, int bytes) const override;
  std::string size_text(const config::ModelConfig& m) const override;
  std::vector<std::string> lora_targets() const override { return {"q_proj", "k_proj", "v_proj", "o_proj"}; }
  std::string peft_prefix() const override { return "base_model.model."; }
  bool hf_skipped(const std::string& name) const override;
  std::string not_supported_yet() const override {
    return "tensor parallelism, pipeline parallelism or LoRA";
  }

 protected:
  /// The Llama family's keys of config.json (attention, rotary, norms), then
  /// the experts' shared keys; `moe_type` names them in messages.
  static void read_common(const nlohmann::json& j, config::ModelConfig& m, int64_t experts);
  /// config.json keys both families write.
  static void write_common(nlohmann::json& j, const config::ModelConfig& m, const MoeConfig& c);
};

/// config.json integers and reals, strictly (a fraction or a negative count
/// is a ConfigError naming the key); the fallback when absent or null.
int64_t json_integer(const nlohmann::json& j, const char* key, int64_t fallback, int64_t min);
double json_real(const nlohmann::json& j, const char* key, double fallback);

}  // namespace shardtrain::models::moe
