// What every language-model family gives: logits for token ids, packed rows,
// and a key/value cache for generation.
//
//   auto logits = model->forward(idx);                      // [B, T, V]
//   auto logits = model->forward(idx, position, segment);   // packed rows (data::Batch)
//   auto ids = generate(*model, prompt, GenerateOptions().max_new_tokens(64).top_p(0.9));
#pragma once

#include <torch/nn/module.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "shardtrain/core/options.h"

namespace shardtrain::models {

/// Keys and values of the tokens seen so far, per layer [B, kv_heads, S, d].
struct KVCache {
  std::vector<at::Tensor> keys;
  std::vector<at::Tensor> values;
  /// Tokens cached (S).
  int64_t length = 0;
};

class CausalLMImpl : public torch::nn::Module {
 public:
  /// idx [B, T] int64 -> logits [B, T, vocab]. `position` [B, T] (ids of each
  /// token's place in its sample) and `segment` [B, T] (which sample of a
  /// packed row a token belongs to; attention never crosses samples) are
  /// optional: undefined means one sample per row at positions 0..T-1.
  virtual at::Tensor forward(const at::Tensor& idx, const at::Tensor& position = {},
                             const at::Tensor& segment = {}) = 0;
  /// Logits of idx [B, T] continuing the tokens in `cache` (positions
  /// cache.length...), whose keys and values it appends. Needs eval mode or
  /// no dropout; call under NoGradGuard.
  virtual at::Tensor forward_cached(const at::Tensor& idx, KVCache& cache) = 0;
  virtual int64_t vocab_size() const = 0;
  /// The most tokens one forward may see (positions the model has).
  virtual int64_t context_size() const = 0;

  // ---- auxiliary training loss (mixture-of-experts routers) --------------------------------
  /// The auxiliary loss of the last forward in training mode (a scalar: the
  /// routers' load-balancing loss), with its graph when auxiliary_loss_weight()
  /// is above 0; undefined when the model has none or the forward saw no token.
  virtual at::Tensor auxiliary_loss() const { return {}; }
  /// Whether the model computes one (the trainer logs it as aux_loss).
  virtual bool has_auxiliary_loss() const { return false; }
  /// The weight with which auxiliary_loss() enters the training loss; 0: it
  /// is only logged.
  virtual double auxiliary_loss_weight() const { return 0.0; }

  // ---- pipeline parallelism (parallel/pipeline.h) ----------------------------------------
  // The model as a chain of units: the token embedding (unit 0), decoder
  // layer i (unit 1 + i) and the final norm with the head (the last unit).
  // A family that cannot be cut keeps these defaults, which refuse.

  /// Parameters of each unit, in order; a tied head counts its weight again.
  virtual std::vector<int64_t> pipeline_unit_parameters() const;
  /// Runs units [first, end): `input` is token ids [B, T] when first is 0,
  /// else the hidden states unit first - 1 returned; returns hidden states,
  /// or the logits when end is past the last unit. `position` [B, T] is
  /// required past unit 0 (the hidden states may hold a sequence shard);
  /// `segment` as forward().
  virtual at::Tensor forward_units(int first, int end, const at::Tensor& input, const at::Tensor& position,
                                   const at::Tensor& segment);
  /// Keeps the units of `ranges` ({first, end} each) and drops the others:
  /// their modules leave the model (so do their parameters, whose storage is
  /// released) and the kept ones keep the whole model's names. A tied head
  /// keeps the embedding's weight. forward() then refuses; forward_units()
  /// runs kept units only. Before any strategy sees the model.
  virtual void keep_units(const std::vector<std::pair<int, int>>& ranges);
};

struct GenerateOptions {
  ST_ARG(int64_t, max_new_tokens) = 200;
  /// 0 (or below 1e-4): greedy (always the most likely token); else
  /// logits / temperature.
  ST_ARG(double, temperature) = 0.8;
  /// Keep the k most likely tokens; 0: all.
  ST_ARG(int64_t, top_k) = 0;
  /// Keep the smallest set of most likely tokens whose probability reaches
  /// top_p; 1: all.
  ST_ARG(double, top_p) = 1.0;
  ST_ARG(uint64_t, seed) = 0;
  /// Generation ends after any of these tokens (it is kept in the output).
  ST_ARG(std::vector<int64_t>, stop_tokens) = {};
  /// false: every token runs the whole context again (the reference the
  /// cached path is tested against, and the benchmark's baseline).
  ST_ARG(bool, use_cache) = true;
};

/// Appends up to max_new_tokens sampled tokens to prompt [1, T] (int64) and
/// returns [1, T + n]. Runs without grad in eval mode (the model's mode is
/// restored). Sampling uses a CPU generator of its own: the same seed gives
/// the same tokens whatever else has drawn from the global generator. Past
/// context_size() the context is cropped to its last tokens.
at::Tensor generate(CausalLMImpl& model, at::Tensor prompt, const GenerateOptions& options);

}  // namespace shardtrain::models
