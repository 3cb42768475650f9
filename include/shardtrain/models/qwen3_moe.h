// The Qwen3-MoE family (model.type qwen3_moe), as Hugging Face's
// Qwen3MoeForCausalLM computes it: the Llama decoder (models/llama.h) with
// Qwen3's attention, an RMSNorm over each query and key head
// (self_attn.q_norm, self_attn.k_norm, [head_dim]) applied before the rotary
// embedding, and no q/k/v biases unless attention_bias; layer i's MLP is a
// sparse mixture of experts (mlp.gate [E, hidden], mlp.experts.E.{gate,up,
// down}_proj of moe_intermediate_size) when i is not in mlp_only_layers and
// (i + 1) % decoder_sparse_step == 0, else the dense SwiGLU MLP of
// intermediate_size. Routing: softmax of the router's logits in fp32, the top
// num_experts_per_tok, renormalised to sum 1 only when norm_topk_prob. The
// load-balancing loss (models/moe.h) over the sparse layers is logged as
// aux_loss and, with output_router_logits, added times router_aux_loss_coef.
#pragma once

#include <memory>

#include "shardtrain/models/causal_lm.h"

namespace shardtrain::config {
struct ModelConfig;
}

namespace shardtrain::models {

/// A Qwen3-MoE decoder for the model section, with the seed's initial
/// weights (the caller seeds); ConfigError naming the model.* key of an
/// impossible size.
std::shared_ptr<CausalLMImpl> make_qwen3_moe(const config::ModelConfig& m);

}  // namespace shardtrain::models
