// The trainer's LoRA set-up, kept out of trainer.cpp.
#include "train/lora.h"

#include <torch/torch.h>

#include "shardtrain/config/config.h"
#include "shardtrain/models/lora.h"

namespace shardtrain::train::detail {

bool prepare_lora(torch::nn::Module& model, const config::Config& config) {
  if (config.lora.r() == 0) return false;
  models::LoraOptions options = config.lora;  // the section is the options struct
  options.seed(config.run.seed);
  models::apply_lora(model, options);
  return true;
}

}  // namespace shardtrain::train::detail
