// The closed sets of values the trainer chooses between, each with its one
// name table (core/enum_names.h). The names are the YAML config's values
// (docs/config.md); the strategy's own choices are in strategy/options.h and
// the precision's in precision/precision.h.
#pragma once

#include "shardtrain/core/enum_names.h"

namespace shardtrain::train {

/// The model family make_task() builds (models/family.h): GPT-2, the Llama
/// family (Llama, Mistral, Qwen2), the mixture-of-experts decoders Mixtral
/// and Qwen3-MoE, a small MLP, or `auto`: the family of the Hugging Face
/// directory model.init_from names (its config.json).
enum class ModelType { Gpt, Llama, Mixtral, Qwen3Moe, Mlp, Auto };
ST_ENUM_NAMES(ModelType, {ModelType::Gpt, "gpt"}, {ModelType::Llama, "llama"},
              {ModelType::Mixtral, "mixtral"}, {ModelType::Qwen3Moe, "qwen3_moe"},
              {ModelType::Mlp, "mlp"}, {ModelType::Auto, "auto"});

/// Which attention projections carry a bias (Llama family): none (Llama,
/// Mistral), q/k/v (Qwen2), or all four (Llama's attention_bias: true).
enum class AttentionBias { None, Qkv, All };
ST_ENUM_NAMES(AttentionBias, {AttentionBias::None, "none"}, {AttentionBias::Qkv, "qkv"},
              {AttentionBias::All, "all"});

/// Rotary-embedding frequency scaling (Llama family): none, or Llama-3's
/// piecewise scaling of the long wavelengths.
enum class RopeScaling { None, Llama3 };
ST_ENUM_NAMES(RopeScaling, {RopeScaling::None, "none"}, {RopeScaling::Llama3, "llama3"});

/// The optimizer built over the strategy's parameter shards.
enum class OptimizerKind { AdamW, Sgd };
ST_ENUM_NAMES(OptimizerKind, {OptimizerKind::AdamW, "adamw"}, {OptimizerKind::Sgd, "sgd"});

/// The learning rate's shape after the linear warmup: flat at lr, or
/// decaying from lr to min_lr at the last step.
enum class LrSchedule { Constant, Linear, Cosine };
ST_ENUM_NAMES(LrSchedule, {LrSchedule::Constant, "constant"}, {LrSchedule::Linear, "linear"},
              {LrSchedule::Cosine, "cosine"});

/// How rank 0 shows progress (ProgressCallback): Auto is a bar on a
/// terminal and plain lines otherwise.
enum class ProgressMode { Auto, Bar, Plain, None };
ST_ENUM_NAMES(ProgressMode, {ProgressMode::Auto, "auto"}, {ProgressMode::Bar, "bar"},
              {ProgressMode::Plain, "plain"}, {ProgressMode::None, "none"});

/// Whether a lower or a higher value of a monitored metric is better
/// (early stopping, the best checkpoint).
enum class MonitorMode { Min, Max };
ST_ENUM_NAMES(MonitorMode, {MonitorMode::Min, "min"}, {MonitorMode::Max, "max"});

/// How the global batch is split over the data-parallel ranks: equally, or
/// in proportion to each rank's measured compute speed (docs/strategies.md,
/// "Ranks of unequal speed").
enum class LoadBalance { Even, Measured };
ST_ENUM_NAMES(LoadBalance, {LoadBalance::Even, "even"}, {LoadBalance::Measured, "measured"});

}  // namespace shardtrain::train
