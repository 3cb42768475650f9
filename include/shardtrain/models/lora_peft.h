// LoRA adapters in the Hugging Face PEFT layout, and folding them into a base.
//
// A directory holds adapter_model.safetensors, whose tensors are named
// PREFIX + our parameter name (GPT: base_model.model.transformer.h.0.attn.
// c_attn.lora_A.weight), A as [r, in] and B as [out, r] as PEFT stores them,
// plus the biases when train_bias is all; and adapter_config.json with
// peft_type LORA, r, lora_alpha, lora_dropout, target_modules,
// fan_in_fan_out (true: the base stores GPT-2 Conv1D weights [in, out]),
// bias and task_type CAUSAL_LM. How the base was quantized while training
// (none, int8, nf4) is kept in the safetensors metadata, which PEFT ignores,
// so that a merge reproduces what was trained.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "shardtrain/models/lora.h"

namespace shardtrain::models {

class ModelFamily;

inline constexpr const char* kPeftAdapterFile = "adapter_model.safetensors";
inline constexpr const char* kPeftConfigFile = "adapter_config.json";
/// Prefix of a GPT's parameter names in a PEFT file (a GPT2LMHeadModel).
inline constexpr const char* kPeftGptPrefix = "base_model.model.transformer.";
/// Prefix for any other model.
inline constexpr const char* kPeftModelPrefix = "base_model.model.";

/// Writes the adapter tensors of `state` (named as named_parameters():
/// lora_A / lora_B weights, and biases with train_bias all) and the config
/// into `dir` (created), each file written aside and renamed into place.
/// `base_model` goes to base_model_name_or_path; the family gives the names'
/// prefix, fan_in_fan_out and task_type. CheckpointError on I/O errors.
void save_peft_adapter(const std::string& dir,
                       const std::vector<std::pair<std::string, at::Tensor>>& state,
                       const LoraOptions& options, const ModelFamily& family,
                       const std::string& base_model = "");

/// Copies the adapter in `dir` into `model` (already adapted by apply_lora
/// with matching options). CheckpointError naming the tensors when the file
/// has a tensor the model lacks, a shape differs (another r, another base
/// width), or an adapter of the model is missing from the file.
/// With `options`, the adapter_config.json's r and scale (lora_alpha / r, or
/// / sqrt(r) with use_rslora) must be those of the options. With
/// `stage_part`, the model is a pipeline stage's part: the file's adapters of
/// layers the model does not hold (other stages') are skipped.
void load_peft_adapter(torch::nn::Module& model, const std::string& dir, const std::string& prefix,
                       const LoraOptions* options = nullptr, bool stage_part = false);

/// The state of an adapted model with every quantized base (qweight,
/// qscale, ...) replaced by its dequantized `.weight` in the adapter's dtype, shaped by the
/// layer's adapter in the same state ([B rows, A columns]); everything else
/// unchanged, in order (a base takes its qweight's place).
std::vector<std::pair<std::string, at::Tensor>> dequantize_lora_bases(
    const std::vector<std::pair<std::string, at::Tensor>>& state);

/// The state of an adapted model (named as named_parameters()) with every
/// adapter folded into its layer's weight, W = base + (alpha / r) B A, the
/// base dequantized when it is stored quantized: the plain model's names
/// and shapes, without lora_* and quantization tensors. Other tensors pass
/// through unchanged.
std::vector<std::pair<std::string, at::Tensor>> merge_lora_state(
    const std::vector<std::pair<std::string, at::Tensor>>& state, const LoraOptions& options);

/// Folds the adapter in `adapter_dir` into the base safetensors file `base`
/// (Hugging Face GPT-2 names, with or without "transformer.") and writes
/// every base tensor under its own name to `out`: W += (alpha / r) B A
/// (transposed for fan_in_fan_out). When the adapter was trained on a
/// quantized base, the base weight is quantized and dequantized the same
/// way first. Returns the number of layers merged; CheckpointError when a
/// layer of the adapter has no base weight or shapes disagree.
int64_t merge_peft_adapter(const std::string& base, const std::string& adapter_dir,
                           const std::string& out);

}  // namespace shardtrain::models
