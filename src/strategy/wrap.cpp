// Unit hooks registry and auto-wrap planning.
#include "shardtrain/strategy/wrap.h"

#include <torch/torch.h>

#include <algorithm>
#include <mutex>
#include <shared_mutex>
#include <unordered_map>
#include <unordered_set>

#include "shardtrain/core/error.h"
#include "shardtrain/strategy/strategy.h"
#include "shardtrain/strategy/unit.h"

namespace shardtrain::strategy {

// ---- unit hooks --------------------------------------------------------------------------

namespace {

struct HookRegistry {
  std::shared_mutex mu;
  std::unordered_map<const torch::nn::Module*, std::shared_ptr<UnitHooks>> hooks;
};

HookRegistry& registry() {
  static HookRegistry r;
  return r;
}

}  // namespace

void attach_unit_hooks(const torch::nn::Module& module, std::shared_ptr<UnitHooks> hooks) {
  auto& r = registry();
  std::unique_lock lock(r.mu);
  if (hooks) {
    r.hooks[&module] = std::move(hooks);
  } else {
    r.hooks.erase(&module);
  }
}

std::shared_ptr<UnitHooks> find_unit_hooks(const torch::nn::Module& module) {
  auto& r = registry();
  std::shared_lock lock(r.mu);
  if (r.hooks.empty()) return nullptr;
  const auto it = r.hooks.find(&module);
  return it == r.hooks.end() ? nullptr : it->second;
}

// ---- policies ----------------------------------------------------------------------------

WrapPolicy module_type_policy(std::vector<std::string> type_names) {
  return [types = std::move(type_names)](const std::string& name, const torch::nn::Module& module,
                                         int64_t) {
    if (name.empty()) return false;
    // The class name without its namespaces: "BlockImpl" matches
    // shardtrain::models::BlockImpl but not MLPBlockImpl.
    const std::string& full = module.name();
    const size_t colon = full.rfind("::");
    const std::string t = colon == std::string::npos ? full : full.substr(colon + 2);
    return std::find(types.begin(), types.end(), t) != types.end();
  };
}

WrapPolicy size_policy(int64_t min_num_params) {
  return [min_num_params](const std::string& name, const torch::nn::Module& module,
                          int64_t unwrapped) {
    return !name.empty() && !module.children().empty() && unwrapped >= min_num_params;
  };
}

WrapPolicy policy_from_options(const StrategyOptions& options) {
  if (options.wrap_policy()) return options.wrap_policy();
  switch (options.auto_wrap_policy()) {
    case AutoWrapPolicy::ModuleType:
      return module_type_policy(options.wrap_module_types());
    case AutoWrapPolicy::Size:
      ST_CHECK(options.min_num_params() >= 1, ConfigError,
               "distributed.min_num_params must be >= 1, got ", options.min_num_params());
      return size_policy(options.min_num_params());
    case AutoWrapPolicy::None:
      break;
  }
  return [](const std::string&, const torch::nn::Module&, int64_t) { return false; };
}

// ---- planning ----------------------------------------------------------------------------

namespace {

struct Planner {
  const WrapPolicy& policy;
  std::unordered_map<const void*, size_t> order;  // parameter impl -> first named index
  std::vector<std::string> first_names;
  std::vector<int64_t> numels;
  std::unordered_map<size_t, std::string> owner_unit;  // parameter index -> unit claiming it
  std::vector<std::pair<size_t, UnitPlan>> units;           // (pre-order index, plan)
  size_t visit_index = 0;

  // Returns the parameter indices of the subtree that no unit claimed.
  std::vector<size_t> visit(const std::string& path, const torch::nn::Module& module) {
    const size_t pre_index = visit_index++;
    std::vector<size_t> unclaimed;
    std::unordered_set<size_t> seen;
    for (const auto& p : module.named_parameters(/*recurse=*/false)) {
      const size_t i = order.at(p.value().unsafeGetTensorImpl());
      if (seen.insert(i).second) unclaimed.push_back(i);
    }
    for (const auto& child : module.named_children()) {
      const std::string child_path = path.empty() ? child.key() : path + "." + child.key();
      for (size_t i : visit(child_path, *child.value())) {
        if (seen.insert(i).second) unclaimed.push_back(i);
      }
    }
    int64_t numel = 0;
    for (size_t i : unclaimed) numel += numels[i];
    if (!path.empty() && policy(path, module, numel)) {
      claim(path, &module, pre_index, unclaimed, numel);
      return {};
    }
    return unclaimed;
  }

  void claim(const std::string& path, const torch::nn::Module* module, size_t pre_index,
             std::vector<size_t> params, int64_t numel) {
    std::sort(params.begin(), params.end());
    UnitPlan plan;
    plan.name = path;
    plan.module = module;
    plan.numel = numel;
    for (size_t i : params) {
      const auto [it, inserted] = owner_unit.emplace(i, path);
      ST_CHECK(inserted, ConfigError, "parameter '", first_names[i],
               "' is shared by unit '", it->second.empty() ? "<root>" : it->second, "' and unit '",
               path.empty() ? "<root>" : path,
               "'; a tied parameter must belong to one unit: wrap a module that contains every "
               "use of it (or neither), e.g. with distributed.auto_wrap_policy");
      plan.params.push_back(first_names[i]);
    }
    units.emplace_back(pre_index, std::move(plan));
  }
};

}  // namespace

std::vector<UnitPlan> plan_units(torch::nn::Module& model, const WrapPolicy& policy) {
  Planner planner{policy};
  for (const auto& p : model.named_parameters(/*recurse=*/true)) {
    const void* impl = p.value().unsafeGetTensorImpl();
    if (planner.order.count(impl)) continue;
    planner.order.emplace(impl, planner.first_names.size());
    planner.first_names.push_back(p.key());
    planner.numels.push_back(p.value().numel());
  }
  // A tied parameter's owners are modules in different subtrees; the planner
  // sees it once per subtree, so a second claim is the conflict to report.
  auto root_params = planner.visit("", model);
  int64_t numel = 0;
  for (size_t i : root_params) numel += planner.numels[i];
  planner.claim("", &model, 0, root_params, numel);
  std::sort(planner.units.begin(), planner.units.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<UnitPlan> out;
  out.reserve(planner.units.size());
  for (auto& u : planner.units) out.push_back(std::move(u.second));
  return out;
}

}  // namespace shardtrain::strategy
