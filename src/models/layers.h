// Linear and Embedding layers as the families build them.
//
// With `deferred`, nothing is drawn: the layer is made at size one and then
// given deferred placeholders of its real shapes (core/deferred.h), because
// drawing the initial weights of a large model (one random number per
// element, and a page fault per 4 KiB) costs far more than reading them from
// files, which is where a deferred model's weights come from.
#pragma once

#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace shardtrain::models::detail {

torch::nn::Linear make_linear(int64_t in, int64_t out, bool bias, bool deferred);
torch::nn::Embedding make_embedding(int64_t count, int64_t dim, bool deferred);

/// Pipeline units (CausalLMImpl::keep_units): which of `units` the ranges
/// {first, end} keep. InvalidArgument naming `model` for an empty range, one
/// outside the units, or no unit kept.
std::vector<bool> kept_units(const std::vector<std::pair<int, int>>& ranges, int units, const char* model);
/// InvalidArgument unless 0 <= first < end <= units and each unit of
/// [first, end) is kept (`kept` empty: every unit is).
void check_units(const std::vector<bool>& kept, int first, int end, int units, const char* model);

}  // namespace shardtrain::models::detail
