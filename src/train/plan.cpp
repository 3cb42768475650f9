// From the config to the strategy: the options it asks for, with "auto"
// resolved through the memory estimator.
#include <torch/torch.h>

#include <algorithm>
#include <unordered_set>

#include "shardtrain/core/error.h"
#include "shardtrain/models/gpt.h"
#include "shardtrain/strategy/estimate.h"
#include "shardtrain/strategy/strategy.h"
#include "shardtrain/strategy/wrap.h"
#include "shardtrain/train/trainer.h"

namespace shardtrain::train {

namespace {

// The config's distributed section still spells its choices as strings;
// they become the library's enums here.
strategy::StrategyOptions options_from(const config::Config& config, const std::string& name,
                                       const std::string& sharding) {
  using namespace strategy;
  const auto& d = config.distributed;
  return StrategyOptions()
      .strategy(enum_from_name<StrategyKind>(name, "distributed.strategy"))
      .sharding(enum_from_name<Sharding>(sharding, "distributed.sharding"))
      .bucket_cap_mb(d.bucket_cap_mb)
      .first_bucket_mb(d.first_bucket_mb)
      .find_unused_parameters(d.find_unused_parameters)
      .reduce_dtype(enum_from_name<DType>(d.reduce_dtype, "distributed.reduce_dtype"))
      .param_dtype(enum_from_name<DType>(d.param_dtype, "distributed.param_dtype"))
      .auto_wrap_policy(enum_from_name<AutoWrapPolicy>(d.auto_wrap_policy, "distributed.auto_wrap_policy"))
      .wrap_module_types(d.wrap_module_types)
      .min_num_params(d.min_num_params)
      .backward_prefetch(
          enum_from_name<BackwardPrefetch>(d.backward_prefetch, "distributed.backward_prefetch"))
      .forward_prefetch(d.forward_prefetch)
      .limit_all_gathers(d.limit_all_gathers)
      .accumulation(enum_from_name<Accumulation>(d.accumulation, "distributed.accumulation"));
}

}  // namespace

strategy::EstimateInput estimate_input(const config::Config& config, torch::nn::Module& model,
                                       int world_size, int local_world_size) {
  strategy::EstimateInput in;
  std::unordered_set<const void*> seen;  // tied parameters once
  for (const auto& p : model.parameters()) {
    if (p.requires_grad() && seen.insert(p.unsafeGetTensorImpl()).second) in.num_params += p.numel();
  }
  const auto units = strategy::plan_units(
      model, strategy::policy_from_options(options_from(config, "fsdp", "full_shard")));
  std::vector<int64_t> sizes;
  for (const auto& u : units) sizes.push_back(u.numel);
  std::sort(sizes.rbegin(), sizes.rend());
  in.largest_unit_params = sizes.size() > 0 ? sizes[0] : 0;
  in.second_unit_params = sizes.size() > 1 ? sizes[1] : 0;
  in.world_size = world_size;
  in.local_world_size = local_world_size;
  const auto& d = config.distributed;
  const bool half_params = d.param_dtype == "bf16" || d.param_dtype == "fp16";
  in.mixed_precision = half_params || config.precision == "fp16-mixed";
  const int act_bytes = half_params || config.precision != "fp32" ? 2 : 4;
  // batch.micro when given, so that layouts the global batch does not divide
  // into can still be estimated.
  const int64_t micro =
      config.batch.micro ? *config.batch.micro : config.resolve_batch(world_size).micro;
  in.activation_bytes = config.model.type == "mlp"
                            ? strategy::mlp_activation_bytes(config.model.mlp_sizes, micro, act_bytes)
                            : strategy::gpt_activation_bytes(gpt_config(config.model), micro, act_bytes);
  return in;
}

strategy::StrategyOptions strategy_options(const config::Config& config, torch::nn::Module& model,
                                           int world_size, int local_world_size) {
  const auto& d = config.distributed;
  if (d.strategy != "auto") return options_from(config, d.strategy, d.sharding);
  const double budget = d.memory_budget_mb > 0.0 ? d.memory_budget_mb * 1024.0 * 1024.0
                                                 : strategy::default_memory_budget_bytes(local_world_size);
  const auto chosen = strategy::choose_strategy(
      estimate_input(config, model, world_size, local_world_size), budget);
  // "ddp", "zero1" or "fsdp/<sharding>".
  const auto slash = chosen.strategy.find('/');
  if (slash == std::string::npos) return options_from(config, chosen.strategy, d.sharding);
  return options_from(config, chosen.strategy.substr(0, slash), chosen.strategy.substr(slash + 1));
}

}  // namespace shardtrain::train
