// Model families: everything the rest of shardtrain knows about one
// architecture, in one place.
//
// A family (gpt, llama, mlp) is one file pair under models/ plus one line in
// the registry (src/models/family.cpp). It says how its model is built from
// the config's model section, how its sizes are counted without building it
// (estimate, strategy auto), how its tensors are named and laid out in a
// Hugging Face directory, which layers LoRA adapts by default and under which
// PEFT prefix, and which module class is a wrap unit (a decoder layer).
// Nothing outside a family's own file and this registry tests a model type.
//
// Hugging Face directories: when model.init_from is a directory holding a
// config.json, resolve_model_config() reads that file once, as the config is
// read, and sets model.type (for `auto`) and every architecture key from it;
// block_size stays the config's (at most max_position_embeddings).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "shardtrain/train/choices.h"

namespace torch::nn {
class Module;
}
namespace shardtrain::config {
struct ModelConfig;
}

namespace shardtrain::models {

/// How a family splits over a tensor-parallel group (Megatron's layout), as
/// data: apply_tensor_parallel (parallel/tensor_parallel.h) reads it. Module
/// paths match when equal or ending in "." + the entry.
struct TensorParallelPlan {
  /// Linear layers split along their outputs (and biases with them); an
  /// entry's `parts` > 1 splits each of that many equal blocks of the output
  /// on its own (GPT's fused q|k|v, split per head within each third).
  std::vector<std::pair<std::string, int>> column;
  /// Linear layers split along their inputs: the partial products are
  /// summed over the group, then the bias is added once.
  std::vector<std::string> row;
  /// Modules whose forward is one region: column_input on the way in,
  /// row_parallel on the way out (models/tensor_parallel.h).
  std::vector<std::string> regions;
  /// The token embedding (vocabulary-parallel) and the untied head
  /// (column-parallel over the vocabulary); head "" when tied.
  std::string embedding;
  std::string head;
};

class ModelFamily {
 public:
  virtual ~ModelFamily() = default;

  /// model.type's value ("gpt").
  virtual train::ModelType type() const = 0;
  /// Checks the sizes; ConfigError naming the model.* key otherwise.
  virtual void validate(const config::ModelConfig& m) const = 0;
  /// A new model with the seed's initial weights (the caller seeds). With
  /// `deferred`, every parameter is deferred (core/deferred.h) as soon as its
  /// submodule is built, so the whole model's weights never exist at once:
  /// for a model whose weights come from files, read where they are kept.
  virtual std::shared_ptr<torch::nn::Module> build(const config::ModelConfig& m,
                                                   bool deferred = false) const = 0;

  // ---- sizes, from the config alone (nothing allocated) -------------------------------
  /// Parameters the model holds (tied weights once), in doubles so absurd
  /// configs do not overflow.
  virtual double num_parameters(const config::ModelConfig& m) const = 0;
  /// Activation bytes of one forward and backward of `micro_batch` samples at
  /// full context, with elements of `bytes_per_element`.
  virtual double activation_bytes(const config::ModelConfig& m, int64_t micro_batch,
                                  int bytes_per_element) const = 0;
  /// The config keys that decide the size, for messages ("model.n_layer=4, ...").
  virtual std::string size_text(const config::ModelConfig& m) const = 0;

  // ---- LoRA and Hugging Face names -------------------------------------------------------
  /// The layers LoRA adapts when lora.target_modules is left at its default.
  virtual std::vector<std::string> lora_targets() const = 0;
  /// Prefix of PEFT adapter tensor names before our parameter names.
  virtual std::string peft_prefix() const = 0;
  /// Whether the Hugging Face file stores this parameter transposed
  /// (GPT-2's Conv1D weights, [in, out]); false for nn.Linear layouts.
  virtual bool hf_transposed(const std::string& name) const { return false; }
  /// Whether the Hugging Face layout is GPT-2's Conv1D one: weights stored
  /// [in, out] (PEFT's fan_in_fan_out) and causal masks stored as buffers.
  virtual bool hf_conv1d() const { return false; }
  /// Whether the model is a causal language model (PEFT task_type CAUSAL_LM,
  /// sampled at the end of a run).
  virtual bool language_model() const { return true; }
  /// Whether a tensor a Hugging Face file holds is left unloaded rather than
  /// refused as unexpected: buffers the model computes itself (GPT-2's causal
  /// masks, older Llama files' rotary inv_freq) and a tied head's copy.
  virtual bool hf_skipped(const std::string& name) const { return false; }
  /// The config.json `model_type` values this family reads ("llama", ...).
  virtual std::vector<std::string> hf_model_types() const { return {}; }
  /// Sets the type-specific architecture keys of `m` from a config.json;
  /// ConfigError naming the key it cannot use.
  virtual void read_hf_config(const nlohmann::json& hf, config::ModelConfig& m) const {}
  /// The config.json of an exported Hugging Face directory; "" when the
  /// family has none (the model is exported as one safetensors file).
  virtual std::string hf_config_json(const config::ModelConfig& m) const { return ""; }
  /// The tensor-parallel plan; no regions: the family cannot be split.
  virtual TensorParallelPlan tensor_parallel_plan() const { return {}; }
  /// The sizes a tensor-parallel degree must divide, with their keys
  /// ({"model.n_head", 12}, ...): checked when the config is read.
  virtual std::vector<std::pair<std::string, int64_t>> tensor_parallel_divisors(
      const config::ModelConfig& m) const {
    return {};
  }
  /// What the family cannot run under yet, refused when the config is read
  /// ("tensor parallelism, ..."): with a non-empty answer, tensor or pipeline
  /// parallelism above 1 and LoRA are a ConfigError. "": all of them work.
  virtual std::string not_supported_yet() const { return ""; }
  /// Class name of a wrap unit (strategy/wrap.h's module_type policy).
  virtual std::string unit_type() const { return "BlockImpl"; }
};

/// The family of model.type (which must be resolved: not `auto`).
const ModelFamily& family_of(train::ModelType type);
/// Every registered family, for messages ("gpt, llama, mlp").
std::string family_names();

/// With model.init_from naming a Hugging Face directory (a config.json
/// inside): reads it and sets the model section's type and architecture.
/// model.type `auto` without such a directory, a config.json of a model_type
/// no family reads, or a type that contradicts it is a ConfigError naming the
/// supported ones.
void resolve_model_config(config::ModelConfig& m);

/// Whether `path` is a Hugging Face model directory (holds config.json).
bool is_hf_dir(const std::string& path);

}  // namespace shardtrain::models
