// Causal self-attention shared by the language-model families: the masks
// (plain, packed rows, after a key/value cache) and grouped-query heads.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace shardtrain::models::detail {

/// softmax(q k^T / sqrt(d) + mask) v for q [B, H, T, d] and k, v
/// [B, KV, S, d] with H a multiple of KV (query head h reads key/value head
/// h / (H / KV), as Hugging Face's repeat_kv). The T queries sit at positions
/// S - T .. S - 1 of the keys (S > T after a cache). `segment` [B, T]
/// (only with S == T) keeps each query to the keys of its own segment.
/// `dropout` applies to the attention weights (training only). Returns
/// [B, H, T, d].
at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& segment, double dropout, bool training);

/// x with its key/value cache entry for `layer` appended along dim 2:
/// returns the whole [B, KV, S, d] and stores it back.
at::Tensor append_cache(at::Tensor& cached, const at::Tensor& x);

}  // namespace shardtrain::models::detail
