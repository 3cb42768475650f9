// `shardtrain generate --checkpoint PATH --prompt TEXT --max-new-tokens N`:
// samples text from a GPT trained by `shardtrain train`.
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "commands.h"
#include "shardtrain/checkpoint/checkpoint.h"
#include "shardtrain/checkpoint/safetensors.h"
#include "shardtrain/config/config.h"
#include "shardtrain/core/error.h"
#include "shardtrain/models/gpt.h"
#include "shardtrain/train/task.h"

namespace shardtrain::cli {
namespace {

namespace fs = std::filesystem;
namespace ck = shardtrain::checkpoint;

const char kUsage[] =
    "usage: shardtrain generate --checkpoint PATH [--prompt TEXT] [--max-new-tokens N]\n"
    "                           [--temperature T] [--top-k K] [--seed S]\n"
    "\n"
    "PATH is a run directory (its model.safetensors with config.yaml beside it, or\n"
    "its newest complete checkpoint under checkpoints/ when that is newer), a\n"
    "checkpoint directory (RUN_DIR/checkpoints/step-000120) or a .safetensors file\n"
    "with config.yaml beside it.\n"
    "Defaults: prompt \"\\n\", 200 new tokens, temperature 0.8, top-k 40, seed 0.\n";

// The config a Trainer checkpoint records in its training state.
config::Config checkpoint_config(ck::CheckpointReader& reader) {
  std::string yaml;
  try {
    yaml = nlohmann::json::parse(reader.train_state()).at("config").get<std::string>();
  } catch (const nlohmann::json::exception&) {
    ST_CHECK(false, CheckpointError, "checkpoint '", reader.dir(),
             "' records no config (it was not written by the Trainer), so the model cannot be "
             "built. Hint: pass the run directory or its model.safetensors.");
  }
  return config::Config::parse(yaml, {}, reader.dir() + "/" + "train_state.bin");
}

std::shared_ptr<models::GPTImpl> build_gpt(const config::Config& config, const std::string& from) {
  ST_CHECK(config.model.type == train::ModelType::Gpt, ConfigError, "the model at '", from,
           "' is a '", enum_name(config.model.type), "' model; generate needs a gpt");
  return std::make_shared<models::GPTImpl>(train::gpt_config(config.model));
}

}  // namespace

std::shared_ptr<models::GPTImpl> load_gpt(const std::string& path, bool say_source) {
  const ck::ResolvedCheckpoint source =
      ck::resolve_checkpoint(path, ck::ResolveOptions().exported_model(true));
  if (say_source) std::fprintf(stderr, "generate: model from %s%s\n", source.path.c_str(),
               source.step >= 0 ? (" (step " + std::to_string(source.step) + ")").c_str() : "");
  if (source.kind == ck::ResolvedCheckpoint::Kind::ExportedModel) {
    const std::string config_path = ck::exported_config_path(fs::path(source.path).parent_path().string());
    ST_CHECK(fs::is_regular_file(config_path), CheckpointError, "'", source.path,
             "' has no config.yaml beside it (looked for '", config_path,
             "'), so the model cannot be built. Hint: pass the run directory `shardtrain train` "
             "printed.");
    auto model = build_gpt(config::Config::load(config_path), source.path);
    ck::load_safetensors_into(*model, source.path, ck::SafetensorsLoadOptions().transpose_conv1d(true));
    return model;
  }
  ck::CheckpointReader reader(source.path);
  const config::Config config = checkpoint_config(reader);
  auto model = build_gpt(config, source.path);
  train::load_trained_model(*model, config, reader);  // a LoRA run's adapters included
  return model;
}

int generate_main(int argc, char** argv) {
  std::string checkpoint, prompt = "\n";
  int64_t max_new_tokens = 200, top_k = 40;
  double temperature = 0.8;
  uint64_t seed = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    }
    ST_CHECK(i + 1 < argc, ConfigError, flag, " needs a value; see shardtrain generate --help");
    const std::string value = argv[++i];
    if (flag == "--checkpoint") checkpoint = value;
    else if (flag == "--prompt") prompt = value;
    else if (flag == "--max-new-tokens") max_new_tokens = std::atoll(value.c_str());
    else if (flag == "--temperature") temperature = std::atof(value.c_str());
    else if (flag == "--top-k") top_k = std::atoll(value.c_str());
    else if (flag == "--seed") seed = std::strtoull(value.c_str(), nullptr, 10);
    else ST_CHECK(false, ConfigError, "unknown option '", flag, "'; see shardtrain generate --help");
  }
  ST_CHECK(!checkpoint.empty(), ConfigError, "--checkpoint PATH is required");
  ST_CHECK(max_new_tokens >= 0, ConfigError, "--max-new-tokens must be >= 0");
  ST_CHECK(temperature > 0, ConfigError, "--temperature must be > 0");

  auto model = load_gpt(checkpoint, /*say_source=*/true);
  // Each byte of the prompt is a token id; one beyond the model's
  // vocabulary would reach LibTorch's embedding as an index error.
  const int64_t vocab = model->config().vocab_size;
  for (const char c : prompt) {
    const int byte = static_cast<unsigned char>(c);
    ST_CHECK(byte < vocab, ConfigError, "--prompt holds byte ", byte, " but the model's vocabulary has ",
             vocab, " tokens (bytes 0..", vocab - 1, "); use a prompt made of those bytes only");
  }
  std::printf("%s\n", sample_text(*model, prompt, max_new_tokens, seed, temperature, top_k).c_str());
  return 0;
}

}  // namespace shardtrain::cli
