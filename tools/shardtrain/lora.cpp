// `shardtrain lora merge`: folds a PEFT-layout LoRA adapter into its base.
#include <cstdio>
#include <cstring>
#include <string>

#include "commands.h"
#include "flags.h"
#include "shardtrain/core/error.h"
#include "shardtrain/models/lora_peft.h"

namespace shardtrain::cli {
namespace {

const char kLoraUsage[] =
    "usage: shardtrain lora merge --base BASE.safetensors --adapter DIR --out MERGED.safetensors\n"
    "\n"
    "merge  folds the adapter in DIR (adapter_model.safetensors and\n"
    "       adapter_config.json, as a LoRA run writes to RUN_DIR/adapter) into the\n"
    "       base model: W += (lora_alpha / r) B A for every adapted layer, with\n"
    "       Hugging Face GPT-2 Conv1D layout when fan_in_fan_out is true. A base\n"
    "       the adapter was trained on quantized (int8, nf4) is quantized and\n"
    "       dequantized the same way first. Every base tensor is written under\n"
    "       its own name; `shardtrain generate` reads the result.\n";

}  // namespace

int lora_main(int argc, char** argv) {
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
    std::fputs(kLoraUsage, argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  std::string action, base, adapter, out;
  CLI::App app;
  setup_app(app);
  app.add_option("action", action);
  add_text(app, "--base", base);
  add_text(app, "--adapter", adapter);
  add_text(app, "--out", out);
  if (parse_flags(app, argc, argv, "lora", "unknown option")) {
    std::fputs(kLoraUsage, stdout);
    return 0;
  }
  ST_CHECK(action == "merge", ConfigError, "unknown action '", action,
           "'; see shardtrain lora --help");
  ST_CHECK(!base.empty() && !adapter.empty() && !out.empty(), ConfigError,
           "shardtrain lora merge needs --base, --adapter and --out; see shardtrain lora --help");
  const int64_t layers = models::merge_peft_adapter(base, adapter, out);
  std::printf("merged %lld adapted layers of %s into %s -> %s\n", static_cast<long long>(layers),
              adapter.c_str(), base.c_str(), out.c_str());
  return 0;
}

}  // namespace shardtrain::cli
