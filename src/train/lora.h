// LoRA in the trainer: adapting the task's model from the config's lora
// section, and writing the adapter at the end of a run. Internal to
// src/train; the library calls are models::apply_lora and models/lora_peft.h.
#pragma once

#include <string>

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
}

namespace shardtrain::train::detail {

/// With lora.r > 0: freezes the model and attaches the adapters (after the
/// base weights were loaded, before the strategy's setup), then loads
/// lora.init_from if set; a no-op otherwise. Every rank calls it alike.
/// Returns whether the model was adapted.
bool prepare_lora(torch::nn::Module& model, const config::Config& config);

/// Where a LoRA run writes its adapter: <run_dir>/adapter.
std::string adapter_dir(const std::string& run_dir);

/// With lora.r > 0: writes the adapter in the PEFT layout to
/// adapter_dir(run_dir), and the merged model over the exported
/// model.safetensors. Every rank calls it (the strategy gathers the
/// adapters to rank 0, which writes); CheckpointError on every rank when
/// writing fails.
void export_lora(strategy::Strategy& strategy, comm::Communicator& comm,
                 const config::Config& config, const std::string& run_dir);

}  // namespace shardtrain::train::detail
