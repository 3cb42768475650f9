// The Llama family on its own: its config read from a Hugging Face
// config.json, its sizes, packed rows, the key/value cache, and Hugging Face
// directories written and read back. Parity with an independent
// implementation is tests/models/llama_parity.py.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <nlohmann/json.hpp>

#include "shardtrain/config/config.h"
#include "shardtrain/core/error.h"
#include "shardtrain/models/causal_lm.h"
#include "shardtrain/models/family.h"
#include "shardtrain/models/hf_dir.h"
#include "shardtrain/models/llama.h"
#include "shardtrain/models/lora.h"
#include "shardtrain/strategy/estimate.h"
#include "shardtrain/train/plan.h"
#include "temp_dir.h"
#include "test_helpers.h"

namespace st = shardtrain;
namespace m = shardtrain::models;
using st::config::ModelConfig;
using st::train::AttentionBias;
using st::train::ModelType;

namespace {

ModelConfig tiny(int64_t kv_heads = 2) {
  ModelConfig c;
  c.type = ModelType::Llama;
  c.n_layer = 2;
  c.n_head = 4;
  c.n_kv_head = kv_heads;
  c.n_embd = 32;
  c.intermediate_size = 48;
  c.block_size = 16;
  c.vocab_size = 64;
  return c;
}

std::shared_ptr<m::CausalLMImpl> build(const ModelConfig& c, uint64_t seed = 0) {
  torch::manual_seed(seed);
  return std::dynamic_pointer_cast<m::CausalLMImpl>(m::family_of(c.type).build(c));
}

std::vector<std::pair<std::string, at::Tensor>> state(torch::nn::Module& model) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& p : model.named_parameters()) out.emplace_back(p.key(), p.value().detach());
  return out;
}

// A Hugging Face directory of model `c` (random weights of `seed`).
void write_dir(const std::string& dir, const ModelConfig& c, int64_t max_shard_bytes = m::kDefaultMaxShardBytes,
               uint64_t seed = 0) {
  auto model = build(c, seed);
  const auto& family = m::family_of(c.type);
  m::save_hf_dir(dir, family.hf_config_json(c), state(*model), &family, max_shard_bytes);
}

nlohmann::json read_json(const std::string& path) {
  nlohmann::json j;
  std::ifstream(path) >> j;
  return j;
}

void write_json(const std::string& path, const nlohmann::json& j) { std::ofstream(path) << j.dump(2); }

std::string config_error(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const st::ConfigError& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a ConfigError";
  return {};
}

#undef EXPECT_HAS  // each test file defines its own (the unit tests build as one unity target)
#define EXPECT_HAS(text, part) EXPECT_NE((text).find(part), std::string::npos) << (text)

}  // namespace

TEST(LlamaFamily, AutoTakesTheArchitectureFromConfigJson) {
  st::testing::TempDir tmp("llama");
  ModelConfig c = tiny(1);
  c.attention_bias = AttentionBias::Qkv;
  c.hf_model_type = "qwen2";
  c.tie_word_embeddings = true;
  c.rope_theta = 1e6;
  c.max_position_embeddings = 128;
  write_dir(tmp / "qwen", c);
  const auto j = read_json(tmp / "qwen/config.json");
  EXPECT_EQ(j.at("model_type"), "qwen2");
  EXPECT_EQ(j.at("architectures")[0], "Qwen2ForCausalLM");
  EXPECT_EQ(j.at("num_key_value_heads"), 1);

  const auto cfg = st::config::Config::parse("model: {type: auto, block_size: 8}\n",
                                             {"model.init_from=" + tmp / "qwen"});
  EXPECT_EQ(cfg.model.type, ModelType::Llama);
  EXPECT_EQ(cfg.model.n_layer, 2);
  EXPECT_EQ(cfg.model.n_kv_head, 1);
  EXPECT_EQ(cfg.model.intermediate_size, 48);
  EXPECT_EQ(cfg.model.attention_bias, AttentionBias::Qkv);
  EXPECT_TRUE(cfg.model.tie_word_embeddings);
  EXPECT_DOUBLE_EQ(cfg.model.rope_theta, 1e6);
  EXPECT_EQ(cfg.model.block_size, 8);  // the training length stays the config's
  EXPECT_EQ(cfg.model.hf_model_type, "qwen2");
}

TEST(LlamaFamily, ConfigJsonErrorsNameTheKeyAndTheFamilies) {
  st::testing::TempDir tmp("llama");
  write_dir(tmp / "d", tiny());
  auto j = read_json(tmp / "d/config.json");
  const auto parse = [&](const nlohmann::json& edited, const std::string& extra = "") {
    write_json(tmp / "d/config.json", edited);
    return config_error([&] {
      st::config::Config::parse("model: {type: auto, block_size: 16" + extra + "}\n",
                                {"model.init_from=" + tmp / "d"});
    });
  };
  auto unknown = j;
  unknown["model_type"] = "gpt_neox";
  unknown["architectures"] = {"GPTNeoXForCausalLM"};
  const std::string msg = parse(unknown);
  EXPECT_HAS(msg, "gpt_neox");
  EXPECT_HAS(msg, "llama");
  auto window = j;
  window["model_type"] = "mistral";
  window["sliding_window"] = 8;
  EXPECT_HAS(parse(window), "sliding_window");
  auto short_context = j;
  short_context["max_position_embeddings"] = 8;
  EXPECT_HAS(parse(short_context), "max_position_embeddings");
  EXPECT_HAS(parse(j, ", type: gpt"), "model.type");
  // Values that would train NaN, and integers that are not (issue 47,
  // item 5): each refused when the config is read, naming its key.
  const auto refused = [&](const char* key, const nlohmann::json& value, const std::string& want) {
    auto edited = j;
    edited[key] = value;
    const std::string m = parse(edited);
    EXPECT_HAS(m, std::string("config.json: ") + key + " is " + want);
  };
  refused("rms_norm_eps", -1, "-1; expected a finite number > 0");
  refused("rms_norm_eps", 0, "0; expected a finite number > 0");
  refused("rope_theta", 0, "0; expected a finite number > 0");
  refused("num_hidden_layers", 2.9, "2.9; expected an integer >= 1");
  refused("hidden_size", 1e30, "1e+30; expected an integer >= 1");
  refused("vocab_size", "64", "\"64\"; expected an integer >= 1");
  refused("num_attention_heads", -4, "-4; expected an integer >= 1");
  auto rope = j;
  rope["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 4.0},
                          {"high_freq_factor", 1.0}, {"original_max_position_embeddings", 32}};
  EXPECT_HAS(parse(rope), "(> low_freq_factor)");
  // An integral float is an integer.
  auto integral = j;
  integral["num_hidden_layers"] = 2.0;
  write_json(tmp / "d/config.json", integral);
  EXPECT_EQ(st::config::Config::parse("model: {type: auto, block_size: 16}\n", {"model.init_from=" + tmp / "d"})
                .model.n_layer,
            2);
  // No config.json: `auto` has nothing to read.
  EXPECT_HAS(config_error([] { st::config::Config::parse("model: {type: auto}\n"); }), "auto");
}

// `generate` runs train's fit check before it builds a model (issue 47,
// item 5): 10^7 layers (356 GB of fp32 weights at this width) or hidden and
// intermediate sizes of 2^20 (trillions of parameters) are a ConfigError
// (exit 2) naming the sizes, not the OOM killer or a raw allocator error.
// The command runs under a 8 GiB address-space limit, so that without the
// check it fails fast instead of eating the machine.
TEST(LlamaFamily, GenerateRefusesAModelThatCannotFit) {
  st::testing::TempDir tmp("llama_fit");
  write_dir(tmp / "d", tiny());
  const auto j = read_json(tmp / "d/config.json");
  struct rlimit limit {};
  ASSERT_EQ(::getrlimit(RLIMIT_AS, &limit), 0);
  const struct rlimit capped {rlim_t{8} << 30, limit.rlim_max};
  ASSERT_EQ(::setrlimit(RLIMIT_AS, &capped), 0);
  for (const bool wide : {false, true}) {
    auto edited = j;
    if (wide) {
      edited["hidden_size"] = edited["intermediate_size"] = int64_t{1} << 20;
      edited["head_dim"] = 16;
    } else {
      edited["num_hidden_layers"] = 10000000;
    }
    write_json(tmp / "d/config.json", edited);
    const auto run = st::testing::cli("generate --checkpoint " + tmp / "d" + " --prompt ab --max-new-tokens 1");
    EXPECT_EQ(run.code, 2) << run.out;
    EXPECT_HAS(run.out, "the model cannot fit in memory");
    EXPECT_EQ(run.out.find("DefaultCPUAllocator"), std::string::npos) << run.out;
  }
  ::setrlimit(RLIMIT_AS, &limit);
}

// With model.init_from a Hugging Face directory, what the input left unset
// follows the directory: the family (model.type) and the tokenizer
// (data.tokenizer: auto); what it set stays, and is checked against it
// (issue 47, item 8). configs/default.yaml leaves both unset.
TEST(LlamaFamily, InitFromDecidesTheTypeAndTokenizerLeftUnset) {
  st::testing::TempDir tmp("llama_init");
  write_dir(tmp / "d", tiny());
  const std::string defaults = std::string(SHARDTRAIN_SOURCE_DIR) + "/configs/default.yaml";
  const auto cfg = st::config::Config::load(defaults, {"model.init_from=" + tmp / "d", "model.block_size=8"});
  EXPECT_EQ(cfg.model.type, ModelType::Llama);
  EXPECT_EQ(cfg.data.tokenizer, "auto");
  EXPECT_EQ(cfg.model.n_layer, 2);  // the directory's sizes, not the file's 4
  const auto bytes =
      st::config::Config::load(defaults, {"model.init_from=" + tmp / "d", "model.block_size=8", "data.tokenizer=bytes"});
  EXPECT_EQ(bytes.data.tokenizer, "bytes");
  EXPECT_HAS(config_error([&] {
               st::config::Config::load(defaults, {"model.init_from=" + tmp / "d", "model.block_size=8", "model.type=gpt"});
             }),
             "model.type is gpt but");
  // Without a directory nothing changes: a GPT on bytes.
  const auto plain = st::config::Config::load(defaults);
  EXPECT_EQ(plain.model.type, ModelType::Gpt);
  EXPECT_EQ(plain.data.tokenizer, "bytes");
}

TEST(LlamaFamily, NumParametersMatchesTheModel) {
  std::vector<ModelConfig> cases(4, tiny());
  cases[1].tie_word_embeddings = true;
  cases[2].attention_bias = AttentionBias::All;
  cases[2].mlp_bias = true;
  cases[3].head_dim = 12;
  cases[3].n_kv_head = 1;
  for (const auto& c : cases) {
    auto model = build(c);
    int64_t n = 0;
    for (const auto& p : model->parameters()) n += p.numel();
    EXPECT_EQ(m::family_of(c.type).num_parameters(c), static_cast<double>(n));
  }
}

// A packed row computes what its samples compute one by one: attention never
// crosses a segment and positions restart in each.
TEST(Llama, PackedRowsEqualTheirSamples) {
  auto model = build(tiny());
  model->eval();
  torch::NoGradGuard no_grad;
  const at::Tensor ids = torch::randint(0, 64, {1, 15});
  const std::vector<int64_t> lengths = {6, 1, 8};
  std::vector<int64_t> seg, pos;
  for (size_t s = 0; s < lengths.size(); ++s) {
    for (int64_t i = 0; i < lengths[s]; ++i) {
      seg.push_back(static_cast<int64_t>(s));
      pos.push_back(i);
    }
  }
  const at::Tensor packed = model->forward(ids, torch::tensor(pos).view({1, -1}), torch::tensor(seg).view({1, -1}));
  int64_t start = 0;
  for (const int64_t n : lengths) {
    const at::Tensor alone = model->forward(ids.slice(1, start, start + n));
    EXPECT_TRUE(torch::allclose(packed.slice(1, start, start + n), alone, 1e-5, 1e-6)) << "sample at " << start;
    start += n;
  }
}

TEST(Llama, CachedGenerationEqualsTheFullForward) {
  auto model = build(tiny());
  const at::Tensor prompt = torch::randint(0, 64, {1, 5});
  const auto greedy = m::GenerateOptions().max_new_tokens(9).temperature(0);
  const at::Tensor cached = m::generate(*model, prompt, greedy);
  const at::Tensor full = m::generate(*model, prompt, m::GenerateOptions(greedy).use_cache(false));
  ASSERT_EQ(cached.size(1), 14);
  EXPECT_TRUE(torch::equal(cached, full)) << cached << full;
  // A stop token ends generation and is kept.
  const int64_t stop = cached[0][7].item<int64_t>();
  const at::Tensor stopped = m::generate(*model, prompt, m::GenerateOptions(greedy).stop_tokens({stop}));
  int64_t first = 5;
  while (cached[0][first].item<int64_t>() != stop) ++first;
  EXPECT_EQ(stopped.size(1), first + 1);
  // Sampling: the same seed gives the same tokens; top_p 0 is greedy.
  const auto sample = m::GenerateOptions().max_new_tokens(9).temperature(1.0).seed(3);
  EXPECT_TRUE(torch::equal(m::generate(*model, prompt, sample), m::generate(*model, prompt, sample)));
  EXPECT_TRUE(torch::equal(m::generate(*model, prompt, m::GenerateOptions(sample).top_p(1e-9)), cached));
}

TEST(HfDir, ShardedExportReadsBackBitForBit) {
  st::testing::TempDir tmp("llama");
  ModelConfig c = tiny();
  c.attention_bias = AttentionBias::All;
  write_dir(tmp / "one", c);
  write_dir(tmp / "shards", c, 20000);
  EXPECT_TRUE(std::filesystem::exists(tmp / "one/model.safetensors"));
  const auto index = read_json(tmp / "shards/model.safetensors.index.json");
  std::set<std::string> files;
  for (const auto& [name, file] : index.at("weight_map").items()) files.insert(file.get<std::string>());
  ASSERT_GT(files.size(), 2u);
  EXPECT_EQ(*files.begin(), "model-00001-of-0000" + std::to_string(files.size()) + ".safetensors");
  for (const auto& f : files) {
    EXPECT_LE(std::filesystem::file_size(tmp / ("shards/" + f)), 20000u + 4096u) << f;
  }
  auto model = build(c);
  for (const std::string dir : {"one", "shards"}) {
    const auto source = std::make_shared<const m::HfWeights>(tmp / dir);
    const m::HfWeights& w = *source;
    for (const auto& [name, value] : state(*model)) {
      EXPECT_TRUE(torch::equal(w.read(name), value)) << dir << " " << name;
      const int64_t first = value.numel() / 3;
      EXPECT_TRUE(torch::equal(w.read_range(name, first, value.numel() / 2),
                               value.reshape(-1).slice(0, first, first + value.numel() / 2)))
          << name;
    }
    auto other = build(c, 99);
    m::load_hf_weights(*other, source, m::family_of(c.type));
    for (const auto& [name, value] : state(*other)) {
      EXPECT_TRUE(torch::equal(value, w.read(name))) << name;
    }
  }
}

// What older or other exporters add beside the weights loads: rotary
// inv_freq buffers and a tied model's lm_head copy are left unloaded.
TEST(HfDir, RotaryBuffersAndATiedHeadCopyAreSkipped) {
  st::testing::TempDir tmp("llama");
  ModelConfig c = tiny();
  c.tie_word_embeddings = true;
  auto model = build(c);
  auto tensors = state(*model);
  tensors.emplace_back("lm_head.weight", model->named_parameters()["model.embed_tokens.weight"].detach());
  tensors.emplace_back("model.layers.0.self_attn.rotary_emb.inv_freq", torch::ones({4}));
  const auto& family = m::family_of(c.type);
  m::save_hf_dir(tmp / "d", family.hf_config_json(c), tensors, &family, m::kDefaultMaxShardBytes);
  auto other = build(c, 7);
  m::load_hf_weights(*other, std::make_shared<const m::HfWeights>(tmp / "d"), family);
  for (const auto& [name, value] : state(*model)) {
    EXPECT_TRUE(torch::equal(other->named_parameters()[name], value)) << name;
  }
}

TEST(HfDir, MismatchesAreOneCheckpointErrorNamingTensorsAndFile) {
  st::testing::TempDir tmp("llama");
  const ModelConfig c = tiny();
  auto model = build(c);
  auto tensors = state(*model);
  const auto& family = m::family_of(c.type);
  // Missing, unexpected and mis-shaped tensors in one message.
  auto edited = tensors;
  edited.erase(edited.begin() + 1);
  edited.emplace_back("model.layers.9.mlp.up_proj.weight", torch::zeros({2}));
  for (auto& [name, t] : edited) {
    if (name == "model.norm.weight") t = torch::zeros({31});
  }
  m::save_hf_dir(tmp / "bad", family.hf_config_json(c), edited, &family, m::kDefaultMaxShardBytes);
  std::string msg = st::testing::checkpoint_error([&] { m::load_hf_weights(*model, std::make_shared<const m::HfWeights>(tmp / "bad"), family); });
  EXPECT_HAS(msg, tensors[1].first);
  EXPECT_HAS(msg, "model.layers.9.mlp.up_proj.weight");
  EXPECT_HAS(msg, "model.norm.weight");
  EXPECT_HAS(msg, "model.safetensors");
  // An integer tensor where a weight belongs.
  auto ints = tensors;
  ints[0].second = torch::zeros(ints[0].second.sizes(), torch::kInt64);
  m::save_hf_dir(tmp / "ints", "", ints, &family, m::kDefaultMaxShardBytes);
  msg = st::testing::checkpoint_error([&] { m::load_hf_weights(*model, std::make_shared<const m::HfWeights>(tmp / "ints"), family); });
  EXPECT_HAS(msg, tensors[0].first);
  // An index naming a shard that is not there.
  m::save_hf_dir(tmp / "shards", family.hf_config_json(c), tensors, &family, 20000);
  const auto index = read_json(tmp / "shards/model.safetensors.index.json");
  std::string second;
  for (const auto& [name, file] : index.at("weight_map").items()) {
    if (file.get<std::string>().rfind("model-00002-", 0) == 0) second = file.get<std::string>();
  }
  ASSERT_FALSE(second.empty());
  std::filesystem::remove(tmp / ("shards/" + second));
  msg = st::testing::checkpoint_error([&] { m::HfWeights w(tmp / "shards"); });
  EXPECT_HAS(msg, second);
}

// estimate and strategy auto see a LoRA run as it trains: Ψ is the adapters
// on Llama's seven projections; the int8 base is frozen bytes.
TEST(LlamaFamily, LoraEstimateCountsTheAdaptersAndTheFrozenBase) {
  st::config::Config config = st::config::Config::parse("model: {type: llama}\n");
  config.model = tiny();
  config.lora.r(4).quantize(m::LoraQuantize::Int8);
  const auto model = st::train::planning_model(config);
  const double base = m::family_of(config.model.type).num_parameters(config.model);
  const auto in = st::train::estimate_input(config, *model, 2, 2);
  // Per layer: q (32->32), k and v (32->16 each: 2 kv heads of 8), o (32->32),
  // gate and up (32->48), down (48->32); an adapter has r (in + out).
  const int64_t per_layer = 4 * ((32 + 32) + (32 + 16) * 2 + (32 + 32) + (32 + 48) * 2 + (48 + 32));
  EXPECT_EQ(in.num_params, 2 * per_layer);
  EXPECT_GT(in.frozen_bytes, 0);
  EXPECT_LT(static_cast<double>(in.frozen_bytes), 0.6 * 4.0 * base);  // int8 projections, fp32 rest
}

// tensor_parallel: auto chooses among the degrees a written value would be
// accepted at: those dividing the ranks per host, the heads and key/value
// heads, block_size under sequence parallelism; none for strategy single
// or a QLoRA base without its file (worked out by hand below).
TEST(LlamaFamily, TensorParallelDegreesAreThoseTheConfigAccepts) {
  // model: kv heads and block_size; distributed: the rest of its section.
  const auto degrees = [](int kv, int block, const std::string& distributed, int local,
                          const std::string& extra = "") {
    return st::train::tensor_parallel_degrees(
        st::config::Config::parse("model: {type: llama, n_layer: 2, n_head: 4, n_embd: 32, intermediate_size: 48, "
                                  "vocab_size: 64, n_kv_head: " + std::to_string(kv) + ", block_size: " +
                                  std::to_string(block) + "}\ndistributed: {tensor_parallel: auto, " + distributed +
                                  "}\n" + extra),
        local);
  };
  using V = std::vector<int>;
  EXPECT_EQ(degrees(2, 16, "strategy: ddp", 8), (V{1, 2}));
  EXPECT_EQ(degrees(2, 16, "strategy: ddp", 1), (V{1}));
  EXPECT_EQ(degrees(4, 16, "strategy: fsdp", 8), (V{1, 2, 4}));
  EXPECT_EQ(degrees(4, 16, "strategy: ddp", 6), (V{1, 2}));
  EXPECT_EQ(degrees(4, 6, "strategy: ddp", 4), (V{1, 2}));
  EXPECT_EQ(degrees(4, 6, "strategy: ddp, sequence_parallel: false", 4), (V{1, 2, 4}));
  EXPECT_EQ(degrees(4, 16, "strategy: single", 4), (V{1}));
  EXPECT_EQ(degrees(2, 16, "strategy: ddp", 8, "lora: {r: 4, quantize: nf4}\n"), (V{1}));
}

// Llama-3 rope scaling against the published rule, worked out by hand for
// head_dim 16, rope_theta 100, an original context of 64, low_freq_factor 1,
// high_freq_factor 4, factor 8 (issue 47, third pass). inv_i = 100^(-2i/16),
// wavelength_i = 2*pi / inv_i: 6.283, 11.17, 19.87, 35.33, 62.83, 111.7, 198.7,
// 353.3. Shorter than 64/4 = 16 is kept; longer than 64/1 = 64 is divided by
// 8; between (i = 2, 3, 4) smooth = (64/wavelength - 1) / (4 - 1) and the
// result is (1 - smooth) * inv / 8 + smooth * inv:
//   i=2: inv 0.316228, smooth (3.22109 - 1)/3 = 0.740357 -> 0.0821010 + 0.234121... = 0.244385
//   i=3: inv 0.177828, smooth (1.81134 - 1)/3 = 0.270447 -> 0.0162167 + 0.0480926   = 0.0643099
//   i=4: inv 0.1,      smooth (1.01859 - 1)/3 = 0.006197 -> 0.0124225 + 0.0006197   = 0.0130423
TEST(LlamaRope, Llama3ScalingMatchesThePublishedRuleInEveryBand) {
  ModelConfig mc = tiny();
  mc.n_embd = 64;
  mc.n_head = 4;
  mc.n_kv_head = 4;
  mc.rope_theta = 100.0;
  mc.rope_scaling = st::train::RopeScaling::Llama3;
  mc.rope_factor = 8.0;
  mc.rope_low_freq_factor = 1.0;
  mc.rope_high_freq_factor = 4.0;
  mc.rope_original_max_position = 64;
  const auto c = m::LlamaConfig::from(mc);
  ASSERT_EQ(c.head_dim, 16);
  const std::vector<double> expected = {
      1.0,                                   // kept (wavelength 6.28)
      0.56234132519034908,                   // kept: 100^(-1/8)
      0.24438459943539834,                   // blended
      0.064309872427727100,                  // blended
      0.013042256043820465,                  // blended
      0.0070292665648793640,                 // 100^(-5/8) / 8
      0.0039528470752104740,                 // 100^(-6/8) / 8
      0.0022228492625486537,                 // 100^(-7/8) / 8
  };
  const auto inv = m::rope_inverse_frequencies(c).to(at::kDouble);
  ASSERT_EQ(inv.numel(), 8);
  for (int64_t i = 0; i < 8; ++i) {
    EXPECT_NEAR(inv[i].item<double>(), expected[i], 1e-6 * expected[i]) << "frequency " << i;
  }
}

// A model with its own head (tie_word_embeddings false) cannot take it from
// a directory without lm_head.weight: refused, naming the tensor and the
// directory, rather than keeping a random head. Only a tied model may omit
// it (its head is the embedding).
TEST(HfDir, AnUntiedModelWithoutLmHeadIsRefused) {
  st::testing::TempDir tmp("llama");
  const auto& family = m::family_of(ModelType::Llama);
  ModelConfig c = tiny();
  auto model = build(c);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& [name, t] : state(*model)) {
    if (name != "lm_head.weight") tensors.emplace_back(name, t);
  }
  ASSERT_EQ(tensors.size() + 1, state(*model).size());
  m::save_hf_dir(tmp / "headless", family.hf_config_json(c), tensors, &family, m::kDefaultMaxShardBytes);
  auto other = build(c, 5);
  const std::string msg = st::testing::checkpoint_error(
      [&] { m::load_hf_weights(*other, std::make_shared<const m::HfWeights>(tmp / "headless"), family); });
  EXPECT_HAS(msg, "missing from the files (1): lm_head.weight");
  EXPECT_HAS(msg, tmp / "headless");
  // Refused before anything was copied.
  EXPECT_FALSE(torch::equal(other->named_parameters()["model.embed_tokens.weight"],
                            model->named_parameters()["model.embed_tokens.weight"]));
  // The same file is a whole tied model.
  c.tie_word_embeddings = true;
  auto tied = build(c, 5);
  m::load_hf_weights(*tied, std::make_shared<const m::HfWeights>(tmp / "headless"), family);
  EXPECT_TRUE(torch::equal(tied->named_parameters()["model.embed_tokens.weight"],
                           model->named_parameters()["model.embed_tokens.weight"]));
}

// estimate for a LoRA run, in bytes worked out by hand from the parameter
// counts of tiny() (fp32, no quantization, one rank, ddp): the frozen base
// is held once with no gradient and no optimizer state (4 bytes a
// parameter), the adapters as trained parameters (16 bytes: weight,
// gradient, Adam's two moments).
//   base: per layer q 32*32 + k 32*16 + v 32*16 + o 32*32 + gate, up 32*48
//   each + down 48*32 + two norms 2*32 = 3072 + 4608 + 64 = 7744; two
//   layers 15488, plus embed 64*32 = 2048, final norm 32, lm_head 32*64 =
//   2048: 19616.
//   adapters (r 4): 4 * (64 + 48 + 48 + 64 + 80 + 80 + 80) = 1856 a layer: 3712.
//   ddp: 16 * 3712 + 4 * 19616 = 59392 + 78464 = 137856 bytes.
TEST(LlamaFamily, LoraEstimateInBytesWorkedOutByHand) {
  st::config::Config config = st::config::Config::parse("model: {type: llama}\n");
  config.model = tiny();
  config.lora.r(4);
  const auto model = st::train::planning_model(config);
  const auto in = st::train::estimate_input(config, *model, 1, 1);
  EXPECT_EQ(in.num_params, 3712);
  EXPECT_EQ(in.frozen_bytes, 4 * 19616);
  int ddp = 0;
  for (const auto& e : st::strategy::estimate_all(in)) {
    if (e.strategy != "ddp") continue;
    EXPECT_EQ(e.model_state_bytes, 137856.0);
    ++ddp;
  }
  EXPECT_EQ(ddp, 1);
}
