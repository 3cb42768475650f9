// `shardtrain generate --checkpoint PATH --prompt TEXT --max-new-tokens N`:
// samples text from a GPT saved by `shardtrain train`.
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "commands.h"
#include "shardtrain/config/config.h"
#include "shardtrain/core/error.h"
#include "shardtrain/models/gpt.h"
#include "shardtrain/train/trainer.h"

namespace shardtrain::cli {
namespace {

namespace fs = std::filesystem;

const char kUsage[] =
    "usage: shardtrain generate --checkpoint PATH [--prompt TEXT] [--max-new-tokens N]\n"
    "                           [--temperature T] [--top-k K] [--seed S]\n"
    "\n"
    "PATH is a run directory or its checkpoint/ directory (model.pt + config.yaml).\n"
    "Defaults: prompt \"\\n\", 200 new tokens, temperature 0.8, top-k 40, seed 0.\n";

}  // namespace

std::shared_ptr<models::GPTImpl> load_gpt(const std::string& checkpoint) {
  fs::path dir(checkpoint);
  if (!fs::exists(dir / "model.pt") && fs::exists(dir / "checkpoint" / "model.pt")) dir /= "checkpoint";
  ST_CHECK(fs::exists(dir / "model.pt") && fs::exists(dir / "config.yaml"), CheckpointError,
           "no model checkpoint at '", checkpoint,
           "': expected model.pt and config.yaml there or in its checkpoint/ directory. Hint: pass "
           "the run directory `shardtrain train` printed.");
  const config::Config config = config::Config::load((dir / "config.yaml").string());
  ST_CHECK(config.model.type == train::ModelType::Gpt, ConfigError, "the checkpoint at '",
           dir.string(), "' holds a '", enum_name(config.model.type),
           "' model; generate needs a gpt");
  auto model = std::make_shared<models::GPTImpl>(train::gpt_config(config.model));
  try {
    torch::serialize::InputArchive archive;
    archive.load_from((dir / "model.pt").string());
    model->load(archive);
  } catch (const c10::Error& e) {
    const std::string msg = e.what();
    throw CheckpointError("cannot load '" + (dir / "model.pt").string() + "': " +
                          msg.substr(0, msg.find('\n')) +
                          ". Hint: the file is damaged or was written for another model config.");
  }
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

  auto model = load_gpt(checkpoint);
  std::printf("%s\n", sample_text(*model, prompt, max_new_tokens, seed, temperature, top_k).c_str());
  return 0;
}

}  // namespace shardtrain::cli
