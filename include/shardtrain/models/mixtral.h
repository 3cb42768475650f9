// The Mixtral family (model.type mixtral): Mistral's decoder whose MLP is a
// sparse mixture of experts in every layer, as Hugging Face's
// MixtralForCausalLM computes it:
//
//   per layer: x += o_proj(attn(...)) as the Llama family (models/llama.h)
//              n = post_attention_layernorm(x)
//              p = softmax(block_sparse_moe.gate(n)) in fp32; top num_experts_per_tok of p,
//              renormalised to sum 1 (always), cast back
//              x += sum over the chosen experts e of w_e * w2_e(silu(w1_e(n)) * w3_e(n))
//
// Tensors model.layers.N.block_sparse_moe.gate.weight [E, hidden] and
// ...block_sparse_moe.experts.E.{w1,w2,w3}.weight (w1 gate, w3 up, w2 down);
// config.json keys num_local_experts, num_experts_per_tok,
// router_aux_loss_coef, output_router_logits. The router's load-balancing
// loss (models/moe.h) is logged as aux_loss and, with output_router_logits,
// added to the training loss times router_aux_loss_coef.
#pragma once

#include <memory>

#include "shardtrain/models/causal_lm.h"

namespace shardtrain::config {
struct ModelConfig;
}

namespace shardtrain::models {

/// A Mixtral decoder for the model section, with the seed's initial weights
/// (the caller seeds); ConfigError naming the model.* key of an impossible size.
std::shared_ptr<CausalLMImpl> make_mixtral(const config::ModelConfig& m);

}  // namespace shardtrain::models
