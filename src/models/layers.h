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

namespace shardtrain::models::detail {

torch::nn::Linear make_linear(int64_t in, int64_t out, bool bias, bool deferred);
torch::nn::Embedding make_embedding(int64_t count, int64_t dim, bool deferred);

}  // namespace shardtrain::models::detail
