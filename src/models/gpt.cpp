// GPT-2 architecture: embeddings, pre-LayerNorm blocks, tied output projection.
#include "shardtrain/models/gpt.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <utility>

#include "shardtrain/core/deferred.h"
#include "shardtrain/core/error.h"
#include "models/attention.h"
#include "models/families.h"
#include "models/activations.h"
#include "models/layers.h"
#include "models/tensor_parallel.h"
#include "shardtrain/config/config.h"
#include "shardtrain/checkpoint/safetensors.h"
#include "shardtrain/models/checkpoint.h"
#include "shardtrain/strategy/estimate.h"
#include "shardtrain/models/lora.h"
#include "shardtrain/strategy/unit.h"

namespace shardtrain::models {

namespace {

constexpr double kInitStd = 0.02;
constexpr double kLayerNormEps = 1e-5;

torch::nn::LayerNorm make_layer_norm(int64_t n_embd) {
  return torch::nn::LayerNorm(
      torch::nn::LayerNormOptions({n_embd}).eps(kLayerNormEps).elementwise_affine(true));
}

// Dropout in training mode only: evaluation and sampling see the whole model.
torch::Tensor maybe_dropout(const torch::Tensor& x, double p, const torch::nn::Module& m) {
  return p > 0.0 && m.is_training() ? torch::dropout(x, p, /*train=*/true) : x;
}

// GPT-2 / nanoGPT initialisation of one Linear: N(0, std) weight, zero bias.
void init_linear(torch::nn::Linear& linear, double std) {
  torch::nn::init::normal_(linear->weight, 0.0, std);
  if (linear->bias.defined()) torch::nn::init::zeros_(linear->bias);
}

}  // namespace

// ---- config ------------------------------------------------------------------------

GPTConfig GPTConfig::from(const config::ModelConfig& m) {
  GPTConfig g;
  g.n_layer = m.n_layer;
  g.n_head = m.n_head;
  g.n_embd = m.n_embd;
  g.block_size = m.block_size;
  g.vocab_size = m.vocab_size;
  g.activation_checkpointing = m.activation_checkpointing;
  g.dropout = m.dropout;
  return g;
}

void GPTConfig::validate() const {
  ST_CHECK(n_layer > 0, ConfigError, "model.n_layer=", n_layer,
           " must be positive; hint: set model.n_layer to the number of transformer blocks");
  ST_CHECK(n_head > 0, ConfigError, "model.n_head=", n_head,
           " must be positive; hint: set model.n_head so that it divides model.n_embd");
  ST_CHECK(n_embd > 0, ConfigError, "model.n_embd=", n_embd,
           " must be positive; hint: set model.n_embd to a multiple of model.n_head");
  ST_CHECK(n_embd % n_head == 0, ConfigError, "model.n_embd=", n_embd,
           " is not divisible by model.n_head=", n_head,
           "; hint: choose model.n_embd as a multiple of model.n_head");
  ST_CHECK(block_size > 0, ConfigError, "model.block_size=", block_size,
           " must be positive; hint: set model.block_size to the context length in tokens");
  ST_CHECK(dropout >= 0.0 && dropout < 1.0, ConfigError, "model.dropout=", dropout,
           " must be in [0, 1); hint: 0 turns dropout off, nanoGPT fine-tunes with 0.1");
  ST_CHECK(vocab_size > 0, ConfigError, "model.vocab_size=", vocab_size,
           " must be positive; hint: use 256 for the byte tokenizer");
}

int64_t GPTConfig::num_parameters() const {
  const int64_t c = n_embd;
  const int64_t per_block = 2 * c                  // ln_1
                            + 3 * c * c + 3 * c    // attn.c_attn
                            + c * c + c            // attn.c_proj
                            + 2 * c                // ln_2
                            + 4 * c * c + 4 * c    // mlp.c_fc
                            + 4 * c * c + c;       // mlp.c_proj
  return vocab_size * c          // wte (also the output projection)
         + block_size * c        // wpe
         + n_layer * per_block   // h.*
         + 2 * c;                // ln_f
}

// ---- attention -----------------------------------------------------------------------

CausalSelfAttentionImpl::CausalSelfAttentionImpl(const GPTConfig& config)
    : n_head_(config.n_head), dropout_(config.dropout) {
  config.validate();
  const int64_t c = config.n_embd;
  c_attn = register_module("c_attn", detail::make_linear(c, 3 * c, true, config.deferred));
  c_proj = register_module("c_proj", detail::make_linear(c, c, true, config.deferred));
}

torch::Tensor CausalSelfAttentionImpl::forward(const torch::Tensor& x, const torch::Tensor& segment,
                                              torch::Tensor* cache_k, torch::Tensor* cache_v) {
  const torch::Tensor in = detail::column_input(*this, x);
  const int64_t batch = in.size(0);
  const int64_t t = in.size(1);
  const int64_t head_size = in.size(2) / n_head_;

  // [B, T, 3C] -> three [B, nh, T, hs]; under tensor parallelism this
  // rank's heads of each third: [B, T, 3C/tp] -> three [B, nh/tp, T, hs].
  const torch::Tensor fused = lora_forward(*c_attn, in);
  auto qkv = fused.split(fused.size(2) / 3, /*dim=*/2);
  auto heads = [&](const torch::Tensor& y) {
    return y.view({batch, t, y.size(2) / head_size, head_size}).transpose(1, 2);  // explicit: batch may be 0
  };
  auto k = heads(qkv[1]);
  auto v = heads(qkv[2]);
  if (cache_k != nullptr) {
    k = detail::append_cache(*cache_k, k);
    v = detail::append_cache(*cache_v, v);
  }
  auto y = detail::causal_attention(heads(qkv[0]), k, v, segment, dropout_, is_training());
  y = y.transpose(1, 2).contiguous().view({batch, t, y.size(1) * y.size(3)});
  return maybe_dropout(detail::row_parallel(*this, *c_proj, y), dropout_, *this);
}

// ---- MLP and block -------------------------------------------------------------------

MLPBlockImpl::MLPBlockImpl(const GPTConfig& config) : dropout_(config.dropout) {
  const int64_t c = config.n_embd;
  c_fc = register_module("c_fc", detail::make_linear(c, 4 * c, true, config.deferred));
  c_proj = register_module("c_proj", detail::make_linear(4 * c, c, true, config.deferred));
}

torch::Tensor MLPBlockImpl::forward(const torch::Tensor& x) {
  const torch::Tensor in = detail::column_input(*this, x);
  return maybe_dropout(detail::row_parallel(*this, *c_proj, detail::gelu_tanh(lora_forward(*c_fc, in))),
                       dropout_, *this);
}

BlockImpl::BlockImpl(const GPTConfig& config) {
  ln_1 = register_module("ln_1", make_layer_norm(config.n_embd));
  attn = register_module("attn", CausalSelfAttention(config));
  ln_2 = register_module("ln_2", make_layer_norm(config.n_embd));
  mlp = register_module("mlp", MLPBlock(config));
}

// Blocks, attentions and MLPs are called through unit_forward so that a
// sharded strategy may make any of them a unit (strategy/unit.h).
torch::Tensor BlockImpl::forward(const torch::Tensor& x, const torch::Tensor& segment,
                                torch::Tensor* cache_k, torch::Tensor* cache_v) {
  using strategy::unit_forward;
  auto y = x + unit_forward(attn, [&] { return attn->forward(ln_1(x), segment, cache_k, cache_v); });
  return y + unit_forward(mlp, [&] { return mlp(ln_2(y)); });
}

// ---- GPT -------------------------------------------------------------------------------

GPTImpl::GPTImpl(const GPTConfig& config) : config_(config) {
  config_.validate();
  const auto built = [&](auto module) {
    if (config_.deferred) defer_parameters(*module);
    return module;
  };
  wte = register_module("wte", detail::make_embedding(config_.vocab_size, config_.n_embd, config_.deferred));
  wpe = register_module("wpe", detail::make_embedding(config_.block_size, config_.n_embd, config_.deferred));
  h = register_module("h", torch::nn::ModuleList());
  for (int64_t i = 0; i < config_.n_layer; ++i) h->push_back(built(Block(config_)));
  ln_f = register_module("ln_f", built(make_layer_norm(config_.n_embd)));
  if (config_.deferred) return;  // the weights come from files

  // GPT-2 initialisation. The residual projections get a smaller std so the
  // residual stream's variance does not grow with depth (2 adds per block).
  torch::NoGradGuard no_grad;
  const double proj_std = kInitStd / std::sqrt(2.0 * static_cast<double>(config_.n_layer));
  torch::nn::init::normal_(wte->weight, 0.0, kInitStd);
  torch::nn::init::normal_(wpe->weight, 0.0, kInitStd);
  for (const auto& module : *h) {
    auto block = module->as<BlockImpl>();
    init_linear(block->attn->c_attn, kInitStd);
    init_linear(block->attn->c_proj, proj_std);
    init_linear(block->mlp->c_fc, kInitStd);
    init_linear(block->mlp->c_proj, proj_std);
    // LayerNorms keep LibTorch's ones/zeros.
  }
}

torch::Tensor GPTImpl::forward(const torch::Tensor& idx, const torch::Tensor& position,
                               const torch::Tensor& segment) {
  ST_CHECK(idx.dim() == 2, InvalidArgument, "GPT::forward expects idx of shape [B, T], got ",
           idx.sizes(), "; hint: add a batch dimension with unsqueeze(0)");
  const int64_t t = idx.size(1);
  ST_CHECK(t >= 1 && t <= config_.block_size, InvalidArgument, "GPT::forward got T=", t,
           " tokens but model.block_size=", config_.block_size,
           "; hint: crop the context to the last block_size tokens");

  return run(0, static_cast<int>(config_.n_layer) + 2, idx, position, segment);
}

torch::Tensor GPTImpl::forward_units(int first, int end, const torch::Tensor& input,
                                     const torch::Tensor& position, const torch::Tensor& segment) {
  ST_CHECK(first > 0 || (input.dim() == 2 && input.size(1) <= config_.block_size), InvalidArgument,
           "GPT::forward_units expects token ids [B, T] with T <= ", config_.block_size, " at unit 0, got ",
           input.sizes());
  return run(first, end, input, position, segment);
}

std::vector<int64_t> GPTImpl::pipeline_unit_parameters() const {
  const int64_t c = config_.n_embd, wte = config_.vocab_size * c;
  const int64_t block = (config_.num_parameters() - wte - config_.block_size * c - 2 * c) / config_.n_layer;
  std::vector<int64_t> units{wte + config_.block_size * c};
  for (int64_t i = 0; i < config_.n_layer; ++i) units.push_back(block);
  units.push_back(wte + 2 * c);  // ln_f and the tied output projection
  return units;
}

void GPTImpl::keep_units(const std::vector<std::pair<int, int>>& ranges) {
  const int units = static_cast<int>(config_.n_layer) + 2;
  kept_ = detail::kept_units(ranges, units, "GPT");
  // Dropped blocks leave the registered list; those kept keep their index
  // in their names (h.5...).
  detail::keep_layers(*this, "h", h, kept_);
  if (!kept_.back()) detail::drop_module(*this, "ln_f", *ln_f);
  if (!kept_.front()) {
    detail::drop_module(*this, "wpe", *wpe);
    if (!kept_.back()) detail::drop_module(*this, "wte", *wte);  // the head computes with wte's weight
  }
}

torch::Tensor GPTImpl::run(int first, int end, const torch::Tensor& input, const torch::Tensor& position,
                           const torch::Tensor& segment) {
  const int layers = static_cast<int>(config_.n_layer);
  detail::check_units(kept_, first, end, layers + 2, "GPT");
  torch::Tensor x = input;
  if (first == 0) {
    const int64_t t = input.size(1);
    const auto pos = position.defined() ? position : torch::arange(t, input.options().dtype(torch::kLong));
    // [B, T, C] + [(B,) T, C]; under sequence parallelism this rank's tokens of both.
    const torch::Tensor positions = wpe(pos).expand({input.size(0), t, config_.n_embd});
    x = maybe_dropout(detail::vocab_embedding(*this, *wte, input) + detail::sequence_shard(*this, positions),
                      config_.dropout, *this);
  }
  // Activation checkpointing keeps only each block's input and recomputes the
  // block during backward; pointless without a backward to come.
  const bool recompute =
      config_.activation_checkpointing && is_training() && torch::GradMode::is_enabled();
  const auto [from, to] = detail::unit_layers(first, end, layers);
  for (int i = from; i < to; ++i) {
    auto block = h->ptr<BlockImpl>(static_cast<size_t>(i));
    // The checkpoint goes inside the unit, so its recomputation during
    // backward finds the unit's parameters gathered.
    x = strategy::unit_forward(block, [&] {
      return recompute ? checkpoint([block, segment](const torch::Tensor& in) { return block->forward(in, segment); },
                                    x, block->parameters())
                       : block->forward(x, segment);
    });
  }
  if (end < layers + 2) return x;
  x = detail::column_input(*this, ln_f(x));
  // Tied output projection: logits = x @ wte.weight^T.
  return detail::vocab_logits(*this, torch::nn::functional::linear(x, wte->weight));
}

torch::Tensor GPTImpl::forward_cached(const torch::Tensor& idx, KVCache& cache) {
  const int64_t t = idx.size(1);
  ST_CHECK(cache.length + t <= config_.block_size, InvalidArgument, "GPT::forward_cached: ",
           cache.length, " cached + ", t, " new tokens exceed model.block_size=", config_.block_size,
           "; hint: start a new cache");
  detail::check_units(kept_, 0, static_cast<int>(config_.n_layer) + 2, static_cast<int>(config_.n_layer) + 2, "GPT");
  if (cache.keys.empty()) {
    cache.keys.resize(h->size());
    cache.values.resize(h->size());
  }
  const auto pos = torch::arange(cache.length, cache.length + t, idx.options().dtype(torch::kLong));
  auto x = wte(idx) + wpe(pos);
  for (size_t i = 0; i < h->size(); ++i) {
    x = h->ptr<BlockImpl>(i)->forward(x, {}, &cache.keys[i], &cache.values[i]);
  }
  cache.length += t;
  return torch::nn::functional::linear(ln_f(x), wte->weight);
}

// ---- the family -------------------------------------------------------------------------

namespace {

class GptFamily final : public ModelFamily {
 public:
  train::ModelType type() const override { return train::ModelType::Gpt; }
  void validate(const config::ModelConfig& m) const override { GPTConfig::from(m).validate(); }
  std::shared_ptr<torch::nn::Module> build(const config::ModelConfig& m, bool deferred) const override {
    GPTConfig c = GPTConfig::from(m);
    c.deferred = deferred;
    return std::make_shared<GPTImpl>(c);
  }
  double num_parameters(const config::ModelConfig& m) const override {
    // GPTConfig::num_parameters() in doubles.
    const double c = static_cast<double>(m.n_embd);
    const double per_block = 12.0 * c * c + 13.0 * c;
    return static_cast<double>(m.vocab_size) * c + static_cast<double>(m.block_size) * c +
           static_cast<double>(m.n_layer) * per_block + 2.0 * c;
  }
  double activation_bytes(const config::ModelConfig& m, int64_t micro, int bytes) const override {
    return static_cast<double>(strategy::gpt_activation_bytes(GPTConfig::from(m), micro, bytes));
  }
  std::string size_text(const config::ModelConfig& m) const override {
    return ::shardtrain::detail::str_cat("model.n_layer=", m.n_layer, ", n_head=", m.n_head, ", n_embd=",
                                         m.n_embd, ", vocab_size=", m.vocab_size, ", block_size=", m.block_size);
  }
  std::vector<std::string> lora_targets() const override { return {"c_attn", "c_proj", "c_fc"}; }
  TensorParallelPlan tensor_parallel_plan() const override {
    TensorParallelPlan p;
    p.column = {{"attn.c_attn", 3}, {"mlp.c_fc", 1}};
    p.row = {"attn.c_proj", "mlp.c_proj"};
    p.regions = {"attn", "mlp"};
    p.embedding = "wte";
    return p;
  }
  std::vector<std::pair<std::string, int64_t>> tensor_parallel_divisors(const config::ModelConfig& m) const override {
    return {{"model.n_head", m.n_head}};
  }
  // HF's GPT2LMHeadModel keeps the blocks under "transformer.".
  std::string peft_prefix() const override { return "base_model.model.transformer."; }
  bool hf_transposed(const std::string& name) const override { return checkpoint::is_conv1d_weight(name); }
  bool hf_conv1d() const override { return true; }
  // Hugging Face GPT-2 files carry causal masks as buffers; ours are built.
  bool hf_skipped(const std::string& name) const override {
    const auto ends = [&](const std::string& tail) {
      return name.size() >= tail.size() && name.compare(name.size() - tail.size(), tail.size(), tail) == 0;
    };
    return ends(".attn.bias") || ends(".attn.masked_bias");
  }
};

}  // namespace

const ModelFamily& gpt_family() {
  static const GptFamily family;
  return family;
}

}  // namespace shardtrain::models
