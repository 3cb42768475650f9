// LoRA in the trainer: adapting the task's model from the config's lora
// section, and writing the adapter at the end of a run. Internal to
// src/train; the library calls are models::apply_lora and models/lora_peft.h.
#pragma once

#include <map>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

namespace torch::nn {
class Module;
}
namespace shardtrain::config {
struct Config;
}
namespace shardtrain::comm {
class Communicator;
}
namespace shardtrain::strategy {
class Strategy;
struct ShardedTensor;
}  // namespace shardtrain::strategy
namespace shardtrain::checkpoint {
class CheckpointReader;
}

namespace shardtrain::models {
struct LoraOptions;
}

namespace shardtrain::train::detail {

/// The lora section as options: lora.target_modules `[]` becomes the model
/// family's defaults, the seed is run.seed.
models::LoraOptions lora_options(const config::Config& config);

/// Loads model.init_from (a safetensors file or a Hugging Face directory)
/// into `model` with the family's names and layouts (deferred parameters get
/// readers of the files instead; core/deferred.h); a no-op when unset.
void load_init_weights(torch::nn::Module& model, const config::Config& config);

/// The identity of model.init_from (file or directory) as JSON {"path",
/// "bytes", "sha256"}: the digest of the file, or of a directory's
/// config.json, index and safetensors files in name order.
std::string base_identity(const std::string& path);

/// Writes the exported model of a run: run_dir/config.yaml, and
/// run_dir/model/ as a Hugging Face directory (config.json and
/// model.safetensors, or shards with an index past
/// checkpoint.export_max_shard_mb). A single file is also linked as
/// run_dir/model.safetensors. The weights are `state`, or with
/// `from_checkpoint` that complete checkpoint's, streamed tensor by tensor
/// into one file. Rank 0 only. Returns the path of the weights.
std::string write_exported_model(const std::string& run_dir, const config::Config& config,
                                 const std::vector<std::pair<std::string, at::Tensor>>& state,
                                 const std::string& from_checkpoint,
                                 const std::map<std::string, std::string>& metadata);

/// With lora.r > 0: freezes the model and attaches the adapters (after the
/// base weights were loaded, before the strategy's setup), then loads
/// lora.init_from if set; a no-op otherwise. Every rank calls it alike.
/// Returns whether the model was adapted. `quantize` false leaves a
/// quantized base (lora.quantize) to quantize_lora, after tensor
/// parallelism has split the layers. `stage_part`: the model is a pipeline
/// stage's part, and lora.init_from holds other stages' adapters too.
bool prepare_lora(torch::nn::Module& model, const config::Config& config, bool quantize = true,
                  bool stage_part = false);

/// With lora.r > 0 and lora.quantize set: quantizes the bases that
/// prepare_lora(..., false) left whole, each rank its own blocks.
void quantize_lora(torch::nn::Module& model, const config::Config& config);

/// The frozen base of an adapted model, as checkpoints see it.
struct FrozenBase {
  /// The parameters that do not train, in model order (empty without LoRA).
  std::vector<std::string> names;
  /// model.init_from as JSON {"path", "bytes", "sha256"}; "" when unset.
  std::string identity;
  /// Checkpoints leave the base out and record `identity` instead.
  bool referenced = false;
};

/// After prepare_lora, before the strategy's setup. Hashes model.init_from
/// when it is set (every rank reads the same file, so all agree).
FrozenBase frozen_base(const torch::nn::Module& model, const config::Config& config);

/// Removes the parameters named in `frozen` from `tensors` (what a checkpoint
/// that references its base neither writes nor reads).
void drop_frozen(const std::vector<std::string>& frozen, std::vector<strategy::ShardedTensor>& tensors);

/// The key of the base's identity in a Trainer checkpoint's training state.
inline constexpr const char* kBaseKey = "lora_base";

/// Before loading the checkpoint `reader` opened into `targets`: when it
/// holds none of `base.names` (it references its base), checks that the
/// base it records is the file `base.identity` describes and drops the
/// frozen targets, which already hold that base. CheckpointError when the
/// checkpoint records no base, or another one. A no-op for a checkpoint that
/// holds its base.
void drop_referenced_base(checkpoint::CheckpointReader& reader, const FrozenBase& base,
                          std::vector<strategy::ShardedTensor>& targets);

/// Where a LoRA run writes its adapter: <run_dir>/adapter.
std::string adapter_dir(const std::string& run_dir);

/// With lora.r > 0: writes the adapter in the PEFT layout to
/// adapter_dir(run_dir), and the merged model as the exported
/// model.safetensors with its config.yaml. Every rank calls it (the strategy
/// gathers the model to rank 0, which writes); CheckpointError on every rank
/// when writing fails.
void export_lora(strategy::Strategy& strategy, comm::Communicator& comm,
                 const config::Config& config, const std::string& run_dir);

}  // namespace shardtrain::train::detail
