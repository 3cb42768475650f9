// The families the registry (family.cpp) lists; each defined in its own file.
#pragma once

#include "shardtrain/models/family.h"

namespace shardtrain::models {

const ModelFamily& gpt_family();    // gpt.cpp
const ModelFamily& llama_family();  // llama.cpp
const ModelFamily& mixtral_family();    // mixtral.cpp
const ModelFamily& qwen3_moe_family();  // qwen3_moe.cpp
const ModelFamily& mlp_family();    // mlp.cpp

}  // namespace shardtrain::models
