// GPT-2 architecture: embeddings, pre-LayerNorm blocks, tied output projection.
#include "shardtrain/models/gpt.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <string>
#include <utility>

#include "shardtrain/core/error.h"
#include "shardtrain/models/checkpoint.h"
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

// The additive causal mask [T, T]: 0 on and below the diagonal, -inf above.
// One mask per dtype and device (per thread), as large as the largest T
// asked for; smaller T get its top-left corner.
torch::Tensor causal_mask(int64_t t, torch::ScalarType dtype, const torch::Device& device) {
  thread_local std::map<std::pair<torch::ScalarType, std::string>, torch::Tensor> masks;
  auto& mask = masks[{dtype, device.str()}];
  if (!mask.defined() || mask.size(0) < t) {
    torch::NoGradGuard no_grad;
    mask = torch::full({t, t}, -std::numeric_limits<double>::infinity(),
                       torch::TensorOptions().dtype(dtype).device(device))
               .triu(/*diagonal=*/1);
  }
  return mask.size(0) == t ? mask : mask.slice(0, 0, t).slice(1, 0, t);
}

// The dtype the attention scores are computed in: autocast's when it is on
// for x's device (so autocast does not cast the mask on every call), else x's.
torch::ScalarType mask_dtype(const torch::Tensor& x) {
  if (x.is_cpu() && at::autocast::is_cpu_enabled()) return at::autocast::get_autocast_cpu_dtype();
  if (x.is_cuda() && at::autocast::is_enabled()) return at::autocast::get_autocast_gpu_dtype();
  return x.scalar_type();
}

// GPT-2 / nanoGPT initialisation of one Linear: N(0, std) weight, zero bias.
void init_linear(torch::nn::Linear& linear, double std) {
  torch::nn::init::normal_(linear->weight, 0.0, std);
  if (linear->bias.defined()) torch::nn::init::zeros_(linear->bias);
}

}  // namespace

// ---- config ------------------------------------------------------------------------

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
  c_attn = register_module("c_attn", torch::nn::Linear(torch::nn::LinearOptions(c, 3 * c)));
  c_proj = register_module("c_proj", torch::nn::Linear(torch::nn::LinearOptions(c, c)));
}

torch::Tensor CausalSelfAttentionImpl::forward(const torch::Tensor& x) {
  const int64_t batch = x.size(0);
  const int64_t t = x.size(1);
  const int64_t c = x.size(2);
  const int64_t head_size = c / n_head_;

  // [B, T, 3C] -> three [B, nh, T, hs]
  auto qkv = lora_forward(*c_attn, x).split(c, /*dim=*/2);
  auto heads = [&](const torch::Tensor& y) {
    return y.view({batch, t, n_head_, head_size}).transpose(1, 2);
  };
  const auto q = heads(qkv[0]);
  const auto k = heads(qkv[1]);
  const auto v = heads(qkv[2]);

  // Scores = q k^T / sqrt(hs) + causal mask, in one batched GEMM: baddbmm
  // starts from the additive mask (0, or -inf above the diagonal) and adds
  // alpha * q k^T to it, instead of a GEMM, a scaling pass and a masking
  // pass (and their backward passes). The mask is no buffer: nothing for a
  // strategy to broadcast or a checkpoint to hold.
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_size));
  const int64_t bh = batch * n_head_;
  const auto mask = causal_mask(t, mask_dtype(x), x.device()).expand({bh, t, t});
  auto att = torch::baddbmm(mask, q.reshape({bh, t, head_size}), k.reshape({bh, t, head_size}).transpose(1, 2),
                            /*beta=*/1.0, /*alpha=*/scale)
                 .view({batch, n_head_, t, t});
  att = maybe_dropout(torch::softmax(att, /*dim=*/-1), dropout_, *this);
  auto y = torch::matmul(att, v);  // [B, nh, T, hs]
  y = y.transpose(1, 2).contiguous().view({batch, t, c});
  return maybe_dropout(lora_forward(*c_proj, y), dropout_, *this);
}

// ---- MLP and block -------------------------------------------------------------------

MLPBlockImpl::MLPBlockImpl(const GPTConfig& config) : dropout_(config.dropout) {
  const int64_t c = config.n_embd;
  c_fc = register_module("c_fc", torch::nn::Linear(torch::nn::LinearOptions(c, 4 * c)));
  c_proj = register_module("c_proj", torch::nn::Linear(torch::nn::LinearOptions(4 * c, c)));
}

torch::Tensor MLPBlockImpl::forward(const torch::Tensor& x) {
  return maybe_dropout(lora_forward(*c_proj, torch::gelu(lora_forward(*c_fc, x), "tanh")), dropout_, *this);
}

BlockImpl::BlockImpl(const GPTConfig& config) {
  ln_1 = register_module("ln_1", make_layer_norm(config.n_embd));
  attn = register_module("attn", CausalSelfAttention(config));
  ln_2 = register_module("ln_2", make_layer_norm(config.n_embd));
  mlp = register_module("mlp", MLPBlock(config));
}

// Blocks, attentions and MLPs are called through unit_forward so that a
// sharded strategy may make any of them a unit (strategy/unit.h).
torch::Tensor BlockImpl::forward(const torch::Tensor& x) {
  using strategy::unit_forward;
  auto y = x + unit_forward(attn, [&] { return attn(ln_1(x)); });
  return y + unit_forward(mlp, [&] { return mlp(ln_2(y)); });
}

// ---- GPT -------------------------------------------------------------------------------

GPTImpl::GPTImpl(const GPTConfig& config) : config_(config) {
  config_.validate();
  wte = register_module("wte", torch::nn::Embedding(config_.vocab_size, config_.n_embd));
  wpe = register_module("wpe", torch::nn::Embedding(config_.block_size, config_.n_embd));
  h = register_module("h", torch::nn::ModuleList());
  for (int64_t i = 0; i < config_.n_layer; ++i) h->push_back(Block(config_));
  ln_f = register_module("ln_f", make_layer_norm(config_.n_embd));

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

torch::Tensor GPTImpl::forward(const torch::Tensor& idx) {
  ST_CHECK(idx.dim() == 2, InvalidArgument, "GPT::forward expects idx of shape [B, T], got ",
           idx.sizes(), "; hint: add a batch dimension with unsqueeze(0)");
  const int64_t t = idx.size(1);
  ST_CHECK(t >= 1 && t <= config_.block_size, InvalidArgument, "GPT::forward got T=", t,
           " tokens but model.block_size=", config_.block_size,
           "; hint: crop the context to the last block_size tokens");

  const auto pos = torch::arange(t, idx.options().dtype(torch::kLong));
  auto x = maybe_dropout(wte(idx) + wpe(pos), config_.dropout, *this);  // [B, T, C] + [T, C]
  // Activation checkpointing keeps only each block's input and recomputes the
  // block during backward; pointless without a backward to come.
  const bool recompute =
      config_.activation_checkpointing && is_training() && torch::GradMode::is_enabled();
  for (const auto& module : *h) {
    auto block = std::dynamic_pointer_cast<BlockImpl>(module);
    // The checkpoint goes inside the unit, so its recomputation during
    // backward finds the unit's parameters gathered.
    x = strategy::unit_forward(block, [&] {
      return recompute ? checkpoint([block](const torch::Tensor& in) { return block->forward(in); },
                                    x, block->parameters())
                       : block->forward(x);
    });
  }
  x = ln_f(x);
  // Tied output projection: logits = x @ wte.weight^T.
  return torch::nn::functional::linear(x, wte->weight);
}

torch::Tensor GPTImpl::generate(torch::Tensor idx, int64_t max_new_tokens, double temperature,
                                int64_t top_k, uint64_t seed) {
  ST_CHECK(idx.dim() == 2 && idx.size(1) >= 1, InvalidArgument,
           "GPT::generate expects a non-empty prompt of shape [B, T], got ", idx.sizes(),
           "; hint: start from at least one token");
  ST_CHECK(max_new_tokens >= 0, InvalidArgument, "GPT::generate max_new_tokens=", max_new_tokens,
           " must be >= 0");
  ST_CHECK(temperature > 0.0, InvalidArgument, "GPT::generate temperature=", temperature,
           " must be > 0; hint: use a small value such as 1e-3 for near-greedy sampling");

  torch::NoGradGuard no_grad;
  // No dropout while sampling, whatever mode the caller left the model in.
  const bool was_training = is_training();
  eval();
  // Sampling happens on the CPU with a generator of its own: the same seed
  // gives the same tokens whatever the model's device and whatever else has
  // drawn from the global generator.
  auto gen = at::detail::createCPUGenerator(seed);
  idx = idx.to(torch::kLong);
  const int64_t block = config_.block_size;
  for (int64_t i = 0; i < max_new_tokens; ++i) {
    const auto context = idx.size(1) <= block ? idx : idx.slice(1, idx.size(1) - block);
    auto logits = forward(context).select(1, -1).to(torch::kFloat) / temperature;  // [B, V]
    if (top_k > 0 && top_k < logits.size(-1)) {
      const auto kth = std::get<0>(torch::topk(logits, top_k, -1)).select(-1, top_k - 1);
      logits = logits.masked_fill(logits < kth.unsqueeze(-1),
                                  -std::numeric_limits<double>::infinity());
    }
    const auto probs = torch::softmax(logits, -1).to(torch::kCPU);
    const auto next = torch::multinomial(probs, 1, /*replacement=*/false, gen);  // [B, 1]
    idx = torch::cat({idx, next.to(idx.device())}, 1);
  }
  train(was_training);
  return idx;
}

}  // namespace shardtrain::models
