// From the config to the strategy: the options its distributed section asks
// for, and the memory estimator's input for a model trained as it says.
#pragma once

#include "shardtrain/comm/mesh.h"
#include "shardtrain/config/config.h"
#include "shardtrain/strategy/estimate.h"
#include "shardtrain/strategy/options.h"

namespace torch::nn {
class Module;
}

namespace shardtrain::train {

/// Attaches the config's LoRA adapters to a freshly built model as the
/// trainer does (the family's default targets when lora.target_modules is
/// empty; the base frozen and quantized as lora.quantize says), so estimates
/// see the run's trainable and frozen parameters; nothing without lora.r.
void attach_lora(torch::nn::Module& model, const config::Config& config);

/// The memory estimator's input (strategy/estimate.h) for `model` trained
/// as the config says at `world_size` ranks, `local_world_size` per node
/// (trainable parameters, and the bytes of frozen ones).
strategy::EstimateInput estimate_input(const config::Config& config, torch::nn::Module& model,
                                       int world_size, int local_world_size);

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

/// The strategy options the config's distributed section asks for; strategy
/// "auto" becomes the one choose_strategy() picks for the memory budget
/// (distributed.memory_budget_mb, or MemAvailable / local ranks).
/// The device mesh the config asks for on `world_size` ranks,
/// `local_world_size` per host: distributed.tensor_parallel innermost, the
/// rest data-parallel (hybrid_shard: within a host, replicated across).
/// ConfigError, before anything is built, for a tensor-parallel group that
/// would span hosts.
comm::MeshShape mesh_shape(const config::Config& config, int world_size, int local_world_size);

strategy::StrategyOptions strategy_options(const config::Config& config, torch::nn::Module& model,
                                           int world_size, int local_world_size);

}  // namespace shardtrain::train
