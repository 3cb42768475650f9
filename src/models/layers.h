// Linear and Embedding layers as the families build them.
//
// With `deferred`, nothing is drawn: the layer is made at size one and then
// given deferred placeholders of its real shapes (core/deferred.h), because
// drawing the initial weights of a large model (one random number per
// element, and a page fault per 4 KiB) costs far more than reading them from
// files, which is where a deferred model's weights come from.
#pragma once

#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <cstdint>
#include <string>
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
/// The decoder layers [first, end) that units [first, end) run (unit 1 + i
/// is layer i) of a model of `layers` layers.
std::pair<int, int> unit_layers(int first, int end, int layers);
/// Registers, as `parent`'s child `name` in place of `list`, only the layers
/// of `list` whose unit is kept (kept[1 + i]), each under its own index
/// (name.5...); the others' parameters are released.
void keep_layers(torch::nn::Module& parent, const std::string& name, torch::nn::ModuleList& list,
                 const std::vector<bool>& kept);
/// Releases `module`'s parameters and removes it, `parent`'s child `name`.
void drop_module(torch::nn::Module& parent, const std::string& name, torch::nn::Module& module);

}  // namespace shardtrain::models::detail
