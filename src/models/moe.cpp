// The mixture-of-experts decoder: router, experts grouped by expert, the
// load-balancing loss, and the decoder around them (models/moe.h).
#include "models/moe.h"

#include <torch/torch.h>

#include <cmath>
#include <memory>
#include <nlohmann/json.hpp>

#include "models/activations.h"
#include "models/attention.h"
#include "models/families.h"
#include "models/layers.h"
#include "shardtrain/config/config.h"
#include "shardtrain/core/deferred.h"
#include "shardtrain/core/error.h"
#include "shardtrain/models/checkpoint.h"
#include "shardtrain/strategy/unit.h"

namespace shardtrain::models::moe {

namespace {
constexpr double kInitStd = 0.02;  // HF initializer_range
}

// ---- config ------------------------------------------------------------------------

int64_t MoeConfig::sparse_layers() const {
  int64_t n = 0;
  for (const bool s : sparse) n += s ? 1 : 0;
  return n;
}

int64_t MoeConfig::num_parameters() const {
  const int64_t h = base.hidden_size;
  const int64_t dense_mlp = 3 * h * base.intermediate_size + (base.mlp_bias ? 2 * base.intermediate_size + h : 0);
  const int64_t sparse_mlp = num_experts * h + num_experts * 3 * h * expert_size;
  const int64_t layers = base.num_layers, moe = sparse_layers();
  const int64_t norms = qk_norm ? layers * 2 * base.head_dim : 0;
  return base.num_parameters() - moe * dense_mlp + moe * sparse_mlp + norms;
}

void MoeConfig::validate() const {
  base.validate();
  ST_CHECK(num_experts >= 1 && top_k >= 1 && top_k <= num_experts, ConfigError, "moe: model.num_experts_per_tok=",
           top_k, " must be between 1 and model.num_experts=", num_experts);
  ST_CHECK(expert_size >= 1, ConfigError, "moe: the experts' width (model.moe_intermediate_size, or "
           "intermediate_size) is ", expert_size, "; it must be positive");
  ST_CHECK(static_cast<int64_t>(sparse.size()) == base.num_layers, InvalidArgument,
           "moe: a sparse flag per layer is needed (", sparse.size(), " for ", base.num_layers, " layers)");
}

at::Tensor RouterStats::aux_loss(int64_t num_experts) const {
  if (rows == 0) return {};
  const double n = static_cast<double>(rows);
  return (slots / n * (probs / n)).sum() * static_cast<double>(num_experts);
}

// ---- the sparse block ------------------------------------------------------------------

ExpertImpl::ExpertImpl(const MoeConfig& c) {
  const auto linear = [&](int64_t in, int64_t out) { return detail::make_linear(in, out, false, c.base.deferred); };
  gate = register_module(c.expert_names[0], linear(c.base.hidden_size, c.expert_size));
  up = register_module(c.expert_names[1], linear(c.base.hidden_size, c.expert_size));
  down = register_module(c.expert_names[2], linear(c.expert_size, c.base.hidden_size));
}

at::Tensor ExpertImpl::forward(const at::Tensor& x) {
  return down(detail::swiglu(gate(x), up(x)));
}

SparseMoeImpl::SparseMoeImpl(const MoeConfig& c)
    : top_k_(c.top_k), norm_topk_(c.norm_topk), train_aux_(c.aux_weight > 0.0) {
  gate = register_module("gate", detail::make_linear(c.base.hidden_size, c.num_experts, false, c.base.deferred));
  experts = register_module("experts", torch::nn::ModuleList());
  for (int64_t e = 0; e < c.num_experts; ++e) {
    Expert expert(c);
    if (c.base.deferred) defer_parameters(*expert);
    experts->push_back(expert);
  }
}

at::Tensor SparseMoeImpl::forward(const at::Tensor& x, RouterStats* stats) {
  const at::Tensor flat = x.reshape({-1, x.size(-1)});
  const at::Tensor logits = gate(flat);                             // [N, E]
  const at::Tensor probs = at::softmax(logits, -1, at::kFloat);     // in fp32, as HF
  auto [top_w, top_e] = probs.topk(top_k_, -1);                     // [N, k]
  if (norm_topk_) top_w = top_w / top_w.sum(-1, /*keepdim=*/true);
  top_w = top_w.to(x.scalar_type());
  if (stats != nullptr && flat.size(0) > 0) {
    const int64_t experts_n = static_cast<int64_t>(experts->size());
    const at::Tensor p = train_aux_ ? probs : probs.detach();
    const at::Tensor slots = at::bincount(top_e.reshape({-1}), {}, experts_n).to(at::kFloat);
    stats->slots = stats->slots.defined() ? stats->slots + slots : slots;
    stats->probs = stats->probs.defined() ? stats->probs + p.sum(0) : p.sum(0);
    stats->rows += flat.size(0);
  }
  return grouped_experts(flat, top_w, top_e).view(x.sizes());
}

// Slots sorted by expert (stable: each expert's tokens in token order), each
// expert's rows one contiguous run of the gathered inputs.
at::Tensor SparseMoeImpl::grouped_experts(const at::Tensor& flat, const at::Tensor& top_w, const at::Tensor& top_e) {
  const int64_t k = top_e.size(1);
  const at::Tensor slots = top_e.reshape({-1});                                         // [N * k]
  const at::Tensor order = std::get<1>(slots.sort(/*stable=*/true, /*dim=*/0, /*descending=*/false));
  const at::Tensor token = order.div(k, "floor");                                       // slot -> its token
  const at::Tensor counts = at::bincount(slots, {}, static_cast<int64_t>(experts->size())).to(at::kCPU);
  const int64_t* count = counts.data_ptr<int64_t>();
  const at::Tensor inputs = flat.index_select(0, token);
  std::vector<at::Tensor> outputs;
  outputs.reserve(experts->size());
  int64_t begin = 0;
  for (size_t e = 0; e < experts->size(); ++e) {
    // An expert no token reached runs on zero rows: no work, zero gradients.
    const int64_t n = count[e];
    outputs.push_back(experts[e]->as<ExpertImpl>()->forward(inputs.narrow(0, begin, n)));
    begin += n;
  }
  const at::Tensor weighted = at::cat(outputs) * top_w.reshape({-1}).index_select(0, order).unsqueeze(1);
  return at::zeros_like(flat).index_add(0, token, weighted);
}

// ---- attention and the decoder layer ---------------------------------------------------

AttentionImpl::AttentionImpl(const MoeConfig& c) : head_dim_(c.base.head_dim), dropout_(c.base.attention_dropout) {
  const LlamaConfig& b = c.base;
  const bool qkv_bias = b.attention_bias != train::AttentionBias::None;
  const auto linear = [&](int64_t in, int64_t out, bool bias) { return detail::make_linear(in, out, bias, b.deferred); };
  q_proj = register_module("q_proj", linear(b.hidden_size, b.num_heads * head_dim_, qkv_bias));
  k_proj = register_module("k_proj", linear(b.hidden_size, b.num_kv_heads * head_dim_, qkv_bias));
  v_proj = register_module("v_proj", linear(b.hidden_size, b.num_kv_heads * head_dim_, qkv_bias));
  o_proj = register_module("o_proj", linear(b.num_heads * head_dim_, b.hidden_size,
                                            b.attention_bias == train::AttentionBias::All));
  if (c.qk_norm) {
    q_norm = register_module("q_norm", RMSNorm(head_dim_, b.rms_norm_eps));
    k_norm = register_module("k_norm", RMSNorm(head_dim_, b.rms_norm_eps));
  }
}

at::Tensor AttentionImpl::forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                  const at::Tensor& segment, at::Tensor* cache_k, at::Tensor* cache_v) {
  const int64_t b = x.size(0), t = x.size(1);
  // [B, T, heads, d]: Qwen3 normalises each head here, before the rotation.
  auto split = [&](const at::Tensor& y) { return y.view({b, t, y.size(2) / head_dim_, head_dim_}); };
  at::Tensor q = split(q_proj(x)), k = split(k_proj(x));
  if (q_norm) {
    q = q_norm(q);
    k = k_norm(k);
  }
  q = apply_rotary(q.transpose(1, 2), cos, sin);
  k = apply_rotary(k.transpose(1, 2), cos, sin);
  at::Tensor v = split(v_proj(x)).transpose(1, 2);
  if (cache_k != nullptr) {
    k = detail::append_cache(*cache_k, k);
    v = detail::append_cache(*cache_v, v);
  }
  auto y = detail::causal_attention(q, k, v, segment, dropout_, is_training());
  return o_proj(y.transpose(1, 2).reshape({b, t, y.size(1) * y.size(3)}));
}

BlockImpl::BlockImpl(const MoeConfig& c, bool sparse) {
  const LlamaConfig& b = c.base;
  input_layernorm = register_module("input_layernorm", RMSNorm(b.hidden_size, b.rms_norm_eps));
  self_attn = register_module("self_attn", Attention(c));
  post_attention_layernorm = register_module("post_attention_layernorm", RMSNorm(b.hidden_size, b.rms_norm_eps));
  if (sparse) {
    moe = register_module(c.block_name, SparseMoe(c));
  } else {
    mlp = register_module("mlp", llama::MLP(b));
  }
}

at::Tensor BlockImpl::forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                              const at::Tensor& segment, RouterStats* stats, at::Tensor* cache_k, at::Tensor* cache_v) {
  const auto h = x + self_attn->forward(input_layernorm(x), cos, sin, segment, cache_k, cache_v);
  const auto n = post_attention_layernorm(h);
  return h + (moe ? moe->forward(n, stats) : mlp(n));
}

ModelImpl::ModelImpl(const MoeConfig& c) {
  const auto built = [&](auto module) {
    if (c.base.deferred) defer_parameters(*module);
    return module;
  };
  embed_tokens = register_module("embed_tokens", detail::make_embedding(c.base.vocab_size, c.base.hidden_size,
                                                                        c.base.deferred));
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.base.num_layers; ++i) layers->push_back(built(Block(c, c.sparse[static_cast<size_t>(i)])));
  norm = register_module("norm", built(RMSNorm(c.base.hidden_size, c.base.rms_norm_eps)));
}

// ---- the model ----------------------------------------------------------------------------

MoeCausalLMImpl::MoeCausalLMImpl(const MoeConfig& config) : config_(config) {
  config_.validate();
  model = register_module("model", Model(config_));
  if (!config_.base.tie_word_embeddings) {
    lm_head = register_module("lm_head", detail::make_linear(config_.base.hidden_size, config_.base.vocab_size,
                                                             false, config_.base.deferred));
  }
  rotary_ = rotary_tables(config_.base);
  if (config_.base.deferred) return;
  // Hugging Face's initialisation: N(0, 0.02) for every Linear (routers
  // included) and the embedding, zero biases, norms at one.
  torch::NoGradGuard no_grad;
  for (auto& p : named_parameters()) {
    if (p.key().find("norm") != std::string::npos) continue;
    if (p.key().size() > 5 && p.key().compare(p.key().size() - 5, 5, ".bias") == 0) {
      p.value().zero_();
    } else {
      p.value().normal_(0.0, kInitStd);
    }
  }
}

at::Tensor MoeCausalLMImpl::forward(const at::Tensor& idx, const at::Tensor& position, const at::Tensor& segment) {
  ST_CHECK(idx.dim() == 2 && idx.size(1) >= 1 && idx.size(1) <= config_.base.max_positions, InvalidArgument,
           "MoE decoder: forward expects idx [B, T] with 1 <= T <= ", config_.base.max_positions, ", got ",
           idx.sizes(), "; hint: crop the context to model.block_size tokens");
  return run(idx, position, segment, nullptr);
}

at::Tensor MoeCausalLMImpl::forward_cached(const at::Tensor& idx, KVCache& cache) {
  ST_CHECK(cache.length + idx.size(1) <= config_.base.max_positions, InvalidArgument, "MoE decoder: ",
           cache.length, " cached + ", idx.size(1), " new tokens exceed the ", config_.base.max_positions,
           " positions of the model; hint: start a new cache");
  const auto position = at::arange(cache.length, cache.length + idx.size(1), idx.options().dtype(at::kLong))
                            .unsqueeze(0)
                            .expand({idx.size(0), idx.size(1)});
  auto logits = run(idx, position, {}, &cache);
  cache.length += idx.size(1);
  return logits;
}

at::Tensor MoeCausalLMImpl::run(const at::Tensor& idx, const at::Tensor& position, const at::Tensor& segment,
                                KVCache* cache) {
  at::Tensor h = model->embed_tokens(idx);
  const int64_t b = idx.size(0), t = idx.size(1);
  const auto pos = position.defined() ? position.to(at::kLong)
                                      : at::arange(t, idx.options().dtype(at::kLong)).unsqueeze(0).expand({b, t});
  const auto flat = pos.reshape({-1});
  const auto cos = rotary_.cos.index_select(0, flat).view({b, t, rotary_.cos.size(1)}).to(h.scalar_type());
  const auto sin = rotary_.sin.index_select(0, flat).view({b, t, rotary_.sin.size(1)}).to(h.scalar_type());
  if (cache != nullptr && cache->keys.empty()) {
    cache->keys.resize(model->layers->size());
    cache->values.resize(model->layers->size());
  }
  // Router statistics in training forwards only. A checkpointed block runs
  // again in backward, after this forward returned: it reads the slot, which
  // is cleared by then, and adds nothing.
  RouterStats stats;
  const bool training = cache == nullptr && is_training();
  const auto slot = std::make_shared<RouterStats*>(training ? &stats : nullptr);
  const bool recompute = cache == nullptr && config_.base.activation_checkpointing && is_training() &&
                         torch::GradMode::is_enabled();
  for (size_t i = 0; i < model->layers->size(); ++i) {
    auto block = model->layers->ptr<BlockImpl>(i);
    if (cache != nullptr) {
      h = block->forward(h, cos, sin, {}, nullptr, &cache->keys[i], &cache->values[i]);
      continue;
    }
    h = strategy::unit_forward(block, [&] {
      return recompute ? checkpoint([block, cos, sin, segment, slot](const at::Tensor& in) {
                                      return block->forward(in, cos, sin, segment, *slot);
                                    },
                                    h, block->parameters())
                       : block->forward(h, cos, sin, segment, *slot);
    });
  }
  *slot = nullptr;
  aux_ = training ? stats.aux_loss(config_.num_experts) : at::Tensor();
  h = model->norm(h);
  return lm_head ? lm_head(h) : at::linear(h, model->embed_tokens->weight);
}

// ---- what the two families share ---------------------------------------------------------

void MoeFamily::validate(const config::ModelConfig& m) const {
  const MoeConfig c = moe_config(m);
  c.validate();
  ST_CHECK(m.max_position_embeddings == 0 || m.block_size <= m.max_position_embeddings, ConfigError,
           "model.block_size=", m.block_size, " exceeds the model's max_position_embeddings=",
           m.max_position_embeddings, "; hint: lower model.block_size");
  ST_CHECK(!(c.base.activation_checkpointing && c.aux_weight > 0.0), ConfigError,
           "model.activation_checkpointing with model.output_router_logits (the load-balancing loss in the "
           "training loss) is not supported yet; turn one of them off");
}

std::shared_ptr<torch::nn::Module> MoeFamily::build(const config::ModelConfig& m, bool deferred) const {
  MoeConfig c = moe_config(m);
  c.base.deferred = deferred;
  return std::make_shared<MoeCausalLMImpl>(c);
}

double MoeFamily::num_parameters(const config::ModelConfig& m) const {
  return static_cast<double>(moe_config(m).num_parameters());
}

// As the Llama family counts a layer (norms, projections, rotary, attention
// scores and weights, SwiGLU), with a sparse layer's MLP replaced by the
// router's logits and probabilities, the k gathered copies of each token and
// the k experts' SwiGLU; plus the logits and their gradient.
double MoeFamily::activation_bytes(const config::ModelConfig& m, int64_t micro, int bytes) const {
  const MoeConfig c = moe_config(m);
  const LlamaConfig& b = c.base;
  const double bt = static_cast<double>(micro) * static_cast<double>(b.block_size);
  const double h = static_cast<double>(b.hidden_size);
  const double q = static_cast<double>(b.num_heads * b.head_dim), kv = static_cast<double>(b.num_kv_heads * b.head_dim);
  const double scores = 2.0 * static_cast<double>(b.num_heads) * static_cast<double>(b.block_size);
  const double attention = 4.0 * h + 3.0 * q + 4.0 * kv + scores;
  const double e = static_cast<double>(c.num_experts), k = static_cast<double>(c.top_k);
  const double sparse = 2.0 * e + k * (2.0 * h + 4.0 * static_cast<double>(c.expert_size)) + h;
  const double dense = 4.0 * static_cast<double>(b.intermediate_size);
  const double moe_layers = static_cast<double>(c.sparse_layers());
  const double layers = static_cast<double>(b.num_layers);
  const double all = bt * bytes * (layers * attention + moe_layers * sparse + (layers - moe_layers) * dense);
  const double largest = bt * bytes * (attention + std::max(moe_layers > 0 ? sparse : 0.0, dense));
  const double blocks = b.activation_checkpointing ? layers * bt * h * bytes + largest : all;
  return blocks + 2.0 * bt * static_cast<double>(b.vocab_size) * bytes;
}

std::string MoeFamily::size_text(const config::ModelConfig& m) const {
  const MoeConfig c = moe_config(m);
  return ::shardtrain::detail::str_cat("model.n_layer=", c.base.num_layers, ", n_embd=", c.base.hidden_size,
                                       ", num_experts=", c.num_experts, ", num_experts_per_tok=", c.top_k,
                                       ", experts' width=", c.expert_size, ", vocab_size=", c.base.vocab_size,
                                       ", block_size=", c.base.block_size);
}

// As the Llama family: older files' rotary inv_freq buffers, and a tied
// model's copy of the embedding as lm_head.weight.
bool MoeFamily::hf_skipped(const std::string& name) const {
  const std::string inv = ".rotary_emb.inv_freq";
  return name == "lm_head.weight" ||
         (name.size() >= inv.size() && name.compare(name.size() - inv.size(), inv.size(), inv) == 0);
}

int64_t json_integer(const nlohmann::json& j, const char* key, int64_t fallback, int64_t min) {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  const bool integral = it->is_number_integer() ||
                        (it->is_number_float() && std::isfinite(it->get<double>()) &&
                         it->get<double>() == std::floor(it->get<double>()) && std::fabs(it->get<double>()) <= 9.0e15);
  const int64_t x = integral ? (it->is_number_float() ? static_cast<int64_t>(it->get<double>()) : it->get<int64_t>()) : 0;
  ST_CHECK(integral && x >= min, ConfigError, "config.json: ", key, " is ", it->dump(), "; expected an integer >= ",
           min, ". Hint: the model directory's config.json is damaged or not a model's");
  return x;
}

double json_real(const nlohmann::json& j, const char* key, double fallback) {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  const double x = it->is_number() ? it->get<double>() : std::nan("");
  ST_CHECK(std::isfinite(x) && x >= 0.0, ConfigError, "config.json: ", key, " is ", it->dump(),
           "; expected a finite number >= 0. Hint: the model directory's config.json is damaged or not a model's");
  return x;
}

void MoeFamily::read_common(const nlohmann::json& j, config::ModelConfig& m, int64_t experts) {
  nlohmann::json attention = j;
  // Qwen3-MoE names a sliding_window it uses only under use_sliding_window.
  if (j.value("model_type", "") == "qwen3_moe" && !j.value("use_sliding_window", false)) {
    attention.erase("sliding_window");
  }
  llama_family().read_hf_config(attention, m);
  m.hf_model_type = "llama";  // the Llama family's export switch, not used here
  m.num_experts = experts;
  m.num_experts_per_tok = json_integer(j, "num_experts_per_tok", 2, 1);
  m.router_aux_loss_coef = json_real(j, "router_aux_loss_coef", 0.001);
  const auto out = j.find("output_router_logits");
  m.output_router_logits = out != j.end() && !out->is_null() && out->get<bool>();
}

void MoeFamily::write_common(nlohmann::json& j, const config::ModelConfig& m, const MoeConfig& c) {
  const LlamaConfig& b = c.base;
  j["vocab_size"] = b.vocab_size;
  j["hidden_size"] = b.hidden_size;
  j["intermediate_size"] = b.intermediate_size;
  j["num_hidden_layers"] = b.num_layers;
  j["num_attention_heads"] = b.num_heads;
  j["num_key_value_heads"] = b.num_kv_heads;
  j["head_dim"] = b.head_dim;
  j["hidden_act"] = "silu";
  j["max_position_embeddings"] = b.max_positions;
  j["rms_norm_eps"] = b.rms_norm_eps;
  j["rope_theta"] = b.rope_theta;
  j["tie_word_embeddings"] = b.tie_word_embeddings;
  j["attention_bias"] = b.attention_bias == train::AttentionBias::All;
  j["attention_dropout"] = b.attention_dropout;
  j["initializer_range"] = kInitStd;
  j["torch_dtype"] = "float32";
  j["num_experts_per_tok"] = c.top_k;
  j["router_aux_loss_coef"] = m.router_aux_loss_coef;
  j["output_router_logits"] = m.output_router_logits;
  if (b.rope_scaling == train::RopeScaling::Llama3) {
    j["rope_scaling"] = {{"rope_type", "llama3"},
                         {"factor", b.rope_factor},
                         {"low_freq_factor", b.rope_low_freq_factor},
                         {"high_freq_factor", b.rope_high_freq_factor},
                         {"original_max_position_embeddings", b.rope_original_max_position}};
  }
}

}  // namespace shardtrain::models::moe
