// LoRA in the trainer: adapting the task's model from the config's lora
// section. Internal to src/train; the library call is models::apply_lora.
#pragma once

namespace torch::nn {
class Module;
}
namespace shardtrain::config {
struct Config;
}

namespace shardtrain::train::detail {

/// With lora.r > 0: freezes the model and attaches the adapters (after the
/// base weights were loaded, before the strategy's setup); a no-op otherwise.
/// Every rank calls it alike. Returns whether the model was adapted.
bool prepare_lora(torch::nn::Module& model, const config::Config& config);

}  // namespace shardtrain::train::detail
