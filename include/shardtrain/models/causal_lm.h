// What every language-model family gives: logits for token ids, packed rows,
// and a key/value cache for generation.
//
//   auto logits = model->forward(idx);                      // [B, T, V]
//   auto logits = model->forward(idx, position, segment);   // packed rows (data::Batch)
//   auto ids = generate(*model, prompt, GenerateOptions().max_new_tokens(64).top_p(0.9));
#pragma once

#include <torch/nn/module.h>

#include <cstdint>
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
};

struct GenerateOptions {
  ST_ARG(int64_t, max_new_tokens) = 200;
  /// 0: greedy (always the most likely token); else logits / temperature.
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
