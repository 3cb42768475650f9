// The trainer's LoRA set-up and adapter export, kept out of trainer.cpp.
#include "train/lora.h"

#include <malloc.h>
#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>

#include "checkpoint/detail.h"
#include "core/file.h"
#include "shardtrain/checkpoint/checkpoint.h"
#include "shardtrain/checkpoint/safetensors.h"
#include "shardtrain/comm/communicator.h"
#include "shardtrain/config/config.h"
#include "shardtrain/core/error.h"
#include "shardtrain/models/lora.h"
#include "shardtrain/models/lora_peft.h"
#include "shardtrain/strategy/strategy.h"
#include "shardtrain/train/task.h"

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
  const bool quantized = options.quantize() != models::LoraQuantize::None;
  // Quantizing frees the full-precision base, layer by layer. A fixed mmap
  // threshold gives such large blocks back to the system when freed (glibc
  // would otherwise raise its threshold after the first and keep the rest on
  // the heap), and the trim returns what stayed, so training does not carry
  // the fp32 base's pages through its peak.
  if (quantized) mallopt(M_MMAP_THRESHOLD, 4 << 20);
  models::apply_lora(model, options);
  if (quantized) malloc_trim(0);
  if (!config.lora.init_from().empty()) {
    models::load_peft_adapter(model, config.lora.init_from(), peft_prefix(config));
  }
  return true;
}

FrozenBase frozen_base(const torch::nn::Module& model, const config::Config& config) {
  FrozenBase base;
  if (config.lora.r() == 0) return base;
  for (const auto& p : model.named_parameters()) {
    if (!p.value().requires_grad()) base.names.push_back(p.key());
  }
  const std::string& file = config.model.init_from;
  if (file.empty()) return base;  // a random base: only a copy can restore it
  std::string hex, why;
  long long bytes = 0;
  ST_CHECK(::shardtrain::detail::sha256_of_file(file, &hex, &bytes, &why), CheckpointError,
           "cannot read model.init_from '", file, "': ", why);
  base.identity =
      nlohmann::json{{"path", std::filesystem::absolute(file).string()}, {"bytes", bytes}, {"sha256", hex}}
          .dump();
  base.referenced = !config.checkpoint.save_frozen_base;
  return base;
}

void drop_referenced_base(checkpoint::CheckpointReader& reader, const FrozenBase& base,
                          std::vector<strategy::ShardedTensor>& targets) {
  const auto& md = reader.metadata();
  const bool holds_base = std::any_of(base.names.begin(), base.names.end(), [&](const std::string& n) {
    return md.find_tensor(n) != nullptr;
  });
  if (base.names.empty() || holds_base) return;
  nlohmann::json recorded;
  try {
    recorded = nlohmann::json::parse(reader.train_state()).at(kBaseKey);
    (void)recorded.at("sha256").get<std::string>();
    (void)recorded.at("bytes").get<int64_t>();
    (void)recorded.at("path").get<std::string>();
  } catch (const nlohmann::json::exception&) {
    ST_CHECK(false, CheckpointError, "checkpoint '", reader.dir(), "' holds none of the model's ",
             base.names.size(), " frozen tensors (", base.names.front(),
             ", ...) and records no base file to take them from. Hint: it was not written by a "
             "LoRA run of this model");
  }
  const std::string where = recorded["path"].get<std::string>();
  ST_CHECK(!base.identity.empty(), CheckpointError, "checkpoint '", reader.dir(),
           "' leaves its frozen LoRA base out and references '", where,
           "', but model.init_from is not set. Hint: set model.init_from to that file");
  const auto mine = nlohmann::json::parse(base.identity);
  ST_CHECK(mine["sha256"] == recorded["sha256"] && mine["bytes"] == recorded["bytes"], CheckpointError,
           "checkpoint '", reader.dir(), "' was trained on the frozen base '", where, "' (",
           recorded["bytes"].get<int64_t>(), " bytes, SHA-256 ", recorded["sha256"].get<std::string>().substr(0, 16),
           "...), but model.init_from '", mine["path"].get<std::string>(), "' is another file (",
           mine["bytes"].get<int64_t>(), " bytes, SHA-256 ", mine["sha256"].get<std::string>().substr(0, 16),
           "...). Hint: point model.init_from at the base the run started from; "
           "checkpoint.save_frozen_base: true writes checkpoints that carry their base");
  drop_frozen(base.names, targets);
}

void drop_frozen(const std::vector<std::string>& frozen, std::vector<strategy::ShardedTensor>& tensors) {
  const std::set<std::string> names(frozen.begin(), frozen.end());
  tensors.erase(std::remove_if(tensors.begin(), tensors.end(),
                               [&](const strategy::ShardedTensor& t) {
                                 return t.is_parameter && names.count(t.name) > 0;
                               }),
                tensors.end());
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
      std::filesystem::create_directories(run_dir);
      checkpoint::detail::write_file_atomically(checkpoint::exported_config_path(run_dir),
                                                config.to_yaml());
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

namespace shardtrain::train {

void load_trained_model(torch::nn::Module& model, const config::Config& config,
                        checkpoint::CheckpointReader& reader) {
  detail::FrozenBase base;
  if (config.lora.r() > 0) {
    bool referenced = false;
    std::string recorded_path;
    try {
      const auto state = nlohmann::json::parse(reader.train_state());
      if (state.contains(detail::kBaseKey)) {
        referenced = true;
        recorded_path = state[detail::kBaseKey].at("path").get<std::string>();
      }
    } catch (const nlohmann::json::exception&) {
      // A checkpoint that holds its base needs no training state here.
    }
    config::Config c = config;
    if (referenced) {
      // The base as the run started: model.init_from as the config gives it,
      // or where the run found it when that is relative to another directory.
      std::string& file = c.model.init_from;
      if (file.empty() || !std::filesystem::exists(file)) file = recorded_path;
      checkpoint::load_safetensors_into(model, file, checkpoint::SafetensorsLoadOptions().transpose_conv1d(true));
    }
    models::LoraOptions options = c.lora;
    models::apply_lora(model, options);
    if (referenced) base = detail::frozen_base(model, c);
  }
  std::vector<strategy::ShardedTensor> targets;
  for (const auto& p : model.named_parameters()) {
    targets.push_back({p.key(), p.value().sizes().vec(), 0, p.value().detach(), true, true});
  }
  for (const auto& b : model.named_buffers()) {
    targets.push_back({b.key(), b.value().sizes().vec(), 0, b.value().detach(), true, false});
  }
  detail::drop_referenced_base(reader, base, targets);
  torch::NoGradGuard no_grad;
  reader.read(targets);  // names and shapes checked first, one error listing them
}

}  // namespace shardtrain::train
