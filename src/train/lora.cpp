// The trainer's LoRA set-up and adapter export, kept out of trainer.cpp.
#include "train/lora.h"

#include <torch/torch.h>

#include <filesystem>

#include "shardtrain/checkpoint/checkpoint.h"
#include "shardtrain/checkpoint/safetensors.h"
#include "shardtrain/comm/communicator.h"
#include "shardtrain/config/config.h"
#include "shardtrain/core/error.h"
#include "shardtrain/models/lora.h"
#include "shardtrain/models/lora_peft.h"
#include "shardtrain/strategy/strategy.h"

namespace shardtrain::train::detail {

namespace {

const char* peft_prefix(const config::Config& config) {
  return config.model.type == ModelType::Gpt ? models::kPeftGptPrefix : models::kPeftModelPrefix;
}

}  // namespace

bool prepare_lora(torch::nn::Module& model, const config::Config& config) {
  if (config.lora.r() == 0) {
    ST_CHECK(config.lora.init_from().empty(), ConfigError, "lora.init_from='",
             config.lora.init_from(), "' needs lora.r > 0; hint: set lora.r (and the other lora keys) "
             "to those of the adapter's adapter_config.json");
    return false;
  }
  models::LoraOptions options = config.lora;  // the section is the options struct
  options.seed(config.run.seed);
  models::apply_lora(model, options);
  if (!config.lora.init_from().empty()) {
    models::load_peft_adapter(model, config.lora.init_from(), peft_prefix(config));
  }
  return true;
}

std::string adapter_dir(const std::string& run_dir) {
  return (std::filesystem::path(run_dir) / "adapter").string();
}

void export_lora(strategy::Strategy& strategy, comm::Communicator& comm,
                 const config::Config& config, const std::string& run_dir) {
  if (config.lora.r() == 0) return;
  const auto state = strategy.full_state_dict();  // collective; the tensors on rank 0
  std::string failure;
  if (comm.rank() == 0) try {
      models::save_peft_adapter(adapter_dir(run_dir), state, config.lora, peft_prefix(config),
                                config.model.init_from);
      // The exported model is the merged one, so `shardtrain generate` and
      // model.init_from read it as a plain model.
      checkpoint::save_safetensors(checkpoint::exported_model_path(run_dir),
                                   models::merge_lora_state(state, config.lora),
                                   /*transpose_conv1d=*/config.model.type == ModelType::Gpt,
                                   {{"format", "pt"}, {"producer", "shardtrain"}, {"lora", "merged"}});
    } catch (const std::exception& e) {
      failure = e.what();
    }
  auto failed = torch::tensor({failure.empty() ? 0L : 1L}, torch::kLong);
  comm.broadcast(failed);
  ST_CHECK(failed.item<int64_t>() == 0, CheckpointError, "writing the LoRA adapter to '",
           adapter_dir(run_dir), "' failed",
           comm.rank() == 0 ? ": " + failure : std::string(" on rank 0 (see its error)"),
           ". Hint: check that run.dir is writable and the disk is not full");
}

}  // namespace shardtrain::train::detail
