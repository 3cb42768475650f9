// Auto-wrap policies: which submodules of a model become fsdp units.
//
// A unit is gathered and freed as a whole; its parameters are those of its
// module that no unit nested inside it claims. Whatever no unit claims
// belongs to the root unit (the model itself), which stays gathered.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "shardtrain/strategy/options.h"

namespace shardtrain::strategy {

// WrapPolicy (strategy/options.h) decides whether `module` (at dotted path
// `name`, "" for the root) becomes a unit. `unwrapped_params` counts its
// parameters that no unit nested in it has claimed yet (the policies visit
// children before parents).

/// Modules whose class name, without namespaces (Module::name() is e.g.
/// "shardtrain::models::BlockImpl"), is one of `type_names` ("BlockImpl").
WrapPolicy module_type_policy(std::vector<std::string> type_names);

/// Modules with children (not leaf layers such as Linear) whose unwrapped
/// parameters number at least `min_num_params`.
WrapPolicy size_policy(int64_t min_num_params);

/// The policy StrategyOptions describes (its wrap_policy when set, else
/// auto_wrap_policy and its fields);
/// ConfigError for an unknown policy name.
WrapPolicy policy_from_options(const StrategyOptions& options);

/// One planned unit.
struct UnitPlan {
  /// Dotted module path; "" for the root unit.
  std::string name;
  const torch::nn::Module* module = nullptr;
  /// Names (named_parameters of the whole model) of the parameters it holds,
  /// in registration order; tied parameters appear once, under their first name.
  std::vector<std::string> params;
  /// Elements in those parameters.
  int64_t numel = 0;
};

/// The units of `model` under `policy`, in the order of a pre-order walk
/// (parents before children); the root unit is first, possibly empty.
/// A tied parameter whose owners fall in different units is a ConfigError
/// naming it.
std::vector<UnitPlan> plan_units(torch::nn::Module& model, const WrapPolicy& policy);

}  // namespace shardtrain::strategy
