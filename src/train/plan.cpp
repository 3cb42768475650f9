// From the config to the strategy: the options it asks for, with "auto"
// resolved through the memory estimator.
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <optional>
#include <unordered_set>

#include "shardtrain/core/error.h"
#include "shardtrain/config/config.h"
#include "shardtrain/models/family.h"
#include "shardtrain/models/lora.h"
#include "shardtrain/models/quantize.h"
#include "shardtrain/models/causal_lm.h"
#include "shardtrain/parallel/pipeline.h"
#include "shardtrain/parallel/tensor_parallel.h"
#include "shardtrain/strategy/estimate.h"
#include "shardtrain/strategy/strategy.h"
#include "shardtrain/strategy/wrap.h"
#include "shardtrain/train/plan.h"
#include "shardtrain/train/task.h"
#include "train/lora.h"

namespace shardtrain::train {

namespace {

// The distributed section is the strategy's options; only the choice of
// strategy (and, for fsdp, its sharding) may differ from what it says.
strategy::StrategyOptions options_from(const config::Config& config, strategy::StrategyKind kind,
                                       strategy::Sharding sharding) {
  strategy::StrategyOptions options = config.distributed;
  return options.strategy(kind).sharding(sharding);
}

bool half_params(const config::Config& config) {
  const strategy::DType d = config.distributed.param_dtype();
  return d == strategy::DType::Bf16 || d == strategy::DType::Fp16;
}

// "1.50 GiB" up to a PiB, "4.8e+25 bytes" beyond.
std::string bytes_text(double b) {
  char buf[64];
  if (b < 1024.0 * 1024.0 * 1024.0) {
    std::snprintf(buf, sizeof(buf), "%.1f MiB", b / (1024.0 * 1024.0));
  } else if (b < std::pow(1024.0, 5)) {
    std::snprintf(buf, sizeof(buf), "%.2f GiB", b / (1024.0 * 1024.0 * 1024.0));
  } else {
    std::snprintf(buf, sizeof(buf), "%.3g bytes", b);
  }
  return buf;
}

// A decoder layer's activations on one tensor-parallel rank, as a share of
// the whole (Korthikanti et al. 2022, per layer sbh(34 + 5as/h) without tp):
// with sequence parallelism everything divides by tp; without it the 10sbh
// of the norms, dropout and residual stream stay whole and the rest
// divides. Applied to the whole estimate (the logits too: vocabulary-sharded
// under loss parallelism).
double tensor_parallel_activation_share(const config::Config& config) {
  const auto tp = static_cast<double>(std::max<int64_t>(1, config.distributed.tensor_parallel()));
  return config.distributed.sequence_parallel() ? 1.0 / tp : (10.0 + 24.0 / tp) / 34.0;
}

}  // namespace

int activation_element_bytes(const config::Config& config) {
  return half_params(config) || config.precision != precision::PrecisionKind::Fp32 ? 2 : 4;
}

int64_t estimate_micro_batch(const config::Config& config, int world_size) {
  return config.batch.micro ? *config.batch.micro : config.resolve_batch(world_size).micro;
}

// A pipeline rank's activations as a share of one micro-batch through the
// whole model: it holds 1/p of the layers for every micro-batch in flight,
// at most p under 1f1b and its variants (about one whole micro-batch on the
// first rank), all m under gpipe.
double pipeline_activation_share(const config::Config& config, int data_parallel) {
  const auto& d = config.distributed;
  const auto pp = static_cast<double>(d.pipeline_parallel());
  if (pp <= 1.0 || d.pipeline_schedule() != parallel::PipelineSchedule::GPipe) return 1.0;
  return static_cast<double>(config.resolve_batch(data_parallel).accumulate) / pp;
}

strategy::EstimateInput estimate_input(const config::Config& config, torch::nn::Module& model,
                                       int world_size, int local_world_size) {
  const int tp = static_cast<int>(std::max<int64_t>(1, config.distributed.tensor_parallel()));
  const int pp = static_cast<int>(config.distributed.pipeline_parallel());
  ST_CHECK(world_size % (tp * pp) == 0 && local_world_size % tp == 0, ConfigError, "distributed.tensor_parallel=",
           tp, " x pipeline_parallel=", pp, " does not divide the world of ", world_size, " ranks (", local_world_size,
           " per host, which tensor_parallel must divide)");
  strategy::EstimateInput in;
  std::unordered_set<const void*> seen;  // tied parameters once
  for (const auto& p : model.parameters()) {
    if (!seen.insert(p.unsafeGetTensorImpl()).second) continue;
    if (p.requires_grad()) {
      in.num_params += p.numel();
    } else {
      in.frozen_bytes += static_cast<int64_t>(p.nbytes());
    }
  }
  const auto units = strategy::plan_units(
      model, strategy::policy_from_options(options_from(config, strategy::StrategyKind::Fsdp,
                                                     strategy::Sharding::FullShard)));
  std::vector<int64_t> sizes;
  for (const auto& u : units) sizes.push_back(u.numel);
  std::sort(sizes.rbegin(), sizes.rend());
  in.largest_unit_params = sizes.size() > 0 ? sizes[0] : 0;
  in.second_unit_params = sizes.size() > 1 ? sizes[1] : 0;
  in.world_size = world_size / (tp * pp);  // the data-parallel ranks
  // A stage's data-parallel ranks on one host (a pipeline on one host puts
  // its stages' groups side by side).
  in.local_world_size = std::min(local_world_size / tp, in.world_size);
  in.mixed_precision = half_params(config) || config.precision == precision::PrecisionKind::Fp16Mixed;
  const int act_bytes = activation_element_bytes(config);
  const int64_t micro = estimate_micro_batch(config, world_size);
  in.activation_bytes = static_cast<int64_t>(
      std::min(9.0e18, models::family_of(config.model.type).activation_bytes(config.model, micro, act_bytes) *
                           tensor_parallel_activation_share(config) *
                           pipeline_activation_share(config, world_size / (tp * pp))));
  return in;
}

std::vector<int> tensor_parallel_degrees(const config::Config& config, int local_world_size) {
  std::vector<int> out = {1};
  if (models::family_of(config.model.type).tensor_parallel_plan().regions.empty()) return out;
  // A degree is one the config's own checks accept when it is written (the
  // heads, block_size under sequence parallelism, strategy single, a QLoRA
  // base that checkpoints would hold): auto never picks what a set value
  // would be refused for.
  const std::string yaml = config.to_yaml();
  for (int tp = 2; tp <= local_world_size; ++tp) {
    if (local_world_size % tp != 0) continue;
    try {
      config::Config::parse(yaml, {"distributed.tensor_parallel=" + std::to_string(tp)});
      out.push_back(tp);
    } catch (const ConfigError&) {
      // refused at this degree
    }
  }
  return out;
}

std::shared_ptr<torch::nn::Module> planning_model(const config::Config& config) {
  const models::ModelFamily& family = models::family_of(config.model.type);
  family.validate(config.model);
  const auto model = family.build(config.model, /*deferred=*/true);
  const int pp = static_cast<int>(config.distributed.pipeline_parallel());
  if (pp > 1) {
    // The pipeline rank whose stages hold the most parameters.
    auto* lm = dynamic_cast<models::CausalLMImpl*>(model.get());
    ST_CHECK(lm != nullptr, ConfigError, "distributed.pipeline_parallel=", pp, ": the ",
             enum_name(config.model.type), " model cannot be cut into pipeline stages; set it to 1");
    const std::vector<int64_t> units = lm->pipeline_unit_parameters();
    const auto stages = parallel::split_stages(units, static_cast<int>(config.distributed.pipeline_stages()),
                                               config.distributed.pipeline_split());
    const int count = static_cast<int>(stages.size());
    const auto held = [&](int rank) {
      int64_t n = 0;
      for (int s : parallel::rank_stages(rank, pp, count)) {
        for (int u = stages[static_cast<size_t>(s)].first; u < stages[static_cast<size_t>(s)].end; ++u) {
          n += units[static_cast<size_t>(u)];
        }
      }
      return n;
    };
    int heaviest = 0;
    for (int r = 1; r < pp; ++r) heaviest = held(r) > held(heaviest) ? r : heaviest;
    std::vector<std::pair<int, int>> keep;
    for (int s : parallel::rank_stages(heaviest, pp, count)) {
      keep.emplace_back(stages[static_cast<size_t>(s)].first, stages[static_cast<size_t>(s)].end);
    }
    lm->keep_units(keep);
  }
  const auto tp = static_cast<int>(std::max<int64_t>(1, config.distributed.tensor_parallel()));
  const bool lora = config.lora.r() > 0;
  const models::LoraOptions options = detail::lora_options(config);
  if (lora) models::apply_lora(*model, models::LoraOptions(options).quantize(tp > 1 ? models::LoraQuantize::None : options.quantize()));
  if (tp > 1) {
    parallel::split_for_tensor_parallel(*model, family.tensor_parallel_plan(), tp, 0, /*whole_model=*/pp == 1);
    if (lora) models::quantize_lora_bases(*model, options);
  }
  return model;
}

std::optional<strategy::StrategyEstimate> estimate_strategy(const config::Config& config, int world_size,
                                                            int local_world_size, double budget_bytes) {
  const auto model = planning_model(config);
  const strategy::EstimateInput in = estimate_input(config, *model, world_size, local_world_size);
  const auto& d = config.distributed;
  if (d.strategy() == strategy::StrategyKind::Auto) {
    try {
      return strategy::choose_strategy(in, budget_bytes);
    } catch (const ConfigError&) {
      return std::nullopt;
    }
  }
  const std::string name = d.display_name();
  for (const auto& e : strategy::estimate_all(in)) {
    if (e.strategy == name || (d.strategy() == strategy::StrategyKind::Single && e.kind == strategy::StrategyKind::Ddp)) {
      if (e.total_bytes <= budget_bytes) return e;
      return std::nullopt;
    }
  }
  return std::nullopt;
}

double memory_budget_bytes(const config::Config& config, int local_world_size) {
  const double mb = config.distributed.memory_budget_mb();
  return mb > 0.0 ? mb * 1024.0 * 1024.0 : strategy::default_memory_budget_bytes(local_world_size);
}

void resolve_tensor_parallel(config::Config& config, int world_size, int local_world_size) {
  if (config.distributed.tensor_parallel() != 0) return;
  const double budget = memory_budget_bytes(config, local_world_size);
  const std::vector<int> degrees = tensor_parallel_degrees(config, local_world_size);
  for (const int tp : degrees) {
    if (world_size % (tp * config.distributed.pipeline_parallel()) != 0) continue;
    config::Config c = config;
    c.distributed.tensor_parallel(tp);
    if (estimate_strategy(c, world_size, local_world_size, budget)) {
      config.distributed.tensor_parallel(tp);
      return;
    }
  }
  std::string tried;
  for (const int tp : degrees) tried += (tried.empty() ? "" : ", ") + std::to_string(tp);
  ST_CHECK(false, ConfigError, "distributed.tensor_parallel: auto found no degree (", tried, ") at which ",
           config.distributed.strategy() == strategy::StrategyKind::Auto ? std::string("any strategy")
                                                                         : config.distributed.display_name(),
           " fits the memory budget of ", bytes_text(budget),
           " per rank; `shardtrain estimate` shows each; raise distributed.memory_budget_mb, add ranks per host, "
           "lower batch.micro or turn on model.activation_checkpointing");
}

comm::MeshShape mesh_shape(const config::Config& config, int world_size, int local_world_size) {
  const auto& d = config.distributed;
  ST_CHECK(d.tensor_parallel() >= 1, ConfigError,
           "distributed.tensor_parallel: auto is decided before the run is built: call "
           "train::resolve_tensor_parallel(config, world, local) before make_task (shardtrain train does)");
  const bool hybrid =
      d.strategy() == strategy::StrategyKind::Fsdp && d.sharding() == strategy::Sharding::HybridShard;
  return comm::mesh_shape_for(world_size, local_world_size, static_cast<int>(d.tensor_parallel()),
                              static_cast<int>(d.pipeline_parallel()), hybrid);
}

double model_parameter_count(const config::ModelConfig& m) {
  return models::family_of(m.type).num_parameters(m);
}

namespace {

// The weights' bytes per parameter that one rank keeps, and what they are.
// A model built from nothing draws its initial weights whole in fp32 on
// every rank. A model read from files is built deferred (make_task): a rank
// reads only what its strategy keeps, its shard under full_shard or
// hybrid_shard (a strategy still to be chosen may be full_shard), and a
// quantized LoRA base as codes and scales.
std::pair<double, std::string> kept_weight_bytes(const config::Config& config, int world_size,
                                                 int local_world_size) {
  if (config.model.init_from.empty()) return {4.0, "fp32 weights"};
  double bytes = 4.0;
  std::string what = "fp32 weights";
  if (config.lora.r() > 0 && config.lora.quantize() == models::LoraQuantize::Nf4) {
    bytes = 0.5 + 4.0 / models::kNf4Block;
    what = "nf4 base weights";
  } else if (config.lora.r() > 0 && config.lora.quantize() == models::LoraQuantize::Int8) {
    bytes = 1.0;
    what = "int8 base weights";
  }
  // Tensor-parallel ranks read only their blocks of the split layers
  // (nearly all of the weights), before any data-parallel sharding.
  const int64_t tp = config.distributed.tensor_parallel();
  if (tp > 1) {
    bytes /= static_cast<double>(tp);
    what += ::shardtrain::detail::str_cat(", 1/", tp, " tensor-parallel blocks");
  }
  const strategy::StrategyOptions& d = config.distributed;
  const bool fsdp = d.strategy() == strategy::StrategyKind::Fsdp;
  const int per_host = std::max<int>(1, local_world_size / static_cast<int>(tp));
  if (d.strategy() == strategy::StrategyKind::Auto ||
      (fsdp && d.sharding() == strategy::Sharding::FullShard)) {
    return {bytes / world_size, ::shardtrain::detail::str_cat(what, ", 1/", world_size, " of them")};
  }
  if (fsdp && d.sharding() == strategy::Sharding::HybridShard) {
    return {bytes / per_host, ::shardtrain::detail::str_cat(what, ", 1/", per_host, " of them")};
  }
  return {bytes, what};
}

}  // namespace

void check_model_fits(const config::Config& config, int world_size, int local_world_size) {
  const config::ModelConfig& m = config.model;
  const models::ModelFamily& family = models::family_of(m.type);
  const double params = family.num_parameters(m);
  const auto [per_param, kept] = kept_weight_bytes(config, world_size, local_world_size);
  const double weights = per_param * params;
  const int64_t micro = estimate_micro_batch(config, world_size);
  const int act_bytes = activation_element_bytes(config);
  // Under sequence parallelism a tensor-parallel rank holds 1/tp of each
  // layer's activations (inside the regions and outside them).
  const double activations = family.activation_bytes(m, micro, act_bytes) *
                             (config.distributed.sequence_parallel() ? tensor_parallel_activation_share(config) : 1.0);
  const double need = weights + activations;
  const double budget_mb = config.distributed.memory_budget_mb();
  const double have = memory_budget_bytes(config, local_world_size);
  if (need <= have) return;
  const std::string sizes = family.size_text(m);
  char count[32];
  std::snprintf(count, sizeof(count), "%.3g", params);
  ST_CHECK(false, ConfigError, "the model cannot fit in memory: ", sizes, " gives about ", count,
           " parameters, so each rank needs at least ", bytes_text(need), " (", kept, " ",
           bytes_text(weights), " + activations of a micro-batch of ", micro, ": ",
           bytes_text(activations), ") but has ", bytes_text(have), " available (",
           budget_mb > 0.0 ? "distributed.memory_budget_mb"
                           : ::shardtrain::detail::str_cat("MemAvailable / ", local_world_size,
                                                           " local rank(s)"),
           "). Hint: lower those model sizes or batch.micro; set distributed.memory_budget_mb "
           "only if more memory is really available");
}

strategy::StrategyOptions strategy_options(const config::Config& config, torch::nn::Module& model,
                                           int world_size, int local_world_size) {
  const auto& d = config.distributed;
  if (d.strategy() != strategy::StrategyKind::Auto) return d;
  const auto chosen = strategy::choose_strategy(estimate_input(config, model, world_size, local_world_size),
                                                memory_budget_bytes(config, local_world_size));
  return options_from(config, chosen.kind,
                      chosen.kind == strategy::StrategyKind::Fsdp ? chosen.sharding : d.sharding());
}

}  // namespace shardtrain::train
