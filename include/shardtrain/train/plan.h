// From the config to the strategy: the options its distributed section asks
// for, and the memory estimator's input for a model trained as it says.
#pragma once

#include <memory>
#include <optional>
#include <vector>

#include "shardtrain/comm/mesh.h"
#include "shardtrain/config/config.h"
#include "shardtrain/strategy/estimate.h"
#include "shardtrain/strategy/options.h"

namespace torch::nn {
class Module;
}

namespace shardtrain::train {

/// The model one rank holds as the config trains it, for planning only:
/// built deferred (no weights are drawn or read), the config's LoRA
/// adapters attached as the trainer does (the family's default targets when
/// lora.target_modules is empty; the base frozen and quantized as
/// lora.quantize says), cut to the stages of the pipeline rank that holds
/// the most parameters under distributed.pipeline_parallel > 1, and split to
/// tensor-parallel rank 0's blocks under distributed.tensor_parallel > 1.
std::shared_ptr<torch::nn::Module> planning_model(const config::Config& config);

/// The memory estimator's input (strategy/estimate.h) for `model`, as one
/// rank holds it (planning_model, or the trainer's after its split), trained
/// as the config says at `world_size` ranks, `local_world_size` per node:
/// trainable parameters, the bytes of frozen ones, the data-parallel ranks
/// (world / (tensor_parallel x pipeline_parallel)) and one micro-batch's
/// activations on a tensor-parallel rank (1/tp under sequence parallelism;
/// without it the norms' and residual stream's share, 10 of Korthikanti et
/// al.'s 34, whole); a pipeline rank holds about one micro-batch's worth
/// (1/p of the layers for up to p in flight), under gpipe m/p of it.
strategy::EstimateInput estimate_input(const config::Config& config, torch::nn::Module& model,
                                       int world_size, int local_world_size);

/// The tensor-parallel degrees the config's model can take with
/// `local_world_size` ranks per host, ascending, 1 first: divisors of the
/// ranks per host that divide the family's head counts (and block_size
/// under sequence parallelism); {1} for a family without a plan, strategy
/// single, or a QLoRA base that checkpoints would have to hold.
std::vector<int> tensor_parallel_degrees(const config::Config& config, int local_world_size);

/// One rank's memory budget: distributed.memory_budget_mb, else MemAvailable / local ranks.
double memory_budget_bytes(const config::Config& config, int local_world_size);

/// The estimate of the config's strategy (auto: the one it picks) at its
/// tensor_parallel, or nothing when it does not fit `budget_bytes`.
std::optional<strategy::StrategyEstimate> estimate_strategy(const config::Config& config, int world_size,
                                                            int local_world_size, double budget_bytes);

/// distributed.tensor_parallel: auto (0) becomes the least degree of
/// tensor_parallel_degrees() at which the configured strategy (or, for
/// `auto`, any) fits the memory budget: data parallelism first, tensor
/// parallelism only when a rank cannot hold its share otherwise. ConfigError
/// when none fits. Call before make_task (shardtrain train does); a set
/// degree is left as it is.
void resolve_tensor_parallel(config::Config& config, int world_size, int local_world_size);

/// Bytes per activation element the estimate assumes: 2 under 16-bit
/// parameters or any mixed or 16-bit precision, else 4.
int activation_element_bytes(const config::Config& config);

/// The micro-batch the estimate assumes: batch.micro when given (so that
/// layouts the global batch does not divide into can still be estimated),
/// else the one the batch arithmetic derives for `world_size`.
int64_t estimate_micro_batch(const config::Config& config, int world_size);

/// The parameters of the model the config describes, counted from the
/// config alone (before anything is allocated), tied weights once. A double:
/// absurd sizes (n_embd 10^12) must be refused, not overflow.
double model_parameter_count(const config::ModelConfig& model);

/// Refuses, with a ConfigError naming the estimated bytes and the memory
/// available, a model this machine cannot build: the weights a rank holds
/// plus the activations of one micro-batch must fit in what one rank may use
/// (distributed.memory_budget_mb, else MemAvailable / `local_world_size`).
/// A model built from nothing is drawn whole in fp32 on every rank (4 bytes
/// per parameter); one read from files (model.init_from) costs a rank only
/// what its strategy keeps: 1/N under full_shard (or a strategy still "auto"),
/// 1/(ranks per node) under hybrid_shard, and a quantized LoRA base as codes
/// and scales.
/// A lower bound: a model that passes may still not fit once gradients and
/// optimizer state are added (`shardtrain estimate` shows those).
void check_model_fits(const config::Config& config, int world_size, int local_world_size);

/// The device mesh the config asks for on `world_size` ranks,
/// `local_world_size` per host: distributed.tensor_parallel innermost, the
/// rest data-parallel (hybrid_shard: within a host, replicated across).
/// ConfigError, before anything is built, for a tensor-parallel group that
/// would span hosts.
comm::MeshShape mesh_shape(const config::Config& config, int world_size, int local_world_size);

/// The strategy options the config's distributed section asks for; strategy
/// "auto" becomes the one choose_strategy() picks for the memory budget
/// (distributed.memory_budget_mb, or MemAvailable / local ranks). `model`
/// as one rank holds it; `world_size` and `local_world_size` the whole job's.
strategy::StrategyOptions strategy_options(const config::Config& config, torch::nn::Module& model,
                                           int world_size, int local_world_size);

}  // namespace shardtrain::train
