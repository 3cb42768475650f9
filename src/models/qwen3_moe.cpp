// The Qwen3-MoE family: its config from our YAML and a Hugging Face
// config.json (which layers are sparse), its names; the decoder is
// models/moe.h's with Qwen3's per-head q/k norms.
#include "shardtrain/models/qwen3_moe.h"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "models/families.h"
#include "models/moe.h"
#include "shardtrain/config/config.h"
#include "shardtrain/core/error.h"

namespace shardtrain::models {

namespace {

class Qwen3MoeFamily final : public moe::MoeFamily {
 public:
  train::ModelType type() const override { return train::ModelType::Qwen3Moe; }
  std::vector<std::string> hf_model_types() const override { return {"qwen3_moe"}; }

  moe::MoeConfig moe_config(const config::ModelConfig& m) const override {
    moe::MoeConfig c;
    c.base = LlamaConfig::from(m);
    c.num_experts = m.num_experts;
    c.top_k = m.num_experts_per_tok;
    c.expert_size = m.moe_intermediate_size > 0 ? m.moe_intermediate_size : c.base.intermediate_size;
    c.norm_topk = m.norm_topk_prob;
    c.qk_norm = true;
    const int64_t step = std::max<int64_t>(1, m.decoder_sparse_step);
    for (int64_t i = 0; i < c.base.num_layers; ++i) {
      const bool dense = std::find(m.mlp_only_layers.begin(), m.mlp_only_layers.end(), i) != m.mlp_only_layers.end();
      c.sparse.push_back(!dense && (i + 1) % step == 0);
    }
    c.block_name = "mlp";
    c.expert_names = {"gate_proj", "up_proj", "down_proj"};
    c.aux_weight = m.output_router_logits ? m.router_aux_loss_coef : 0.0;
    return c;
  }

  void validate(const config::ModelConfig& m) const override {
    MoeFamily::validate(m);
    for (const int64_t i : m.mlp_only_layers) {
      ST_CHECK(i >= 0 && i < m.n_layer, ConfigError, "qwen3_moe: model.mlp_only_layers names layer ", i,
               " of a model of model.n_layer=", m.n_layer, " layers; hint: layers count from 0");
    }
  }

  void read_hf_config(const nlohmann::json& j, config::ModelConfig& m) const override {
    read_common(j, m, moe::json_integer(j, "num_experts", 128, 1));
    m.moe_intermediate_size = moe::json_integer(j, "moe_intermediate_size", 768, 1);
    m.decoder_sparse_step = moe::json_integer(j, "decoder_sparse_step", 1, 1);
    const auto norm = j.find("norm_topk_prob");
    m.norm_topk_prob = norm != j.end() && !norm->is_null() && norm->get<bool>();
    m.mlp_only_layers.clear();
    const auto dense = j.find("mlp_only_layers");
    if (dense != j.end() && !dense->is_null()) {
      ST_CHECK(dense->is_array(), ConfigError, "config.json: mlp_only_layers is ", dense->dump(),
               "; expected a list of layer indices. Hint: the model directory's config.json is damaged");
      for (const auto& v : *dense) {
        ST_CHECK(v.is_number_integer(), ConfigError, "config.json: mlp_only_layers holds ", v.dump(),
                 "; expected layer indices. Hint: the model directory's config.json is damaged");
        m.mlp_only_layers.push_back(v.get<int64_t>());
      }
    }
  }

  std::string hf_config_json(const config::ModelConfig& m) const override {
    const moe::MoeConfig c = moe_config(m);
    nlohmann::json j = {{"architectures", {"Qwen3MoeForCausalLM"}}, {"model_type", "qwen3_moe"}};
    write_common(j, m, c);
    j["num_experts"] = c.num_experts;
    j["moe_intermediate_size"] = c.expert_size;
    j["norm_topk_prob"] = c.norm_topk;
    j["decoder_sparse_step"] = m.decoder_sparse_step;
    j["mlp_only_layers"] = m.mlp_only_layers;
    j["use_sliding_window"] = false;
    j["sliding_window"] = nullptr;
    return j.dump(2) + "\n";
  }
};

}  // namespace

const ModelFamily& qwen3_moe_family() {
  static const Qwen3MoeFamily family;
  return family;
}

std::shared_ptr<CausalLMImpl> make_qwen3_moe(const config::ModelConfig& m) {
  qwen3_moe_family().validate(m);
  return std::dynamic_pointer_cast<CausalLMImpl>(qwen3_moe_family().build(m));
}

}  // namespace shardtrain::models
