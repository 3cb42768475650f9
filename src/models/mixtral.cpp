// The Mixtral family: its config from our YAML and a Hugging Face
// config.json, its names; the decoder is models/moe.h's.
#include "shardtrain/models/mixtral.h"

#include <nlohmann/json.hpp>

#include "models/families.h"
#include "models/moe.h"
#include "shardtrain/config/config.h"
#include "shardtrain/core/error.h"

namespace shardtrain::models {

namespace {

class MixtralFamily final : public moe::MoeFamily {
 public:
  train::ModelType type() const override { return train::ModelType::Mixtral; }
  std::vector<std::string> hf_model_types() const override { return {"mixtral"}; }

  moe::MoeConfig moe_config(const config::ModelConfig& m) const override {
    moe::MoeConfig c;
    c.base = LlamaConfig::from(m);
    c.num_experts = m.num_experts;
    c.top_k = m.num_experts_per_tok;
    c.expert_size = c.base.intermediate_size;
    c.norm_topk = true;  // Mixtral always renormalises the top-k weights
    c.sparse.assign(static_cast<size_t>(std::max<int64_t>(0, c.base.num_layers)), true);
    c.block_name = "block_sparse_moe";
    c.expert_names = {"w1", "w3", "w2"};
    c.aux_weight = m.output_router_logits ? m.router_aux_loss_coef : 0.0;
    return c;
  }

  void read_hf_config(const nlohmann::json& j, config::ModelConfig& m) const override {
    read_common(j, m, moe::json_integer(j, "num_local_experts", 8, 1));
    // MixtralConfig's own defaults where the file leaves them out.
    if (!j.contains("rope_theta") && !j.contains("rope_parameters")) m.rope_theta = 1e6;
    if (!j.contains("rms_norm_eps")) m.rms_norm_eps = 1e-5;
    const double jitter = moe::json_real(j, "router_jitter_noise", 0.0);
    ST_CHECK(jitter == 0.0, ConfigError, "config.json: router_jitter_noise=", jitter,
             " is not supported (the router's random jitter while training); set it to 0");
  }

  std::string hf_config_json(const config::ModelConfig& m) const override {
    const moe::MoeConfig c = moe_config(m);
    nlohmann::json j = {{"architectures", {"MixtralForCausalLM"}}, {"model_type", "mixtral"}};
    write_common(j, m, c);
    j["num_local_experts"] = c.num_experts;
    j["router_jitter_noise"] = 0.0;
    j["sliding_window"] = nullptr;
    return j.dump(2) + "\n";
  }
};

}  // namespace

const ModelFamily& mixtral_family() {
  static const MixtralFamily family;
  return family;
}

std::shared_ptr<CausalLMImpl> make_mixtral(const config::ModelConfig& m) {
  mixtral_family().validate(m);
  return std::dynamic_pointer_cast<CausalLMImpl>(mixtral_family().build(m));
}

}  // namespace shardtrain::models
