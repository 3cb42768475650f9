// The Llama family: RMSNorm, rotary embeddings, grouped-query attention,
// SwiGLU; its config from our YAML and from a Hugging Face config.json.
#include "shardtrain/models/llama.h"

#include <torch/torch.h>

#include <cmath>
#include <nlohmann/json.hpp>

#include "models/activations.h"
#include "models/attention.h"
#include "models/families.h"
#include "models/layers.h"
#include "models/tensor_parallel.h"
#include "shardtrain/config/config.h"
#include "shardtrain/core/deferred.h"
#include "shardtrain/core/error.h"
#include "shardtrain/models/checkpoint.h"
#include "shardtrain/models/lora.h"
#include "shardtrain/strategy/unit.h"

namespace shardtrain::models {

namespace {

constexpr double kInitializerRange = 0.02;  // HF initializer_range

int64_t default_intermediate(int64_t hidden) {
  const int64_t raw = (8 * hidden + 2) / 3;
  return (raw + 63) / 64 * 64;
}

}  // namespace

// ---- config ------------------------------------------------------------------------

LlamaConfig LlamaConfig::from(const config::ModelConfig& m) {
  LlamaConfig c;
  c.vocab_size = m.vocab_size;
  c.hidden_size = m.n_embd;
  c.num_layers = m.n_layer;
  c.num_heads = m.n_head;
  c.num_kv_heads = m.n_kv_head > 0 ? m.n_kv_head : m.n_head;
  c.head_dim = m.head_dim > 0 ? m.head_dim : (m.n_head > 0 ? m.n_embd / m.n_head : 0);
  c.intermediate_size = m.intermediate_size > 0 ? m.intermediate_size : default_intermediate(m.n_embd);
  c.block_size = m.block_size;
  c.max_positions = std::max(m.block_size, m.max_position_embeddings);
  c.rope_theta = m.rope_theta;
  c.rope_scaling = m.rope_scaling;
  c.rope_factor = m.rope_factor;
  c.rope_low_freq_factor = m.rope_low_freq_factor;
  c.rope_high_freq_factor = m.rope_high_freq_factor;
  c.rope_original_max_position = m.rope_original_max_position;
  c.rms_norm_eps = m.rms_norm_eps;
  c.tie_word_embeddings = m.tie_word_embeddings;
  c.attention_bias = m.attention_bias;
  c.mlp_bias = m.mlp_bias;
  c.attention_dropout = m.dropout;
  c.activation_checkpointing = m.activation_checkpointing;
  return c;
}

void LlamaConfig::validate() const {
  ST_CHECK(num_layers > 0 && num_heads > 0 && hidden_size > 0 && vocab_size > 0 && block_size > 0,
           ConfigError, "llama: model.n_layer, n_head, n_embd, vocab_size and block_size must be "
           "positive (got ", num_layers, ", ", num_heads, ", ", hidden_size, ", ", vocab_size, ", ",
           block_size, ")");
  ST_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, ConfigError, "llama: model.n_kv_head=",
           num_kv_heads, " must divide model.n_head=", num_heads,
           "; hint: 0 means one key/value head per query head");
  ST_CHECK(head_dim > 0 && head_dim % 2 == 0, ConfigError, "llama: the head width (model.head_dim, or "
           "n_embd / n_head) is ", head_dim, "; rotary embeddings need an even, positive width");
  ST_CHECK(intermediate_size > 0, ConfigError, "llama: model.intermediate_size must be positive");
}

int64_t LlamaConfig::num_parameters() const {
  const int64_t h = hidden_size, q = num_heads * head_dim, kv = num_kv_heads * head_dim;
  int64_t attn = h * q + 2 * h * kv + q * h;
  if (attention_bias != train::AttentionBias::None) attn += q + 2 * kv;
  if (attention_bias == train::AttentionBias::All) attn += h;
  int64_t mlp = 3 * h * intermediate_size;
  if (mlp_bias) mlp += 2 * intermediate_size + h;
  const int64_t layer = attn + mlp + 2 * h;
  return vocab_size * h * (tie_word_embeddings ? 1 : 2) + num_layers * layer + h;
}

// ---- RMSNorm and rotary embeddings --------------------------------------------------

RMSNormImpl::RMSNormImpl(int64_t dim, double eps) : eps_(eps) {
  weight = register_parameter("weight", torch::ones({dim}));
}

at::Tensor RMSNormImpl::forward(const at::Tensor& x) {
  // In fp32 whatever x is, then back to x's dtype before the weight.
  const auto h = x.to(at::kFloat);
  const auto normed = h * at::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + eps_);
  return weight * normed.to(x.scalar_type());
}

at::Tensor rope_inverse_frequencies(const LlamaConfig& c) {
  const auto d = static_cast<double>(c.head_dim);
  auto inv = 1.0 / at::pow(c.rope_theta, at::arange(0, c.head_dim, 2, at::kLong).to(at::kFloat) / d);
  if (c.rope_scaling != train::RopeScaling::Llama3) return inv;
  // Llama-3: wavelengths longer than the original context / low_freq_factor
  // are divided by `factor`; shorter than context / high_freq_factor kept;
  // between, a linear blend of the two.
  const double old_context = static_cast<double>(c.rope_original_max_position);
  const double low_wavelen = old_context / c.rope_low_freq_factor;
  const double high_wavelen = old_context / c.rope_high_freq_factor;
  const auto wavelen = 2.0 * M_PI / inv;
  auto scaled = at::where(wavelen > low_wavelen, inv / c.rope_factor, inv);
  const auto smooth = (old_context / wavelen - c.rope_low_freq_factor) /
                      (c.rope_high_freq_factor - c.rope_low_freq_factor);
  const auto blended = (1 - smooth) * scaled / c.rope_factor + smooth * scaled;
  const auto medium = (wavelen < high_wavelen).logical_not().logical_and((wavelen > low_wavelen).logical_not());
  return at::where(medium, blended, scaled);
}

RotaryTables rotary_tables(const LlamaConfig& c) {
  at::NoGradGuard no_grad;
  const auto inv = rope_inverse_frequencies(c);  // [d/2]
  const auto pos = at::arange(c.max_positions, at::kLong).to(at::kFloat);
  const auto freqs = at::outer(pos, inv);  // exact products, as HF's k=1 matmul
  const auto emb = at::cat({freqs, freqs}, -1);
  return {emb.cos(), emb.sin()};
}

at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  const auto rotated = at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
  return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1);
}

// ---- layers -------------------------------------------------------------------------------

namespace llama {

AttentionImpl::AttentionImpl(const LlamaConfig& c)
    : heads_(c.num_heads), kv_heads_(c.num_kv_heads), head_dim_(c.head_dim), dropout_(c.attention_dropout) {
  const bool qkv_bias = c.attention_bias != train::AttentionBias::None;
  const auto linear = [&](int64_t in, int64_t out, bool bias) {
    return detail::make_linear(in, out, bias, c.deferred);
  };
  q_proj = register_module("q_proj", linear(c.hidden_size, heads_ * head_dim_, qkv_bias));
  k_proj = register_module("k_proj", linear(c.hidden_size, kv_heads_ * head_dim_, qkv_bias));
  v_proj = register_module("v_proj", linear(c.hidden_size, kv_heads_ * head_dim_, qkv_bias));
  o_proj = register_module("o_proj", linear(heads_ * head_dim_, c.hidden_size,
                                            c.attention_bias == train::AttentionBias::All));
}

at::Tensor AttentionImpl::forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                  const at::Tensor& segment, at::Tensor* cache_k, at::Tensor* cache_v) {
  // Heads as the projections hold them: all, or this rank's share under
  // tensor parallelism (query and key/value heads split alike, so grouped
  // queries still read their own key/value head).
  const at::Tensor in = detail::column_input(*this, x);
  const int64_t b = in.size(0), t = in.size(1);
  // Explicit sizes: a micro-batch may hold no rows (uneven load balancing).
  auto heads = [&](const at::Tensor& y) { return y.view({b, t, y.size(2) / head_dim_, head_dim_}).transpose(1, 2); };
  const auto q = apply_rotary(heads(lora_forward(*q_proj, in)), cos, sin);
  auto k = apply_rotary(heads(lora_forward(*k_proj, in)), cos, sin);
  auto v = heads(lora_forward(*v_proj, in));
  if (cache_k != nullptr) {
    k = detail::append_cache(*cache_k, k);
    v = detail::append_cache(*cache_v, v);
  }
  auto y = detail::causal_attention(q, k, v, segment, dropout_, is_training());
  y = y.transpose(1, 2).reshape({b, t, y.size(1) * y.size(3)});
  return detail::row_parallel(*this, *o_proj, y);
}

MLPImpl::MLPImpl(const LlamaConfig& c) {
  const auto linear = [&](int64_t in, int64_t out) {
    return detail::make_linear(in, out, c.mlp_bias, c.deferred);
  };
  gate_proj = register_module("gate_proj", linear(c.hidden_size, c.intermediate_size));
  up_proj = register_module("up_proj", linear(c.hidden_size, c.intermediate_size));
  down_proj = register_module("down_proj", linear(c.intermediate_size, c.hidden_size));
}

at::Tensor MLPImpl::forward(const at::Tensor& x) {
  const at::Tensor in = detail::column_input(*this, x);
  return detail::row_parallel(*this, *down_proj,
                              detail::swiglu(lora_forward(*gate_proj, in), lora_forward(*up_proj, in)));
}

BlockImpl::BlockImpl(const LlamaConfig& c) {
  input_layernorm = register_module("input_layernorm", RMSNorm(c.hidden_size, c.rms_norm_eps));
  self_attn = register_module("self_attn", Attention(c));
  post_attention_layernorm = register_module("post_attention_layernorm", RMSNorm(c.hidden_size, c.rms_norm_eps));
  mlp = register_module("mlp", MLP(c));
}

// Attention and MLP go through unit_forward so a wrap policy may make either a unit.
at::Tensor BlockImpl::forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                              const at::Tensor& segment, at::Tensor* cache_k, at::Tensor* cache_v) {
  using strategy::unit_forward;
  const auto h = x + unit_forward(self_attn, [&] {
                   return self_attn->forward(input_layernorm(x), cos, sin, segment, cache_k, cache_v);
                 });
  return h + unit_forward(mlp, [&] { return mlp(post_attention_layernorm(h)); });
}

ModelImpl::ModelImpl(const LlamaConfig& c) {
  const auto built = [&](auto module) {
    if (c.deferred) defer_parameters(*module);
    return module;
  };
  embed_tokens =
      register_module("embed_tokens", detail::make_embedding(c.vocab_size, c.hidden_size, c.deferred));
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.num_layers; ++i) layers->push_back(built(Block(c)));
  norm = register_module("norm", built(RMSNorm(c.hidden_size, c.rms_norm_eps)));
}

}  // namespace llama

// ---- the model ------------------------------------------------------------------------------

LlamaImpl::LlamaImpl(const LlamaConfig& config) : config_(config) {
  config_.validate();
  model = register_module("model", llama::Model(config_));
  if (!config_.tie_word_embeddings) {
    lm_head = register_module("lm_head", detail::make_linear(config_.hidden_size, config_.vocab_size,
                                                             false, config_.deferred));
  }
  rotary_ = rotary_tables(config_);
  if (config_.deferred) return;
  // Hugging Face's initialisation: N(0, 0.02) for every Linear and the
  // embedding, zero biases, norms at one.
  torch::NoGradGuard no_grad;
  for (auto& p : named_parameters()) {
    if (p.key().find("norm") != std::string::npos) continue;
    if (p.key().size() > 5 && p.key().compare(p.key().size() - 5, 5, ".bias") == 0) {
      p.value().zero_();
    } else {
      p.value().normal_(0.0, kInitializerRange);
    }
  }
}

at::Tensor LlamaImpl::forward(const at::Tensor& idx, const at::Tensor& position, const at::Tensor& segment) {
  ST_CHECK(idx.dim() == 2 && idx.size(1) >= 1 && idx.size(1) <= config_.max_positions, InvalidArgument,
           "Llama::forward expects idx [B, T] with 1 <= T <= ", config_.max_positions, ", got ",
           idx.sizes(), "; hint: crop the context to model.block_size tokens");
  return run(0, static_cast<int>(config_.num_layers) + 2, idx, position, segment, nullptr);
}

at::Tensor LlamaImpl::forward_cached(const at::Tensor& idx, KVCache& cache) {
  ST_CHECK(cache.length + idx.size(1) <= config_.max_positions, InvalidArgument,
           "Llama::forward_cached: ", cache.length, " cached + ", idx.size(1), " new tokens exceed the ",
           config_.max_positions, " positions of the model; hint: start a new cache");
  const auto position = at::arange(cache.length, cache.length + idx.size(1), idx.options().dtype(at::kLong))
                            .unsqueeze(0)
                            .expand({idx.size(0), idx.size(1)});
  auto logits = run(0, static_cast<int>(config_.num_layers) + 2, idx, position, {}, &cache);
  cache.length += idx.size(1);
  return logits;
}

at::Tensor LlamaImpl::forward_units(int first, int end, const at::Tensor& input, const at::Tensor& position,
                                    const at::Tensor& segment) {
  ST_CHECK(first > 0 || (input.dim() == 2 && input.size(1) <= config_.max_positions), InvalidArgument,
           "Llama::forward_units expects token ids [B, T] with T <= ", config_.max_positions, " at unit 0, got ",
           input.sizes());
  ST_CHECK(first == 0 || (position.defined() && position.dim() == 2), InvalidArgument,
           "Llama::forward_units needs the positions [B, T] past unit 0");
  return run(first, end, input, position, segment, nullptr);
}

std::vector<int64_t> LlamaImpl::pipeline_unit_parameters() const {
  const LlamaConfig& c = config_;
  const int64_t embedding = c.vocab_size * c.hidden_size;
  std::vector<int64_t> units{embedding};
  LlamaConfig one = c;
  one.num_layers = 1;
  one.tie_word_embeddings = true;  // one layer, one embedding, the final norm
  const int64_t layer = one.num_parameters() - embedding - c.hidden_size;
  for (int64_t i = 0; i < c.num_layers; ++i) units.push_back(layer);
  units.push_back(embedding + c.hidden_size);  // the head (a tied one computes with the embedding's weight)
  return units;
}

void LlamaImpl::keep_units(const std::vector<std::pair<int, int>>& ranges) {
  const int units = static_cast<int>(config_.num_layers) + 2;
  kept_ = detail::kept_units(ranges, units, "Llama");
  // Dropped layers leave the registered list; those kept keep their index
  // in their names (model.layers.5...).
  detail::keep_layers(*model, "layers", model->layers, kept_);
  const bool head = kept_.back();
  if (!head) {
    detail::drop_module(*model, "norm", *model->norm);
    if (lm_head) detail::drop_module(*this, "lm_head", *lm_head);
  }
  if (!kept_.front() && (lm_head || !head)) {  // a tied head keeps the embedding's weight
    detail::drop_module(*model, "embed_tokens", *model->embed_tokens);
  }
}

at::Tensor LlamaImpl::run(int first, int end, const at::Tensor& input, const at::Tensor& position,
                          const at::Tensor& segment, KVCache* cache) {
  const int layers = static_cast<int>(config_.num_layers);
  detail::check_units(kept_, first, end, layers + 2, "Llama");
  at::Tensor h = first == 0 ? detail::vocab_embedding(*this, *model->embed_tokens, input) : input;
  const int64_t b = first == 0 ? input.size(0) : position.size(0);
  const int64_t t = first == 0 ? input.size(1) : position.size(1);
  const auto pos = position.defined() ? position.to(at::kLong)
                                      : at::arange(t, input.options().dtype(at::kLong)).unsqueeze(0).expand({b, t});
  // cos and sin [B, T, d], in the hidden states' dtype (as HF casts them).
  const auto flat = pos.reshape({-1});
  const auto cos = rotary_.cos.index_select(0, flat).view({b, t, rotary_.cos.size(1)}).to(h.scalar_type());
  const auto sin = rotary_.sin.index_select(0, flat).view({b, t, rotary_.sin.size(1)}).to(h.scalar_type());
  if (cache != nullptr && cache->keys.empty()) {
    cache->keys.resize(model->layers->size());
    cache->values.resize(model->layers->size());
  }
  const bool recompute =
      cache == nullptr && config_.activation_checkpointing && is_training() && torch::GradMode::is_enabled();
  const auto [from, to] = detail::unit_layers(first, end, layers);
  for (int i = from; i < to; ++i) {
    auto block = model->layers->ptr<llama::BlockImpl>(static_cast<size_t>(i));
    if (cache != nullptr) {
      h = block->forward(h, cos, sin, {}, &cache->keys[static_cast<size_t>(i)], &cache->values[static_cast<size_t>(i)]);
      continue;
    }
    // The checkpoint goes inside the unit, so its recomputation during
    // backward finds the unit's parameters gathered.
    h = strategy::unit_forward(block, [&] {
      return recompute ? checkpoint([block, cos, sin, segment](const at::Tensor& in) { return block->forward(in, cos, sin, segment); },
                                    h, block->parameters())
                       : block->forward(h, cos, sin, segment);
    });
  }
  if (end < layers + 2) return h;
  h = detail::column_input(*this, model->norm(h));
  return detail::vocab_logits(*this, lm_head ? lora_forward(*lm_head, h) : at::linear(h, model->embed_tokens->weight));
}

// ---- the family -------------------------------------------------------------------------------

namespace {

class LlamaFamily final : public ModelFamily {
 public:
  train::ModelType type() const override { return train::ModelType::Llama; }
  void validate(const config::ModelConfig& m) const override {
    LlamaConfig::from(m).validate();
    ST_CHECK(m.max_position_embeddings == 0 || m.block_size <= m.max_position_embeddings, ConfigError,
             "model.block_size=", m.block_size, " exceeds the model's max_position_embeddings=",
             m.max_position_embeddings, "; hint: lower model.block_size");
  }
  std::shared_ptr<torch::nn::Module> build(const config::ModelConfig& m, bool deferred) const override {
    LlamaConfig c = LlamaConfig::from(m);
    c.deferred = deferred;
    return std::make_shared<LlamaImpl>(c);
  }
  double num_parameters(const config::ModelConfig& m) const override {
    return static_cast<double>(LlamaConfig::from(m).num_parameters());
  }
  // Per layer and token at full context: the inputs kept for backward by
  // the norms, projections, rotary, attention (scores and weights: heads x
  // T each) and SwiGLU; plus the logits and their gradient.
  double activation_bytes(const config::ModelConfig& m, int64_t micro, int bytes) const override {
    const LlamaConfig c = LlamaConfig::from(m);
    const double bt = static_cast<double>(micro) * static_cast<double>(c.block_size);
    const double h = static_cast<double>(c.hidden_size);
    const double q = static_cast<double>(c.num_heads * c.head_dim);
    const double kv = static_cast<double>(c.num_kv_heads * c.head_dim);
    const double f = static_cast<double>(c.intermediate_size);
    const double scores = 2.0 * static_cast<double>(c.num_heads) * static_cast<double>(c.block_size);
    const double per_token = 4.0 * h + 3.0 * q + 4.0 * kv + scores + 4.0 * f;
    const double layer = bt * per_token * bytes;
    const double layers = static_cast<double>(c.num_layers);
    const double blocks = c.activation_checkpointing ? layers * bt * h * bytes + layer : layers * layer;
    return blocks + 2.0 * bt * static_cast<double>(c.vocab_size) * bytes;
  }
  std::string size_text(const config::ModelConfig& m) const override {
    const LlamaConfig c = LlamaConfig::from(m);
    return ::shardtrain::detail::str_cat("model.n_layer=", c.num_layers, ", n_embd=", c.hidden_size,
                                         ", intermediate_size=", c.intermediate_size, ", vocab_size=",
                                         c.vocab_size, ", block_size=", c.block_size);
  }
  std::vector<std::string> lora_targets() const override {
    return {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
  }
  std::string peft_prefix() const override { return "base_model.model."; }
  // Older files keep each layer's rotary inv_freq buffer (ours is computed
  // from the config); a tied model's file may also hold lm_head.weight, a
  // copy of the embedding, which transformers ties away as we do.
  bool hf_skipped(const std::string& name) const override {
    const std::string inv = ".rotary_emb.inv_freq";
    return name == "lm_head.weight" ||
           (name.size() >= inv.size() && name.compare(name.size() - inv.size(), inv.size(), inv) == 0);
  }
  std::vector<std::string> hf_model_types() const override { return {"llama", "mistral", "qwen2"}; }
  TensorParallelPlan tensor_parallel_plan() const override {
    TensorParallelPlan p;
    p.column = {{"q_proj", 1}, {"k_proj", 1}, {"v_proj", 1}, {"gate_proj", 1}, {"up_proj", 1}};
    p.row = {"o_proj", "down_proj"};
    p.regions = {"self_attn", "mlp"};
    p.embedding = "model.embed_tokens";
    p.head = "lm_head";
    return p;
  }
  std::vector<std::pair<std::string, int64_t>> tensor_parallel_divisors(const config::ModelConfig& m) const override {
    const LlamaConfig c = LlamaConfig::from(m);
    return {{"model.n_head", c.num_heads}, {"model.n_kv_head", c.num_kv_heads}};
  }
  void read_hf_config(const nlohmann::json& j, config::ModelConfig& m) const override;
  std::string hf_config_json(const config::ModelConfig& m) const override;
};

// A config.json value of type T, or `fallback` when absent or null.
template <class T>
T value_or(const nlohmann::json& j, const char* key, T fallback) {
  const auto it = j.find(key);
  return it == j.end() || it->is_null() ? fallback : it->get<T>();
}

// config.json numbers, strictly, as the safetensors header's offsets are
// read: an integer key takes an integer (or an integral float such as
// 4096.0) of at least `min`; 2.9 is not truncated to 2 nor 1e30 cast to
// whatever it becomes. A real key takes a finite number > 0 (a negative
// rms_norm_eps or a rope_theta of 0 trains NaN).
int64_t integer_of(const nlohmann::json& v, const char* key, int64_t min) {
  int64_t x = 0;
  bool ok = false;
  if (v.is_number_unsigned()) {
    ok = v.get<uint64_t>() <= static_cast<uint64_t>(INT64_MAX);
    x = ok ? static_cast<int64_t>(v.get<uint64_t>()) : 0;
  } else if (v.is_number_integer()) {
    ok = true;
    x = v.get<int64_t>();
  } else if (v.is_number_float()) {
    const double d = v.get<double>();
    ok = std::isfinite(d) && d == std::floor(d) && std::fabs(d) <= 9.0e15;
    x = ok ? static_cast<int64_t>(d) : 0;
  }
  ST_CHECK(ok && x >= min, ConfigError, "config.json: ", key, " is ", v.dump(), "; expected an integer >= ", min,
           ". Hint: the model directory's config.json is damaged or not a model's");
  return x;
}

int64_t integer_at(const nlohmann::json& j, const char* key, int64_t min) {
  const auto it = j.find(key);
  ST_CHECK(it != j.end() && !it->is_null(), ConfigError, "config.json has no ", key,
           ". Hint: the model directory's config.json is damaged or not a model's");
  return integer_of(*it, key, min);
}

int64_t integer_or(const nlohmann::json& j, const char* key, int64_t fallback, int64_t min) {
  const auto it = j.find(key);
  return it == j.end() || it->is_null() ? fallback : integer_of(*it, key, min);
}

double positive_of(const nlohmann::json& v, const char* key) {
  const double x = v.is_number() ? v.get<double>() : std::nan("");
  ST_CHECK(std::isfinite(x) && x > 0.0, ConfigError, "config.json: ", key, " is ", v.dump(),
           "; expected a finite number > 0. Hint: the model directory's config.json is damaged or not a model's");
  return x;
}

double positive_at(const nlohmann::json& j, const char* key) {
  const auto it = j.find(key);
  ST_CHECK(it != j.end() && !it->is_null(), ConfigError, "config.json has no ", key,
           ". Hint: the model directory's config.json is damaged or not a model's");
  return positive_of(*it, key);
}

double positive_or(const nlohmann::json& j, const char* key, double fallback) {
  const auto it = j.find(key);
  return it == j.end() || it->is_null() ? fallback : positive_of(*it, key);
}

void LlamaFamily::read_hf_config(const nlohmann::json& j, config::ModelConfig& m) const {
  const std::string model_type = j.at("model_type").get<std::string>();
  m.hf_model_type = model_type;
  m.vocab_size = integer_at(j, "vocab_size", 1);
  m.n_embd = integer_at(j, "hidden_size", 1);
  m.n_layer = integer_at(j, "num_hidden_layers", 1);
  m.n_head = integer_at(j, "num_attention_heads", 1);
  m.n_kv_head = integer_or(j, "num_key_value_heads", m.n_head, 1);
  m.head_dim = integer_or(j, "head_dim", 0, 0);
  m.intermediate_size = integer_at(j, "intermediate_size", 1);
  m.rms_norm_eps = positive_or(j, "rms_norm_eps", 1e-6);
  m.max_position_embeddings = integer_or(j, "max_position_embeddings", 2048, 1);
  m.tie_word_embeddings = value_or<bool>(j, "tie_word_embeddings", false);
  m.mlp_bias = value_or<bool>(j, "mlp_bias", false);
  // Qwen2 always has q/k/v biases; Llama's attention_bias puts one on all four.
  m.attention_bias = model_type == "qwen2"                      ? train::AttentionBias::Qkv
                     : value_or<bool>(j, "attention_bias", false) ? train::AttentionBias::All
                                                                  : train::AttentionBias::None;
  const std::string act = value_or<std::string>(j, "hidden_act", "silu");
  ST_CHECK(act == "silu", ConfigError, "config.json: hidden_act '", act,
           "' is not supported; the llama family computes silu");
  if (model_type != "qwen2" || value_or<bool>(j, "use_sliding_window", false)) {
    const int64_t window = integer_or(j, "sliding_window", 0, 0);
    ST_CHECK(window == 0 || window >= m.block_size, ConfigError, "config.json: sliding_window=", window,
             " is shorter than model.block_size=", m.block_size,
             "; sliding-window attention is not implemented: lower model.block_size to at most ", window);
  }
  // rope_theta and rope_scaling, or the newer rope_parameters holding both.
  const nlohmann::json* rope = nullptr;
  if (j.contains("rope_parameters") && j["rope_parameters"].is_object()) rope = &j["rope_parameters"];
  m.rope_theta = positive_or(rope != nullptr ? *rope : j, "rope_theta", positive_or(j, "rope_theta", 10000.0));
  const nlohmann::json* scaling =
      rope != nullptr ? rope : (j.contains("rope_scaling") && j["rope_scaling"].is_object() ? &j["rope_scaling"] : nullptr);
  m.rope_scaling = train::RopeScaling::None;
  if (scaling != nullptr) {
    const std::string kind = value_or<std::string>(*scaling, "rope_type", value_or<std::string>(*scaling, "type", "default"));
    ST_CHECK(kind == "default" || kind == "llama3", ConfigError, "config.json: rope scaling '", kind,
             "' is not supported; supported: default, llama3");
    if (kind == "llama3") {
      m.rope_scaling = train::RopeScaling::Llama3;
      m.rope_factor = positive_at(*scaling, "factor");
      m.rope_low_freq_factor = positive_at(*scaling, "low_freq_factor");
      m.rope_high_freq_factor = positive_at(*scaling, "high_freq_factor");
      m.rope_original_max_position = integer_at(*scaling, "original_max_position_embeddings", 1);
      ST_CHECK(m.rope_high_freq_factor > m.rope_low_freq_factor, ConfigError,
               "config.json: llama3 rope scaling needs high_freq_factor (> low_freq_factor); got ", scaling->dump(),
               ". Hint: the model directory's config.json is damaged");
    }
  }
}

std::string LlamaFamily::hf_config_json(const config::ModelConfig& m) const {
  const LlamaConfig c = LlamaConfig::from(m);
  const char* arch = m.hf_model_type == "qwen2"     ? "Qwen2ForCausalLM"
                     : m.hf_model_type == "mistral" ? "MistralForCausalLM"
                                                    : "LlamaForCausalLM";
  nlohmann::json j = {
      {"architectures", {arch}},
      {"model_type", m.hf_model_type},
      {"vocab_size", c.vocab_size},
      {"hidden_size", c.hidden_size},
      {"intermediate_size", c.intermediate_size},
      {"num_hidden_layers", c.num_layers},
      {"num_attention_heads", c.num_heads},
      {"num_key_value_heads", c.num_kv_heads},
      {"head_dim", c.head_dim},
      {"hidden_act", "silu"},
      {"max_position_embeddings", c.max_positions},
      {"rms_norm_eps", c.rms_norm_eps},
      {"rope_theta", c.rope_theta},
      {"tie_word_embeddings", c.tie_word_embeddings},
      {"attention_bias", c.attention_bias == train::AttentionBias::All},
      {"mlp_bias", c.mlp_bias},
      {"attention_dropout", c.attention_dropout},
      {"initializer_range", kInitializerRange},
      {"torch_dtype", "float32"},
  };
  if (c.rope_scaling == train::RopeScaling::Llama3) {
    j["rope_scaling"] = {{"rope_type", "llama3"},
                         {"factor", c.rope_factor},
                         {"low_freq_factor", c.rope_low_freq_factor},
                         {"high_freq_factor", c.rope_high_freq_factor},
                         {"original_max_position_embeddings", c.rope_original_max_position}};
  }
  return j.dump(2) + "\n";
}

}  // namespace

const ModelFamily& llama_family() {
  static const LlamaFamily family;
  return family;
}

}  // namespace shardtrain::models
