// `shardtrain generate --checkpoint PATH --prompt TEXT --max-new-tokens N`:
// samples text from a language model trained by `shardtrain train` or from a
// Hugging Face model directory, through the model's tokenizer and, with
// --chat, its chat template.
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "core/json.h"
#include "commands.h"
#include "flags.h"
#include "shardtrain/checkpoint/checkpoint.h"
#include "shardtrain/checkpoint/safetensors.h"
#include "shardtrain/config/config.h"
#include "shardtrain/core/error.h"
#include "shardtrain/data/chat_template.h"
#include "shardtrain/data/tokenizer.h"
#include "shardtrain/models/causal_lm.h"
#include "shardtrain/models/family.h"
#include "shardtrain/models/hf_dir.h"
#include "shardtrain/train/plan.h"
#include "shardtrain/train/task.h"

namespace shardtrain::cli {
namespace {

namespace fs = std::filesystem;
namespace ck = shardtrain::checkpoint;

const char kGenerateUsage[] =
    "usage: shardtrain generate --checkpoint PATH [--prompt TEXT] [--max-new-tokens N]\n"
    "                           [--temperature T] [--top-k K] [--top-p P] [--seed S]\n"
    "                           [--stop ID[,ID...]] [--no-cache] [--tokenizer SPEC]\n"
    "                           [--chat [--system TEXT] [--chat-template NAME]]\n"
    "\n"
    "PATH is a run directory (its exported model with config.yaml beside it, or\n"
    "its newest complete checkpoint under checkpoints/ when that is newer), a\n"
    "checkpoint directory (RUN_DIR/checkpoints/step-000120), a Hugging Face model\n"
    "directory (config.json and safetensors weights) or a .safetensors file with\n"
    "config.yaml beside it.\n"
    "Defaults: prompt \"\\n\", 200 new tokens (at most 1048576), temperature 0.8\n"
    "(0, or anything below 1e-4: greedy), top-k 40 (0: all), top-p 1, seed 0,\n"
    "no stop token; generation keeps a key/value cache\n"
    "(one token's forward per new token); --no-cache runs the whole context each time.\n"
    "--tokenizer: bytes, auto or a path, as data.tokenizer (default: the run's own;\n"
    "a Hugging Face directory's own tokenizer.json or tokenizer.model).\n"
    "--chat: the prompt is a user message, rendered with the model's chat template\n"
    "(--chat-template llama3|chatml|qwen3|mistral|llama2, default: the run's\n"
    "data.chat_template, auto: recognised from tokenizer_config.json); generation\n"
    "stops at the end of the assistant's turn and only the reply is printed.\n";

// The most tokens one `generate` may ask for (8 MiB of ids).
constexpr int64_t kMaxNewTokens = int64_t{1} << 20;

int64_t parse_int(const std::string& flag, const std::string& value) {
  size_t used = 0;
  long long v = 0;
  try {
    v = std::stoll(value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  ST_CHECK(used == value.size() && !value.empty(), ConfigError, flag, " expects an integer, got '",
           value, "'; see shardtrain generate --help");
  return v;
}

double parse_double(const std::string& flag, const std::string& value) {
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  ST_CHECK(used == value.size() && !value.empty(), ConfigError, flag, " expects a number, got '",
           value, "'; see shardtrain generate --help");
  return v;
}

// The config a Trainer checkpoint records in its training state.
config::Config checkpoint_config(ck::CheckpointReader& reader) {
  std::string yaml;
  try {
    yaml = ::shardtrain::detail::parse_json_text(reader.train_state()).at("config").get<std::string>();
  } catch (const nlohmann::json::exception&) {
    ST_CHECK(false, CheckpointError, "checkpoint '", reader.dir(),
             "' records no config (it was not written by the Trainer), so the model cannot be "
             "built. Hint: pass the run directory or its model.safetensors.");
  }
  return config::Config::parse(yaml, {}, reader.dir() + "/" + "train_state.bin");
}

std::shared_ptr<models::CausalLMImpl> build_lm(const config::Config& config, const std::string& from) {
  // The fit check training runs, before a byte is allocated: a config.json
  // of 100,000 layers or a hidden size of 2^20 is a ConfigError here, not
  // the OOM killer. Generation holds the fp32 weights and one sequence's
  // activations (at most 4,096 positions of it are counted).
  config::Config fit = config;
  fit.batch.global = fit.batch.micro = fit.batch.accumulate = 1;
  fit.model.block_size = std::min<int64_t>(fit.model.block_size, 4096);
  fit.model.init_from.clear();  // weights held whole, in fp32
  fit.distributed.tensor_parallel(1);
  fit.distributed.pipeline_parallel(1);
  train::check_model_fits(fit, 1, 1);
  auto lm = std::dynamic_pointer_cast<models::CausalLMImpl>(
      models::family_of(config.model.type).build(config.model));
  ST_CHECK(lm != nullptr, ConfigError, "the model at '", from, "' is a '", enum_name(config.model.type),
           "' model; generate needs a language model");
  return lm;
}

// A Hugging Face directory's model, its architecture from its config.json.
LoadedModel load_hf(const std::string& dir) {
  config::Config config = config::Config::parse("model: {type: auto, block_size: 1}\ndata: {tokenizer: auto}\n",
                                                {"model.init_from=" + dir});
  config.model.block_size = std::max<int64_t>(1, config.model.max_position_embeddings);
  auto model = build_lm(config, dir);
  models::load_hf_weights(*model, std::make_shared<const models::HfWeights>(dir), models::family_of(config.model.type));
  return {model, config};
}

}  // namespace

LoadedModel load_model(const std::string& path, bool say_source) {
  if (models::is_hf_dir(path)) {  // its config.json says everything (a run's RUN_DIR/model too)
    if (say_source) std::fprintf(stderr, "generate: model from Hugging Face directory %s\n", path.c_str());
    return load_hf(path);
  }
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
    const config::Config config = config::Config::load(config_path);
    auto model = build_lm(config, source.path);
    models::load_hf_weights(*model, std::make_shared<const models::HfWeights>(source.path), models::family_of(config.model.type));
    return {model, config};
  }
  ck::CheckpointReader reader(source.path);
  const config::Config config = checkpoint_config(reader);
  auto model = build_lm(config, source.path);
  train::load_trained_model(*model, config, reader);  // a LoRA run's adapters included
  return {model, config};
}

std::shared_ptr<const data::Tokenizer> model_tokenizer(const config::Config& config) {
  return data::load_tokenizer(config.data.tokenizer, train::model_dir(config));
}

namespace {

// prompt ids (checked against the model) + up to max_new_tokens more, those
// the tokenizer knows.
std::vector<int32_t> continue_ids(models::CausalLMImpl& model, const std::vector<int32_t>& prompt,
                                  int64_t tokenizer_vocab, const models::GenerateOptions& options) {
  ST_CHECK(!prompt.empty(), ConfigError, "the prompt encodes to no tokens; give a non-empty --prompt");
  std::vector<int64_t> ids(prompt.begin(), prompt.end());
  for (const int64_t id : ids) {
    // An id beyond the model's vocabulary would reach LibTorch's embedding as an index error.
    ST_CHECK(id >= 0 && id < model.vocab_size(), ConfigError, "the prompt holds token ", id,
             " but the model's vocabulary has ", model.vocab_size(),
             " tokens; hint: use the model's own tokenizer (--tokenizer)");
  }
  const auto out = models::generate(model, torch::tensor(ids, torch::kLong).view({1, -1}), options);
  // A model's vocabulary may be padded past its tokenizer's (Qwen2's is);
  // ids the tokenizer cannot decode are left out of the text.
  std::vector<int32_t> kept;
  const auto* p = out.data_ptr<int64_t>();
  for (int64_t i = 0; i < out.numel(); ++i) {
    if (p[i] < tokenizer_vocab) kept.push_back(static_cast<int32_t>(p[i]));
  }
  return kept;
}

}  // namespace

std::string sample_text(models::CausalLMImpl& model, const data::Tokenizer& tokenizer,
                        const std::string& prompt, const models::GenerateOptions& options) {
  const std::vector<int32_t> ids =
      continue_ids(model, tokenizer.encode(prompt.empty() ? "\n" : prompt, /*add_special_tokens=*/true),
                   tokenizer.vocab_size(), options);
  return tokenizer.decode(ids, /*skip_special_tokens=*/true);
}

namespace {

// The assistant's reply to `user` (after `system` when given), rendered with
// the chat template; generation ends at the template's end of turn.
std::string chat_reply(models::CausalLMImpl& model, const data::Tokenizer& tokenizer,
                       data::ChatTemplateKind kind, const std::string& system, const std::string& user,
                       models::GenerateOptions options) {
  std::vector<data::Turn> turns;
  if (!system.empty()) turns.push_back({data::Role::System, system});
  turns.push_back({data::Role::User, user});
  const std::vector<int32_t> prompt = tokenizer.encode(data::render_generation_prompt(kind, turns));
  std::vector<int64_t> stop = options.stop_tokens();
  for (const auto id : {tokenizer.token_to_id(data::end_of_turn(kind)), tokenizer.eos_id()}) {
    if (id) stop.push_back(*id);
  }
  options.stop_tokens(stop);
  const std::vector<int32_t> ids = continue_ids(model, prompt, tokenizer.vocab_size(), options);
  return tokenizer.decode(std::vector<int32_t>(ids.begin() + static_cast<int64_t>(prompt.size()), ids.end()),
                          /*skip_special_tokens=*/true);
}

}  // namespace

int generate_main(int argc, char** argv) {
  std::string checkpoint, prompt = "\n", tokenizer_spec, system, chat_template;
  bool chat = false;
  models::GenerateOptions options;
  options.top_k(40);
  CLI::App app;
  setup_app(app);
  using Value = const std::string&;
  const auto number = [&app](const char* flag, std::function<void(Value)> apply) {
    app.add_option_function<std::string>(flag, std::move(apply));
  };
  add_text(app, "--checkpoint", checkpoint);
  add_text(app, "--prompt", prompt);
  add_text(app, "--tokenizer", tokenizer_spec);
  add_text(app, "--system", system);
  add_text(app, "--chat-template", chat_template);
  number("--max-new-tokens", [&](Value v) { options.max_new_tokens(parse_int("--max-new-tokens", v)); });
  number("--temperature", [&](Value v) { options.temperature(parse_double("--temperature", v)); });
  number("--top-k", [&](Value v) { options.top_k(parse_int("--top-k", v)); });
  number("--top-p", [&](Value v) { options.top_p(parse_double("--top-p", v)); });
  number("--seed", [&](Value v) { options.seed(static_cast<uint64_t>(parse_int("--seed", v))); });
  number("--stop", [&](Value v) {
    std::vector<int64_t> stop;
    std::stringstream list(v);
    for (std::string item; std::getline(list, item, ',');) stop.push_back(parse_int("--stop", item));
    options.stop_tokens(stop);
  });
  app.add_flag_callback("--no-cache", [&] { options.use_cache(false); });
  app.add_flag("--chat", chat);
  if (parse_flags(app, argc, argv, "generate", "unknown option")) {
    std::fputs(kGenerateUsage, stdout);
    return 0;
  }
  ST_CHECK(!checkpoint.empty(), ConfigError, "--checkpoint PATH is required");
  ST_CHECK(options.max_new_tokens() >= 0, ConfigError, "--max-new-tokens must be >= 0");
  // Every generated id is held until the end (and its text printed): 10^9 of
  // them ran for days and grew without bound. A million tokens is hours of
  // generation for any model this command runs; longer text is asked for in
  // pieces, each continuing the last (--prompt).
  ST_CHECK(options.max_new_tokens() <= kMaxNewTokens, ConfigError, "--max-new-tokens ",
           options.max_new_tokens(), " is more than ", kMaxNewTokens,
           " (every new token is held until the end); ask for at most that many and continue "
           "from the output with --prompt");
  ST_CHECK(options.temperature() >= 0, ConfigError, "--temperature must be >= 0 (0: greedy)");
  ST_CHECK(options.top_p() > 0 && options.top_p() <= 1, ConfigError, "--top-p must be in (0, 1]");

  ST_CHECK(chat || (system.empty() && chat_template.empty()), ConfigError,
           "--system and --chat-template need --chat; see shardtrain generate --help");

  LoadedModel loaded = load_model(checkpoint, /*say_source=*/true);
  if (!tokenizer_spec.empty()) loaded.config.data.tokenizer = tokenizer_spec;
  const auto tokenizer = model_tokenizer(loaded.config);
  if (!chat) {
    std::printf("%s\n", sample_text(*loaded.model, *tokenizer, prompt, options).c_str());
    return 0;
  }
  data::ChatTemplateKind kind = loaded.config.data.chat_template;
  if (!chat_template.empty()) kind = enum_from_name<data::ChatTemplateKind>(chat_template, "--chat-template");
  kind = data::resolve_chat_template(kind, train::model_dir(loaded.config));
  std::printf("%s\n", chat_reply(*loaded.model, *tokenizer, kind, system, prompt, options).c_str());
  return 0;
}

}  // namespace shardtrain::cli
