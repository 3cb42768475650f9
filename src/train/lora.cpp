// The trainer's LoRA set-up and adapter export, kept out of trainer.cpp.
#include "train/lora.h"

#include <malloc.h>
#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>

#include "core/json.h"
#include "checkpoint/detail.h"
#include "core/file.h"
#include "shardtrain/checkpoint/checkpoint.h"
#include "shardtrain/checkpoint/safetensors.h"
#include "shardtrain/comm/communicator.h"
#include "shardtrain/config/config.h"
#include "shardtrain/data/tokenizer.h"
#include "shardtrain/core/error.h"
#include "shardtrain/models/family.h"
#include "shardtrain/models/hf_dir.h"
#include "shardtrain/models/lora.h"
#include "shardtrain/models/lora_peft.h"
#include "shardtrain/strategy/strategy.h"
#include "shardtrain/train/task.h"

namespace shardtrain::train::detail {

namespace {

namespace fs = std::filesystem;

std::string peft_prefix(const config::Config& config) {
  return models::family_of(config.model.type).peft_prefix();
}

// run_dir/model.safetensors, the path earlier tools read, as a hard link to
// the exported single file (made aside and renamed into place); a sharded
// export has no such file, so an earlier one of ours goes.
void link_exported_file(const std::string& run_dir, const std::string& written) {
  const std::string link = checkpoint::exported_model_path(run_dir);
  if (fs::path(written).filename() != "model.safetensors") {
    models::remove_own_export(link);
    return;
  }
  // A new name (a hard link or a copy is never made through a planted one).
  const std::string tmp = checkpoint::detail::temporary_name_beside(link);
  std::error_code ec;
  fs::create_hard_link(written, tmp, ec);
  if (ec) fs::copy_file(written, tmp, fs::copy_options::none);  // no links here
  fs::rename(tmp, link);
}

}  // namespace

models::LoraOptions lora_options(const config::Config& config) {
  models::LoraOptions options = config.lora;  // the section is the options struct
  if (options.target_modules().empty()) {
    options.target_modules(models::family_of(config.model.type).lora_targets());
  }
  return options.seed(config.run.seed);
}

void load_init_weights(torch::nn::Module& model, const config::Config& config) {
  if (config.model.init_from.empty()) return;
  models::load_hf_weights(model, std::make_shared<const models::HfWeights>(config.model.init_from),
                          models::family_of(config.model.type));
}

std::string base_identity(const std::string& path) {
  std::vector<std::string> files;
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    for (const auto& e : fs::directory_iterator(path, ec)) {
      const std::string name = e.path().filename().string();
      const bool weights = name == "config.json" || name == "model.safetensors.index.json" ||
                           e.path().extension() == ".safetensors";
      if (weights && e.is_regular_file(ec)) files.push_back(e.path().string());
    }
    std::sort(files.begin(), files.end());
  } else {
    files.push_back(path);
  }
  std::string hex, why;
  long long bytes = 0;
  ST_CHECK(::shardtrain::detail::sha256_of_files(files, &hex, &bytes, &why), CheckpointError,
           "cannot read model.init_from '", path, "': ", why);
  return nlohmann::json{{"path", fs::absolute(path).string()}, {"bytes", bytes}, {"sha256", hex}}.dump();
}

std::string write_exported_model(const std::string& run_dir, const config::Config& config,
                                 const std::vector<std::pair<std::string, at::Tensor>>& state,
                                 const std::string& from_checkpoint,
                                 const std::map<std::string, std::string>& metadata) {
  const models::ModelFamily& family = models::family_of(config.model.type);
  fs::create_directories(run_dir);
  checkpoint::detail::write_file_atomically(checkpoint::exported_config_path(run_dir), config.to_yaml());
  const std::string dir = checkpoint::exported_model_dir(run_dir);
  const std::string config_json = family.hf_config_json(config.model);
  std::string written;
  if (from_checkpoint.empty()) {
    const auto max_bytes = static_cast<int64_t>(config.checkpoint.export_max_shard_mb * 1e6);
    written = models::save_hf_dir(dir, config_json, state, &family, max_bytes, metadata);
  } else {
    fs::create_directories(dir);
    if (!config_json.empty()) {
      checkpoint::detail::write_file_atomically((fs::path(dir) / "config.json").string(), config_json);
    }
    written = (fs::path(dir) / "model.safetensors").string();
    checkpoint::consolidate_to_safetensors(from_checkpoint, written,
                                           /*transpose_conv1d=*/family.hf_conv1d());
    models::remove_own_export((fs::path(dir) / "model.safetensors.index.json").string());
  }
  // The tokenizer the run read ships with the model, as in any Hugging Face
  // model directory (so `data.tokenizer: auto` and `generate` find it there).
  if (!config_json.empty()) {
    for (const auto& file : data::tokenizer_files(config.data.tokenizer, model_dir(config))) {
      const fs::path to = fs::path(dir) / fs::path(file).filename();
      std::error_code ec;
      if (fs::exists(to, ec) && fs::equivalent(file, to, ec)) continue;
      std::string bytes, why;
      ST_CHECK(::shardtrain::detail::read_regular_file(file, int64_t{1} << 30, &bytes, &why), IoError,
               "cannot read the tokenizer file '", file, "' to export it: ", why);
      checkpoint::detail::write_file_atomically(to.string(), bytes);
    }
  }
  link_exported_file(run_dir, written);
  return written;
}

namespace {

// Quantizing frees the full-precision base, layer by layer. A fixed mmap
// threshold gives such large blocks back to the system when freed (glibc
// would otherwise raise its threshold after the first and keep the rest on
// the heap), and the trim returns what stayed, so training does not carry
// the fp32 base's pages through its peak.
template <class F>
void returning_freed_base(bool quantized, F&& f) {
  if (quantized) mallopt(M_MMAP_THRESHOLD, 4 << 20);
  f();
  if (quantized) malloc_trim(0);
}

}  // namespace

bool prepare_lora(torch::nn::Module& model, const config::Config& config, bool quantize, bool stage_part) {
  if (config.lora.r() == 0) {
    ST_CHECK(config.lora.init_from().empty(), ConfigError, "lora.init_from='",
             config.lora.init_from(), "' needs lora.r > 0; hint: set lora.r (and the other lora keys) "
             "to those of the adapter's adapter_config.json");
    return false;
  }
  models::LoraOptions options = lora_options(config);
  if (!quantize) options.quantize(models::LoraQuantize::None);
  returning_freed_base(options.quantize() != models::LoraQuantize::None, [&] { models::apply_lora(model, options); });
  if (!config.lora.init_from().empty()) {
    models::load_peft_adapter(model, config.lora.init_from(), peft_prefix(config), &options, stage_part);
  }
  return true;
}

void quantize_lora(torch::nn::Module& model, const config::Config& config) {
  if (config.lora.r() == 0 || config.lora.quantize() == models::LoraQuantize::None) return;
  returning_freed_base(true, [&] { models::quantize_lora_bases(model, lora_options(config)); });
}

FrozenBase frozen_base(const torch::nn::Module& model, const config::Config& config) {
  FrozenBase base;
  if (config.lora.r() == 0) return base;
  for (const auto& p : model.named_parameters()) {
    if (!p.value().requires_grad()) base.names.push_back(p.key());
  }
  const std::string& file = config.model.init_from;
  if (file.empty()) return base;  // a random base: only a copy can restore it
  base.identity = base_identity(file);
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
    recorded = ::shardtrain::detail::parse_json_text(reader.train_state()).at(kBaseKey);
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
      const models::LoraOptions options = lora_options(config);
      models::save_peft_adapter(adapter_dir(run_dir), state, options,
                                models::family_of(config.model.type), config.model.init_from);
      // The exported model is the merged one, so `shardtrain generate` and
      // model.init_from read it as a plain model.
      write_exported_model(run_dir, config, models::merge_lora_state(state, options), "",
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
      const auto state = ::shardtrain::detail::parse_json_text(reader.train_state());
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
      detail::load_init_weights(model, c);
    }
    models::apply_lora(model, detail::lora_options(c));
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
