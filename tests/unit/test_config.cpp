#include <gtest/gtest.h>

#include <chrono>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "shardtrain/config/config.h"
#include "shardtrain/config/schema.h"
#include "shardtrain/core/error.h"

using shardtrain::ConfigError;
using shardtrain::enum_choices;
using shardtrain::enum_name;
using shardtrain::config::BatchConfig;
using shardtrain::config::BatchPlan;
using shardtrain::config::Config;
using shardtrain::config::KeyDoc;
using shardtrain::config::key_docs;
using shardtrain::config::key_table;
using shardtrain::config::value_text;
using shardtrain::config::with_key_tables;
using shardtrain::precision::PrecisionKind;
using namespace shardtrain::strategy;  // StrategyKind, Sharding, DType, ...
using namespace shardtrain::train;     // ModelType, OptimizerKind, LrSchedule, ...

namespace {

const std::string kDefaultYaml = std::string(SHARDTRAIN_SOURCE_DIR) + "/configs/default.yaml";

// Every field, so a key that to_yaml() or parse() forgets shows up here.
void expect_same(const Config& a, const Config& b) {
  EXPECT_EQ(a.run.dir, b.run.dir);
  EXPECT_EQ(a.run.seed, b.run.seed);
  EXPECT_EQ(a.run.overwrite, b.run.overwrite);
  EXPECT_EQ(a.model.type, b.model.type);
  EXPECT_EQ(a.model.n_layer, b.model.n_layer);
  EXPECT_EQ(a.model.n_head, b.model.n_head);
  EXPECT_EQ(a.model.n_embd, b.model.n_embd);
  EXPECT_EQ(a.model.block_size, b.model.block_size);
  EXPECT_EQ(a.model.vocab_size, b.model.vocab_size);
  EXPECT_EQ(a.model.activation_checkpointing, b.model.activation_checkpointing);
  EXPECT_EQ(a.model.dropout, b.model.dropout);
  EXPECT_EQ(a.model.mlp_sizes, b.model.mlp_sizes);
  EXPECT_EQ(a.data.train, b.data.train);
  EXPECT_EQ(a.data.val_fraction, b.data.val_fraction);
  EXPECT_EQ(a.data.shuffle, b.data.shuffle);
  EXPECT_EQ(a.data.format, b.data.format);
  EXPECT_EQ(a.data.tokenizer, b.data.tokenizer);
  EXPECT_EQ(a.data.chat_template, b.data.chat_template);
  EXPECT_EQ(a.data.train_on_inputs, b.data.train_on_inputs);
  EXPECT_EQ(a.data.packing, b.data.packing);
  EXPECT_EQ(a.data.overlong, b.data.overlong);
  EXPECT_EQ(a.batch.global, b.batch.global);
  EXPECT_EQ(a.batch.micro, b.batch.micro);
  EXPECT_EQ(a.batch.accumulate, b.batch.accumulate);
  EXPECT_EQ(a.optimizer.name, b.optimizer.name);
  EXPECT_EQ(a.optimizer.lr, b.optimizer.lr);
  EXPECT_EQ(a.optimizer.weight_decay, b.optimizer.weight_decay);
  EXPECT_EQ(a.optimizer.betas, b.optimizer.betas);
  EXPECT_EQ(a.optimizer.eps, b.optimizer.eps);
  EXPECT_EQ(a.optimizer.momentum, b.optimizer.momentum);
  EXPECT_EQ(a.schedule.name, b.schedule.name);
  EXPECT_EQ(a.schedule.warmup_steps, b.schedule.warmup_steps);
  EXPECT_EQ(a.schedule.min_lr, b.schedule.min_lr);
  EXPECT_EQ(a.trainer.max_steps, b.trainer.max_steps);
  EXPECT_EQ(a.trainer.eval_every, b.trainer.eval_every);
  EXPECT_EQ(a.trainer.eval_batches, b.trainer.eval_batches);
  EXPECT_EQ(a.trainer.log_every, b.trainer.log_every);
  EXPECT_EQ(a.trainer.max_grad_norm, b.trainer.max_grad_norm);
  EXPECT_EQ(a.trainer.progress, b.trainer.progress);
  EXPECT_EQ(a.trainer.sample_tokens, b.trainer.sample_tokens);
  EXPECT_EQ(a.trainer.profile_step, b.trainer.profile_step);
  EXPECT_EQ(a.trainer.early_stopping.enabled, b.trainer.early_stopping.enabled);
  EXPECT_EQ(a.trainer.early_stopping.monitor, b.trainer.early_stopping.monitor);
  EXPECT_EQ(a.trainer.early_stopping.patience, b.trainer.early_stopping.patience);
  EXPECT_EQ(a.trainer.early_stopping.min_delta, b.trainer.early_stopping.min_delta);
  EXPECT_EQ(a.trainer.early_stopping.mode, b.trainer.early_stopping.mode);
  EXPECT_EQ(a.distributed.strategy(), b.distributed.strategy());
  EXPECT_EQ(a.distributed.nproc_per_node(), b.distributed.nproc_per_node());
  EXPECT_EQ(a.distributed.bucket_cap_mb(), b.distributed.bucket_cap_mb());
  EXPECT_EQ(a.distributed.first_bucket_mb(), b.distributed.first_bucket_mb());
  EXPECT_EQ(a.distributed.find_unused_parameters(), b.distributed.find_unused_parameters());
  EXPECT_EQ(a.distributed.threads_per_rank(), b.distributed.threads_per_rank());
  EXPECT_EQ(a.distributed.backend(), b.distributed.backend());
  EXPECT_EQ(a.distributed.reduce_dtype(), b.distributed.reduce_dtype());
  EXPECT_EQ(a.distributed.param_dtype(), b.distributed.param_dtype());
  EXPECT_EQ(a.distributed.sharding(), b.distributed.sharding());
  EXPECT_EQ(a.distributed.auto_wrap_policy(), b.distributed.auto_wrap_policy());
  EXPECT_EQ(a.distributed.wrap_module_types(), b.distributed.wrap_module_types());
  EXPECT_EQ(a.distributed.min_num_params(), b.distributed.min_num_params());
  EXPECT_EQ(a.distributed.backward_prefetch(), b.distributed.backward_prefetch());
  EXPECT_EQ(a.distributed.forward_prefetch(), b.distributed.forward_prefetch());
  EXPECT_EQ(a.distributed.limit_all_gathers(), b.distributed.limit_all_gathers());
  EXPECT_EQ(a.distributed.accumulation(), b.distributed.accumulation());
  EXPECT_EQ(a.distributed.memory_budget_mb(), b.distributed.memory_budget_mb());
  EXPECT_EQ(a.precision, b.precision);
  EXPECT_EQ(a.loss_scaler.initial_scale_power(), b.loss_scaler.initial_scale_power());
  EXPECT_EQ(a.loss_scaler.loss_scale_window(), b.loss_scaler.loss_scale_window());
  EXPECT_EQ(a.loss_scaler.hysteresis(), b.loss_scaler.hysteresis());
  EXPECT_EQ(a.loss_scaler.min_loss_scale(), b.loss_scaler.min_loss_scale());
  EXPECT_EQ(a.loss_scaler.max_skips_at_min(), b.loss_scaler.max_skips_at_min());
  EXPECT_EQ(a.model.init_from, b.model.init_from);
  EXPECT_EQ(a.checkpoint.every_n_steps, b.checkpoint.every_n_steps);
  EXPECT_EQ(a.checkpoint.every_n_minutes, b.checkpoint.every_n_minutes);
  EXPECT_EQ(a.checkpoint.keep, b.checkpoint.keep);
  EXPECT_EQ(a.checkpoint.monitor, b.checkpoint.monitor);
  EXPECT_EQ(a.checkpoint.mode, b.checkpoint.mode);
  EXPECT_EQ(a.checkpoint.resume, b.checkpoint.resume);
  EXPECT_EQ(a.checkpoint.save_on_signal, b.checkpoint.save_on_signal);
  EXPECT_EQ(a.checkpoint.save_frozen_base, b.checkpoint.save_frozen_base);
  EXPECT_EQ(a.to_yaml(), b.to_yaml());
}

// The message of the ConfigError that parse() throws; fails the test if none.
std::string parse_error(const std::string& yaml, const std::vector<std::string>& overrides = {},
                        const std::string& origin = "test.yaml") {
  try {
    Config::parse(yaml, overrides, origin);
  } catch (const ConfigError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no ConfigError for:\n" << yaml;
  return "";
}

std::string batch_error(const BatchConfig& batch, int world) {
  Config c;
  c.batch = batch;
  try {
    c.resolve_batch(world);
  } catch (const ConfigError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no ConfigError for world " << world;
  return "";
}

#undef EXPECT_HAS  // each test file defines its own (the unit tests build as one unity target)
#define EXPECT_HAS(msg, part) \
  EXPECT_NE((msg).find(part), std::string::npos) << "missing \"" << (part) << "\" in: " << (msg)

}  // namespace

// ---- defaults and round trips ---------------------------------------------------------

TEST(Config, EmptyYamlGivesTheStructDefaults) {
  expect_same(Config::parse(""), Config());
  expect_same(Config::parse("model: {}\ntrainer:\n"), Config());
}

TEST(Config, DefaultYamlLoadsAndMatchesTheStructDefaults) {
  // `shardtrain train` without a config file runs the built-in defaults and
  // says they are configs/default.yaml: every key must agree.
  const Config loaded = Config::load(kDefaultYaml);
  expect_same(loaded, Config());
  EXPECT_EQ(loaded.distributed.nproc_per_node(), 0);  // auto
}

TEST(Config, DefaultsRoundTripThroughYaml) {
  const Config c;
  expect_same(Config::parse(c.to_yaml()), c);
}

namespace {

// A Config with every key away from its default except
// trainer.early_stopping.enabled (which needs evaluations), and edge values
// where a key has them.
Config every_key_set() {
  Config c;
  c.run.dir = "runs/with space: and # chars";
  c.run.seed = 18446744073709551615ull;
  c.run.overwrite = true;
  c.model.type = ModelType::Mlp;
  c.model.n_layer = 7;
  c.model.n_head = 3;
  c.model.n_embd = 99;
  c.model.block_size = 17;
  c.model.vocab_size = 50257;
  c.model.activation_checkpointing = true;
  c.model.dropout = 0.25;
  c.model.mlp_sizes = {5, 1, 9, 2};
  c.model.n_kv_head = 3;
  c.model.head_dim = 12;
  c.model.intermediate_size = 77;
  c.model.rope_theta = 500000.0;
  c.model.rope_scaling = shardtrain::train::RopeScaling::Llama3;
  c.model.rope_factor = 32.0;
  c.model.rope_low_freq_factor = 2.0;
  c.model.rope_high_freq_factor = 8.0;
  c.model.rope_original_max_position = 4096;
  c.model.rms_norm_eps = 1e-6;
  c.model.tie_word_embeddings = true;
  c.model.attention_bias = shardtrain::train::AttentionBias::Qkv;
  c.model.mlp_bias = true;
  c.model.max_position_embeddings = 2048;
  c.model.hf_model_type = "qwen2";
  c.model.num_experts = 6;
  c.model.num_experts_per_tok = 3;
  c.model.norm_topk_prob = false;
  c.model.moe_intermediate_size = 40;
  c.model.decoder_sparse_step = 2;
  c.model.mlp_only_layers = {0, 5};
  c.model.router_aux_loss_coef = 0.02;
  c.model.output_router_logits = true;
  c.checkpoint.export_max_shard_mb = 100.0;
  c.data.train = "null";  // a string YAML would read as null unless quoted
  c.data.val_fraction = 0.0;
  c.data.shuffle = false;
  c.data.format = shardtrain::data::DataFormat::Jsonl;
  c.data.tokenizer = "models/tok dir: #1";
  c.data.chat_template = shardtrain::data::ChatTemplateKind::Qwen3;
  c.data.train_on_inputs = true;
  c.data.packing = true;
  c.data.overlong = shardtrain::data::Overlong::Drop;
  c.batch = {std::nullopt, 3, 5};
  c.optimizer.name = OptimizerKind::Sgd;
  c.optimizer.lr = 0.1 + 0.2;  // not a short decimal
  c.optimizer.weight_decay = 0.0;
  c.optimizer.betas = {0.0, 0.999999999};
  c.optimizer.eps = 1e-300;
  c.optimizer.momentum = 0.0;
  c.schedule.name = LrSchedule::Linear;
  c.schedule.warmup_steps = 0;
  c.schedule.min_lr = 0.0;
  c.trainer.max_steps = 3;
  c.trainer.eval_every = 0;
  c.trainer.eval_batches = 1;
  c.trainer.log_every = 9;
  c.trainer.max_grad_norm = 0.0;
  c.trainer.progress = ProgressMode::None;
  c.trainer.sample_tokens = 0;
  c.trainer.profile_step = 3;
  c.trainer.early_stopping.monitor = "train_loss";
  c.trainer.early_stopping.patience = 11;
  c.trainer.early_stopping.min_delta = 1e-3;
  c.trainer.early_stopping.mode = MonitorMode::Max;
  c.model.init_from = "weights/gpt2 small.safetensors";
  c.checkpoint.every_n_steps = 50;
  c.checkpoint.every_n_minutes = 12.5;
  c.checkpoint.keep = 0;
  c.checkpoint.monitor = "eval_loss";
  c.checkpoint.mode = MonitorMode::Max;
  c.checkpoint.resume = "auto";
  c.checkpoint.save_on_signal = false;
  c.checkpoint.save_frozen_base = true;
  c.distributed.strategy(StrategyKind::Fsdp);
  c.distributed.nproc_per_node(3);
  c.distributed.bucket_cap_mb(0.5);
  c.distributed.first_bucket_mb(100.0);
  c.distributed.find_unused_parameters(true);
  c.distributed.threads_per_rank(2);
  c.distributed.backend(shardtrain::comm::Backend::Mpi);
  c.distributed.reduce_dtype(DType::Bf16);
  c.distributed.param_dtype(DType::Fp16);
  c.distributed.sharding(Sharding::HybridShard);
  c.distributed.auto_wrap_policy(AutoWrapPolicy::Size);
  // Names YAML would misread unless quoted: a C++ path with "::", a "#", null.
  c.distributed.wrap_module_types({"shardtrain::models::BlockImpl", "My Block #2", "null"});
  c.distributed.min_num_params(12345);
  c.distributed.backward_prefetch(BackwardPrefetch::None);
  c.distributed.forward_prefetch(true);
  c.distributed.limit_all_gathers(5);
  c.distributed.accumulation(Accumulation::Unsharded);
  c.distributed.memory_budget_mb(1536.5);
  c.distributed.tensor_parallel(0).sequence_parallel(false).loss_parallel(false);  // auto
  c.distributed.pipeline_parallel(2)
      .pipeline_schedule(shardtrain::parallel::PipelineSchedule::Interleaved1F1B)
      .stages_per_rank(3)
      .pipeline_split({1, 2, 4, 5, 6});
  c.distributed.load_balance(shardtrain::train::LoadBalance::Measured)
      .rebalance_every(7)
      .rebalance_gain(0.125)
      .straggler_factor(2.5)
      .shares({2, 1.5});
  c.precision = PrecisionKind::Bf16Mixed;
  c.loss_scaler.initial_scale_power(12)
      .loss_scale_window(50)
      .hysteresis(3)
      .min_loss_scale(0.5)
      .max_skips_at_min(7);
  c.lora.r(4).alpha(0.5).dropout(0.25).target_modules({"c_attn", "my layer #1"});
  c.lora.quantize(shardtrain::models::LoraQuantize::Nf4).double_quant(true);
  c.lora.train_bias(shardtrain::models::LoraBias::All);
  c.lora.init_from("runs/a b/adapter");
  return c;
}

}  // namespace

TEST(Config, EveryKeyRoundTrips) {
  const Config c = every_key_set();
  const Config back = Config::parse(c.to_yaml());
  expect_same(back, c);
  // Integers-valued doubles are written as floats; auto is written as auto.
  EXPECT_HAS(c.to_yaml(), "first_bucket_mb: 100.0\n");
  EXPECT_HAS(Config().to_yaml(), "nproc_per_node: auto\n");
  EXPECT_HAS(Config().to_yaml(), "accumulate: null\n");
  EXPECT_HAS(Config().to_yaml(), "wrap_module_types: [BlockImpl]\n");
  EXPECT_HAS(Config().to_yaml(), "memory_budget_mb: 0.0\n");
}

TEST(Config, ShardingKeysDefaults) {
  const Config c = Config::parse("");
  const auto& d = c.distributed;
  EXPECT_EQ(d.strategy(), StrategyKind::Ddp);
  EXPECT_EQ(d.sharding(), Sharding::FullShard);
  EXPECT_EQ(d.param_dtype(), DType::Auto);
  EXPECT_EQ(d.auto_wrap_policy(), AutoWrapPolicy::ModuleType);
  EXPECT_EQ(d.wrap_module_types(), (std::vector<std::string>{"BlockImpl"}));
  EXPECT_EQ(d.min_num_params(), 1048576);
  EXPECT_EQ(d.backward_prefetch(), BackwardPrefetch::BackwardPre);
  EXPECT_FALSE(d.forward_prefetch());
  EXPECT_EQ(d.limit_all_gathers(), 2);
  EXPECT_EQ(d.accumulation(), Accumulation::Sharded);
  EXPECT_EQ(d.memory_budget_mb(), 0.0);
}

TEST(Config, EveryStrategyAndShardingIsAccepted) {
  for (const std::string s : {"single", "ddp", "zero1", "fsdp", "auto"}) {
    EXPECT_EQ(enum_name(Config::parse("distributed: {strategy: " + s + "}\n").distributed.strategy()), s);
  }
  for (const std::string s : {"full_shard", "shard_grad_op", "no_shard", "hybrid_shard"}) {
    EXPECT_EQ(enum_name(Config::parse("", {"distributed.sharding=" + s}).distributed.sharding()), s);
  }
  // single still runs one process; the new strategies may have many ranks.
  EXPECT_HAS(parse_error("distributed: {strategy: single, nproc_per_node: 4}"),
             "distributed.nproc_per_node: got 4");
  EXPECT_EQ(Config::parse("distributed: {strategy: fsdp, nproc_per_node: 4}")
                .distributed.nproc_per_node(),
            4);
}

TEST(Config, WrapModuleTypesIsAStringList) {
  const Config c = Config::parse(R"(
distributed:
  auto_wrap_policy: module_type
  wrap_module_types:
    - BlockImpl
    - "shardtrain::models::MLPBlockImpl"
    - 42
)");
  EXPECT_EQ(c.distributed.wrap_module_types(),
            (std::vector<std::string>{"BlockImpl", "shardtrain::models::MLPBlockImpl", "42"}));
  const Config listed = Config::parse("", {"distributed.wrap_module_types=[A, B]"});
  EXPECT_EQ(listed.distributed.wrap_module_types(), (std::vector<std::string>{"A", "B"}));
  // An empty list is fine where the list is not used.
  const Config none = Config::parse("distributed: {auto_wrap_policy: none, wrap_module_types: []}");
  EXPECT_TRUE(none.distributed.wrap_module_types().empty());
  expect_same(Config::parse(none.to_yaml()), none);
}

TEST(Config, SectionKeysAreRead) {
  const Config c = Config::parse(R"(
run: {dir: out, seed: 7}
model: {type: gpt, n_layer: 2, n_head: 2, n_embd: 64, block_size: 32, vocab_size: 100,
        activation_checkpointing: true, mlp_sizes: [2, 3]}
data: {train: x.bin, val_fraction: 0.5, shuffle: no}
batch: {global: 64, micro: null, accumulate: 2}
optimizer: {name: sgd, lr: 1e-2, weight_decay: 0, betas: [0.8, 0.9], eps: 1e-6, momentum: 0.5}
schedule: {name: constant, warmup_steps: 5, min_lr: 0}
trainer:
  max_steps: 10
  eval_every: 5
  eval_batches: 2
  log_every: 3
  max_grad_norm: 0.5
  progress: plain
  sample_tokens: 16
  early_stopping: {enabled: true, monitor: eval_loss, patience: 2, min_delta: 0.01, mode: min}
distributed: {strategy: ddp, nproc_per_node: 3, bucket_cap_mb: 4, first_bucket_mb: 0.25,
              find_unused_parameters: true, threads_per_rank: 1}
precision: fp32
)");
  EXPECT_EQ(c.run.dir, "out");
  EXPECT_EQ(c.run.seed, 7u);
  EXPECT_EQ(c.model.n_embd, 64);
  EXPECT_TRUE(c.model.activation_checkpointing);
  EXPECT_EQ(c.model.mlp_sizes, (std::vector<int64_t>{2, 3}));
  EXPECT_FALSE(c.data.shuffle);
  EXPECT_EQ(c.batch.global, 64);
  EXPECT_FALSE(c.batch.micro.has_value());
  EXPECT_EQ(c.batch.accumulate, 2);
  EXPECT_EQ(c.optimizer.lr, 1e-2);
  EXPECT_EQ(c.optimizer.weight_decay, 0.0);
  EXPECT_EQ(c.optimizer.betas, (std::vector<double>{0.8, 0.9}));
  EXPECT_EQ(c.schedule.name, LrSchedule::Constant);
  EXPECT_EQ(c.trainer.early_stopping.min_delta, 0.01);
  EXPECT_TRUE(c.trainer.early_stopping.enabled);
  EXPECT_EQ(c.distributed.nproc_per_node(), 3);
  EXPECT_EQ(c.distributed.first_bucket_mb(), 0.25);
  expect_same(Config::parse(c.to_yaml()), c);
}

// Every declared key, found through the key table: a key added there without
// a value here, or that to_yaml() or parse() loses, fails this test.
TEST(Config, EveryDeclaredKeyRoundTripsThroughYaml) {
  Config c = every_key_set();
  c.trainer.early_stopping.enabled = true;
  c.trainer.eval_every = 7;
  c.data.val_fraction = 0.25;
  const Config defaults;
  const std::vector<KeyDoc> keys = key_docs();
  ASSERT_GT(keys.size(), 60u);
  const Config back = Config::parse(c.to_yaml());
  for (const KeyDoc& k : keys) {
    EXPECT_NE(value_text(c, k.path), value_text(defaults, k.path))
        << k.path << ": give it a value other than its default in every_key_set()";
    EXPECT_EQ(value_text(back, k.path), value_text(c, k.path)) << k.path;
    EXPECT_EQ(k.default_value, value_text(defaults, k.path)) << k.path;
    EXPECT_FALSE(k.doc.empty()) << k.path << " has no doc";
    // Each key read on its own, as an override, gives the same value.
    if (k.path.rfind("batch.", 0) != 0 && k.path.rfind("trainer.early_stopping.enabled", 0) != 0) {
      const std::string text = k.path + "=" + value_text(c, k.path);
      try {
        EXPECT_EQ(value_text(Config::parse("", {text}), k.path), value_text(c, k.path)) << text;
      } catch (const ConfigError& e) {
        // A value that contradicts another key's default is refused, naming it.
        EXPECT_HAS(std::string(e.what()), k.path);
      }
    }
  }
  EXPECT_THROW(value_text(c, "optimizer.lrr"), ConfigError);
}

// docs/config.md's key tables are generated from the key table; after a
// change to the declarations, run `shardtrain config --docs docs/config.md`
// (or build the target config-docs).
TEST(ConfigDocs, KeyTablesMatchTheDeclarations) {
  const std::string path = std::string(SHARDTRAIN_SOURCE_DIR) + "/docs/config.md";
  std::ifstream in(path);
  ASSERT_TRUE(in) << path;
  std::stringstream text;
  text << in.rdbuf();
  const std::string docs = text.str();
  EXPECT_EQ(with_key_tables(docs), docs)
      << "docs/config.md's key tables differ from src/config/schema.cpp; run `shardtrain config "
         "--docs docs/config.md` or build the target config-docs";
  // Every key is in some table.
  for (const KeyDoc& k : key_docs()) {
    const size_t dot = k.path.rfind('.');
    const std::string section = dot == std::string::npos ? k.path : k.path.substr(0, dot);
    EXPECT_HAS(docs, "<!-- keys:" + section + " -->\n");
    EXPECT_HAS(docs, "| `" + k.path + "` |");
  }
}

TEST(ConfigDocs, TablesAreReplacedBetweenMarkers) {
  const std::string stale =
      "intro\n<!-- keys:run -->\n| old |\n<!-- /keys -->\nprose\n<!-- keys:precision -->\n"
      "<!-- /keys -->";
  const std::string fresh = with_key_tables(stale);
  EXPECT_EQ(fresh, "intro\n<!-- keys:run -->\n" + key_table("run") + "<!-- /keys -->\nprose\n" +
                       "<!-- keys:precision -->\n" + key_table("precision") + "<!-- /keys -->");
  EXPECT_EQ(with_key_tables(fresh), fresh);
  EXPECT_HAS(key_table("trainer"), "| `trainer.max_steps` | int | `600` | ≥ 1 |");
  EXPECT_EQ(key_table("trainer").find("early_stopping"), std::string::npos);
  EXPECT_HAS(key_table("distributed"),
             "| `distributed.sharding` | string | `full_shard` | `full_shard`, `shard_grad_op`, "
             "`no_shard`, `hybrid_shard` |");
  EXPECT_THROW(with_key_tables("<!-- keys:nosuch -->\n<!-- /keys -->\n"), ConfigError);
  EXPECT_THROW(with_key_tables("<!-- keys:run -->\n| a |\n"), ConfigError);
}

// ---- overrides -------------------------------------------------------------------------

TEST(ConfigOverrides, ScalarListNullAndNested) {
  const Config c = Config::parse("optimizer: {lr: 1.0e-3}\n",
                                 {"optimizer.lr=0.01", "optimizer.betas=[0.9,0.99]",
                                  "batch.accumulate=2", "batch.global=null",
                                  "trainer.early_stopping.patience=9", "run.dir=runs/x",
                                  "distributed.nproc_per_node=auto", "model={n_layer: 1}"});
  EXPECT_EQ(c.optimizer.lr, 0.01);
  EXPECT_EQ(c.optimizer.betas, (std::vector<double>{0.9, 0.99}));
  EXPECT_FALSE(c.batch.global.has_value());
  EXPECT_EQ(c.batch.accumulate, 2);
  EXPECT_EQ(c.trainer.early_stopping.patience, 9);
  EXPECT_EQ(c.run.dir, "runs/x");
  EXPECT_EQ(c.distributed.nproc_per_node(), 0);
  EXPECT_EQ(c.model.n_layer, 1);
  EXPECT_EQ(c.model.n_embd, Config().model.n_embd);
}

TEST(ConfigOverrides, LaterOverridesWinAndCreateMissingSections) {
  const Config c = Config::parse("", {"trainer.max_steps=5", "trainer.max_steps=6"});
  EXPECT_EQ(c.trainer.max_steps, 6);
}

TEST(ConfigOverrides, UnknownKeyIsAnErrorWithASuggestion) {
  const std::string msg = parse_error("", {"optimizer.lrr=0.1"});
  EXPECT_HAS(msg, "optimizer.lrr");
  EXPECT_HAS(msg, "did you mean 'lr'?");
  EXPECT_HAS(msg, "--set 'optimizer.lrr=0.1'");
  const std::string below = parse_error("", {"optimizer.lr.x=1"});
  EXPECT_HAS(below, "optimizer.lr is a value, not a section");
}

TEST(ConfigOverrides, MalformedOverridesShowTheSyntax) {
  for (const std::string bad : {"optimizer.lr", "=3", "optimizer..lr=3", ".lr=1"}) {
    const std::string msg = parse_error("", {bad});
    EXPECT_HAS(msg, "malformed override");
    EXPECT_HAS(msg, "KEY=VALUE");
  }
  const std::string msg = parse_error("", {"optimizer.betas=[0.9,"});
  EXPECT_HAS(msg, "optimizer.betas");
  EXPECT_HAS(msg, "not valid YAML");
}

TEST(ConfigOverrides, BadValueNamesTheOverrideAsOrigin) {
  const std::string msg = parse_error("", {"optimizer.lr=fast"});
  EXPECT_HAS(msg, "optimizer.lr");
  EXPECT_HAS(msg, "'fast'");
  EXPECT_HAS(msg, "--set 'optimizer.lr=fast' (on test.yaml)");
}

// ---- errors ----------------------------------------------------------------------------

TEST(ConfigErrors, UnknownTopLevelKey) {
  const std::string msg = parse_error("modle:\n  n_layer: 2\n");
  EXPECT_HAS(msg, "test.yaml:1");
  EXPECT_HAS(msg, "modle");
  EXPECT_HAS(msg, "unknown key");
  EXPECT_HAS(msg, "did you mean 'model'?");
  // A key that belongs in a section points there.
  EXPECT_HAS(parse_error("lr: 0.1\n"), "did you mean 'optimizer.lr'?");
}

TEST(ConfigErrors, UnknownNestedKey) {
  const std::string msg = parse_error("model:\n  n_layer: 2\n  n_embed: 64\n");
  EXPECT_HAS(msg, "test.yaml:3");
  EXPECT_HAS(msg, "model.n_embed");
  EXPECT_HAS(msg, "did you mean 'n_embd'?");
  const std::string deep = parse_error("trainer:\n  early_stopping:\n    patients: 3\n");
  EXPECT_HAS(deep, "trainer.early_stopping.patients");
  EXPECT_HAS(deep, "did you mean 'patience'?");
  // Nothing close: no suggestion, but the list of keys.
  const std::string far = parse_error("data:\n  zzzzzzzz: 1\n");
  EXPECT_HAS(far, "data.zzzzzzzz");
  EXPECT_EQ(far.find("did you mean"), std::string::npos) << far;
  EXPECT_HAS(far, "train, val_fraction, shuffle");
}

TEST(ConfigErrors, WrongTypes) {
  struct Case {
    std::string yaml, path, value;
  };
  const std::vector<Case> cases = {
      {"optimizer:\n  lr: fast\n", "optimizer.lr", "'fast'"},
      {"model:\n  n_layer: 2.5\n", "model.n_layer", "'2.5'"},
      {"optimizer:\n  betas: 0.9\n", "optimizer.betas", "'0.9'"},
      {"optimizer:\n  betas: [0.9, x]\n", "optimizer.betas", "[0.9, x]"},
      {"data:\n  shuffle: maybe\n", "data.shuffle", "'maybe'"},
      {"run:\n  seed: -1\n", "run.seed", "'-1'"},
      {"batch:\n  micro: [8]\n", "batch.micro", "[8]"},
      {"distributed:\n  nproc_per_node: many\n", "distributed.nproc_per_node", "'many'"},
      {"model: 5\n", "model", "'5'"},
      {"model:\n  type: {a: 1}\n", "model.type", "{a: 1}"},
      {"optimizer:\n  lr:\n", "optimizer.lr", "null"},
      {"distributed:\n  wrap_module_types: BlockImpl\n", "distributed.wrap_module_types",
       "'BlockImpl'"},
      {"distributed:\n  wrap_module_types: [a, [b]]\n", "distributed.wrap_module_types",
       "[a, [b]]"},
      {"distributed:\n  min_num_params: 1.5e6\n", "distributed.min_num_params", "'1.5e6'"},
      {"distributed:\n  forward_prefetch: soon\n", "distributed.forward_prefetch", "'soon'"},
      {"distributed:\n  memory_budget_mb: lots\n", "distributed.memory_budget_mb", "'lots'"},
  };
  for (const Case& c : cases) {
    const std::string msg = parse_error(c.yaml);
    EXPECT_HAS(msg, c.path + ": got " + c.value);
    EXPECT_HAS(msg, "expected");
    EXPECT_HAS(msg, "test.yaml:");
  }
}

// Ten aliases nested nine deep: 500 bytes that expand to 10^9 values. The
// duplicate-key walk once expanded them all (minutes); the document is now
// refused after a bounded walk (issue 28, item 11).
TEST(ConfigErrors, AliasBombIsRefusedQuickly) {
  std::string yaml = "a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n";
  for (int i = 1; i < 9; ++i) {
    yaml += "a" + std::to_string(i) + ": &a" + std::to_string(i) + " [";
    for (int j = 0; j < 10; ++j) yaml += (j ? ", *a" : "*a") + std::to_string(i - 1);
    yaml += "]\n";
  }
  const auto start = std::chrono::steady_clock::now();
  const std::string msg = parse_error(yaml);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_HAS(msg, "expands to more than 100000 values");
  EXPECT_LT(seconds, 5.0) << msg;
  // An alias or two, as people write them, still loads.
  EXPECT_NO_THROW(Config::parse("optimizer: {lr: &lr 0.001}\nschedule: {min_lr: *lr}\n", {}, "test.yaml"));
}

// A key with a least value states the range it really accepts, for a value
// of the wrong type as for one out of range (issue 28, item 14).
TEST(ConfigErrors, IntegerKeysStateTheRangeTheyAccept) {
  for (const char* v : {"abc", "1e30", "99999999999999999999", "-5", "0"}) {
    const std::string msg = parse_error(std::string("trainer: {max_steps: ") + v + "}");
    EXPECT_HAS(msg, "trainer.max_steps: got ");
    EXPECT_HAS(msg, "expected an integer in [1, 2^63)");
    EXPECT_EQ(msg.find("-2^63"), std::string::npos) << msg;
  }
}

TEST(ConfigErrors, OutOfRange) {
  struct Case {
    std::string yaml, path, expected;
  };
  const std::vector<Case> cases = {
      {"model: {n_layer: -1}", "model.n_layer: got -1", "an integer in [1, 2^63)"},
      {"model: {n_head: 3}", "model.n_embd: got 128", "a multiple of model.n_head=3"},
      {"model: {type: rnn}", "model.type: got 'rnn'", "one of: gpt, llama, mixtral, qwen3_moe, mlp, auto"},
      {"model: {mlp_sizes: [4]}", "model.mlp_sizes: got [4]", "at least two"},
      {"data: {val_fraction: 1.0}", "data.val_fraction: got 1.0", "[0, 1)"},
      {"data: {val_fraction: -0.1}", "data.val_fraction: got -0.1", "[0, 1)"},
      {"optimizer: {lr: 0}", "optimizer.lr: got 0.0", "> 0"},
      {"optimizer: {betas: [0.9]}", "optimizer.betas: got [0.9]", "two numbers"},
      {"optimizer: {betas: [0.9, 1.5]}", "optimizer.betas: got [0.9, 1.5]", "[0, 1)"},
      {"optimizer: {name: adam}", "optimizer.name: got 'adam'", "one of: adamw, sgd"},
      {"schedule: {min_lr: 1.0}", "schedule.min_lr: got 1.0", "<= optimizer.lr"},
      {"schedule: {warmup_steps: -2}", "schedule.warmup_steps: got -2", "an integer in [0, 2^63)"},
      {"trainer: {progress: fancy}", "trainer.progress: got 'fancy'", "auto, bar, plain, none"},
      {"trainer: {eval_every: 0, early_stopping: {enabled: true}}",
       "trainer.early_stopping.enabled: got true", "trainer.eval_every > 0"},
      {"distributed: {strategy: zero3}", "distributed.strategy: got 'zero3'",
       "one of: single, ddp, zero1, fsdp, auto"},
      {"distributed: {sharding: zero2}", "distributed.sharding: got 'zero2'",
       "one of: full_shard, shard_grad_op, no_shard, hybrid_shard"},
      {"distributed: {strategy: ddp, param_dtype: bf16}", "needs zero1 or fsdp"},
      {"checkpoint: {mode: lowest}", "checkpoint.mode: got 'lowest'", "one of: min, max"},
      {"checkpoint: {every_n_minutes: -1}", "checkpoint.every_n_minutes: got -1"},
      {"distributed: {param_dtype: fp64}", "distributed.param_dtype: got 'fp64'",
       "one of: auto, fp32, bf16, fp16"},
      {"distributed: {auto_wrap_policy: transformer}",
       "distributed.auto_wrap_policy: got 'transformer'", "one of: module_type, size, none"},
      {"distributed: {wrap_module_types: []}", "distributed.wrap_module_types: got []",
       "auto_wrap_policy none"},
      {"distributed: {wrap_module_types: [BlockImpl, '']}",
       "distributed.wrap_module_types: got [BlockImpl, \"\"]", "non-empty"},
      {"distributed: {min_num_params: 0}", "distributed.min_num_params: got 0", "an integer in [1, 2^63)"},
      {"distributed: {backward_prefetch: early}", "distributed.backward_prefetch: got 'early'",
       "one of: backward_pre, backward_post, none"},
      {"distributed: {limit_all_gathers: 0}", "distributed.limit_all_gathers: got 0", "an integer in [1, 2^63)"},
      {"distributed: {accumulation: lazy}", "distributed.accumulation: got 'lazy'",
       "one of: sharded, unsharded"},
      {"distributed: {memory_budget_mb: -1}", "distributed.memory_budget_mb: got -1.0", ">= 0"},
      {"distributed: {strategy: single, nproc_per_node: 2}",
       "distributed.nproc_per_node: got 2", "strategy=single"},
      {"distributed: {bucket_cap_mb: 0}", "distributed.bucket_cap_mb: got 0.0", "> 0"},
      {"batch: {global: 0}", "batch.global: got 0", ">= 1"},
      {"batch: {global: null, accumulate: null}", "batch: got {global: null, micro: 16",
       "at least two"},
      {"batch: {global: 30, micro: 8}", "batch.global: got 30", "a multiple of batch.micro=8"},
      {"batch: {global: 30, micro: 5, accumulate: 4}", "batch.global: got 30",
       "batch.micro × batch.accumulate = 5 × 4 = 20"},
  };
  for (const Case& c : cases) {
    const std::string msg = parse_error(c.yaml);
    EXPECT_HAS(msg, c.path);
    EXPECT_HAS(msg, c.expected);
    EXPECT_HAS(msg, "test.yaml:1");
  }
  // A cross-key check on a key left at its default names the key that was set.
  EXPECT_HAS(parse_error("\n\nmodel:\n  n_head: 3\n"), "test.yaml:4");
}

// Pipeline layouts the model cannot hold are refused when the config is read.
TEST(ConfigErrors, PipelineLayoutsThatCannotCut) {
  const std::string llama = "model: {type: llama, n_layer: 2, n_head: 4, n_embd: 64}\n";
  // Two layers make 4 units (embedding, layers, head): at most 4 stages.
  EXPECT_HAS(parse_error(llama + "distributed: {pipeline_parallel: 5}"),
             "at most model.n_layer + 2 = 4 stages (the embedding, each layer and the head), here 5");
  EXPECT_HAS(parse_error(llama + "distributed: {pipeline_parallel: 2, pipeline_schedule: interleaved_1f1b, "
                                 "stages_per_rank: 3}"),
             "here 6");
  EXPECT_NO_THROW(Config::parse(llama + "distributed: {pipeline_parallel: 2, pipeline_schedule: "
                                        "interleaved_1f1b, stages_per_rank: 2}"));
  // The split names the first layer of each stage after the first.
  EXPECT_HAS(parse_error(llama + "distributed: {pipeline_parallel: 2, pipeline_split: [1, 2]}"),
             "1 entries (the first layer of each of the 2 stages after the first)");
  EXPECT_HAS(parse_error(llama + "distributed: {pipeline_parallel: 2, pipeline_split: [2]}"),
             "layer indices below model.n_layer=2");
  EXPECT_HAS(parse_error(llama + "distributed: {pipeline_parallel: 3, pipeline_split: [1, 1]}"),
             "increasing decoder-layer indices >= 1");
  EXPECT_NO_THROW(Config::parse(llama + "distributed: {pipeline_parallel: 2, pipeline_split: [1]}"));
  EXPECT_HAS(parse_error("distributed: {pipeline_parallel: 2, strategy: single}"), "distributed.strategy");
  EXPECT_HAS(parse_error("distributed: {pipeline_parallel: 0}"), "an integer in 1..1024");
  EXPECT_HAS(parse_error("distributed: {pipeline_schedule: 2f2b}"), "interleaved_1f1b");
}

// Load-balancing keys out of range are refused when the config is read.
TEST(ConfigErrors, LoadBalanceKeys) {
  EXPECT_HAS(parse_error("distributed: {load_balance: fastest}"), "even, measured");
  EXPECT_HAS(parse_error("distributed: {shares: [1, 0]}"), "positive weights, one per data-parallel rank");
  EXPECT_HAS(parse_error("distributed: {shares: [2, -1]}"), "distributed.shares");
  EXPECT_HAS(parse_error("distributed: {rebalance_every: 0}"), "distributed.rebalance_every");
  EXPECT_HAS(parse_error("distributed: {straggler_factor: 1}"), "a number > 1");
  EXPECT_HAS(parse_error("distributed: {rebalance_gain: -0.1}"), "a number >= 0");
  EXPECT_NO_THROW(Config::parse("distributed: {load_balance: measured, shares: [2, 1], rebalance_every: 5}"));
}

// Under measured load balancing the global batch need not divide by the
// ranks: micro is the even share rounded up (a rank may get none).
TEST(ConfigErrors, MeasuredBatchesNeedNotDivide) {
  Config c = Config::parse("batch: {global: 5, micro: null, accumulate: 1}\n"
                           "distributed: {load_balance: measured}\n");
  const BatchPlan p = c.resolve_batch(2);
  EXPECT_EQ(p.global, 5);
  EXPECT_EQ(p.micro, 3);
  EXPECT_EQ(p.accumulate, 1);
  const BatchPlan q = Config::parse("batch: {global: 10, micro: 2, accumulate: null}\n"
                                    "distributed: {load_balance: measured}\n").resolve_batch(2);
  EXPECT_EQ(q.accumulate, 3);  // the fewest micro-steps of 2 rows per rank: ceil(10 / 4)
  EXPECT_EQ(q.micro, 2);       // ceil(10 / (3 x 2))
  const BatchPlan one = Config::parse("batch: {global: 1, micro: null, accumulate: 1}\n"
                                      "distributed: {load_balance: measured}\n").resolve_batch(2);
  EXPECT_EQ(one.micro, 1);
  // Under even the same batch is refused with the arithmetic.
  EXPECT_THROW(Config::parse("batch: {global: 5, micro: null, accumulate: 1}\n").resolve_batch(2),
               shardtrain::ConfigError);
}

// Tensor parallelism's impossible layouts are refused when the config is
// read, in one line that names both numbers, never as a reshape error in
// the first forward.
TEST(ConfigErrors, TensorParallelLayoutsThatCannotSplit) {
  const std::string llama = "model: {type: llama, n_head: 6, n_kv_head: 2, n_embd: 96, block_size: 48}\n";
  EXPECT_HAS(parse_error(llama + "distributed: {tensor_parallel: 4}"),
             "distributed.tensor_parallel=4 does not divide model.n_head=6");
  EXPECT_HAS(parse_error(llama + "distributed: {tensor_parallel: 3}"),
             "distributed.tensor_parallel=3 does not divide model.n_kv_head=2");
  EXPECT_HAS(parse_error("model: {type: gpt, n_head: 6, n_embd: 96}\ndistributed: {tensor_parallel: 4}"),
             "does not divide model.n_head=6");
  // Sequence parallelism splits the block's tokens.
  const std::string sp = parse_error("model: {type: llama, n_head: 4, n_embd: 64, block_size: 30}\n"
                                     "distributed: {tensor_parallel: 4}");
  EXPECT_HAS(sp, "a divisor of model.block_size=30");
  EXPECT_HAS(sp, "distributed.sequence_parallel");
  EXPECT_NO_THROW(Config::parse("model: {type: llama, n_head: 4, n_embd: 64, block_size: 30}\n"
                                "distributed: {tensor_parallel: 4, sequence_parallel: false}"));
  // A tensor-parallel group shares a host; one process has no group.
  EXPECT_HAS(parse_error("distributed: {tensor_parallel: 4, nproc_per_node: 6}"),
             "a divisor of distributed.nproc_per_node=6");
  EXPECT_HAS(parse_error("distributed: {tensor_parallel: 2, strategy: single}"), "distributed.strategy");
  EXPECT_HAS(parse_error("distributed: {tensor_parallel: 1025}"), "auto or an integer in 1..1024");
  EXPECT_HAS(parse_error("distributed: {tensor_parallel: -1}"), "distributed.tensor_parallel");
  EXPECT_EQ(Config::parse("distributed: {tensor_parallel: auto}").distributed.tensor_parallel(), 0);
  // A base quantized per block is read again from its file, never saved.
  const std::string qlora = "distributed: {tensor_parallel: 2}\nlora: {r: 4, quantize: nf4}\n";
  EXPECT_HAS(parse_error(qlora), "1 with lora.quantize=nf4 unless model.init_from names the base");
  EXPECT_HAS(parse_error(qlora + "model: {init_from: base.safetensors}\ncheckpoint: {save_frozen_base: true}"),
             "checkpoint.save_frozen_base");
  EXPECT_NO_THROW(Config::parse(qlora + "model: {init_from: base.safetensors}"));
  EXPECT_NO_THROW(Config::parse("distributed: {tensor_parallel: 2}\nlora: {r: 4}"));
}

TEST(ConfigErrors, ShardingKeysSuggestAndNameTheOverride) {
  const std::string typo = parse_error("distributed:\n  shardng: full_shard\n");
  EXPECT_HAS(typo, "test.yaml:2: distributed.shardng: unknown key; did you mean 'sharding'?");
  EXPECT_HAS(typo, "accumulation, memory_budget_mb");
  EXPECT_HAS(parse_error("accumulation: unsharded\n"), "did you mean 'distributed.accumulation'?");
  EXPECT_HAS(parse_error("", {"distributed.accumulation=lazy"}),
             "--set 'distributed.accumulation=lazy' (on test.yaml): distributed.accumulation: got "
             "'lazy', expected one of: sharded, unsharded");
  // The empty-list check points at the policy when the list was left alone.
  EXPECT_HAS(parse_error("distributed:\n  wrap_module_types: []\n"), "test.yaml:2");
}

// Every closed set of values is an enum; a value outside it is refused where
// it was written, with the allowed names.
TEST(ConfigErrors, UnknownEnumValueNamesTheChoices) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"model.type", enum_choices<ModelType>()},
      {"optimizer.name", enum_choices<OptimizerKind>()},
      {"schedule.name", enum_choices<LrSchedule>()},
      {"trainer.progress", enum_choices<ProgressMode>()},
      {"trainer.early_stopping.mode", enum_choices<MonitorMode>()},
      {"distributed.strategy", enum_choices<StrategyKind>()},
      {"distributed.sharding", enum_choices<Sharding>()},
      {"distributed.param_dtype", enum_choices<DType>()},
      {"distributed.reduce_dtype", "fp32, bf16, fp16"},
      {"distributed.auto_wrap_policy", enum_choices<AutoWrapPolicy>()},
      {"distributed.backward_prefetch", enum_choices<BackwardPrefetch>()},
      {"distributed.accumulation", enum_choices<Accumulation>()},
      {"checkpoint.mode", enum_choices<MonitorMode>()},
      {"precision", enum_choices<PrecisionKind>()},
  };
  for (const auto& [key, choices] : cases) {
    EXPECT_HAS(parse_error("", {key + "=bogus"}),
               "--set '" + key + "=bogus' (on test.yaml): " + key +
                   ": got 'bogus', expected one of: " + choices + "; see docs/config.md");
  }
  EXPECT_HAS(parse_error("\ntrainer:\n  progress: fancy\n"),
             "test.yaml:3: trainer.progress: got 'fancy', expected one of: auto, bar, plain, none");
  // Names are exact: no case folding, no spaces.
  EXPECT_HAS(parse_error("distributed: {sharding: FULL_SHARD}"), "got 'FULL_SHARD'");
  // The docs list the same names.
  EXPECT_HAS(key_table("model"), "`gpt`, `llama`, `mixtral`, `qwen3_moe`, `mlp`, `auto`");
}

TEST(ConfigErrors, MalformedYamlNamesOriginAndLine) {
  const std::string msg = parse_error("model:\n  n_layer: 2\n   n_head: [4\n", {}, "bad.yaml");
  EXPECT_HAS(msg, "bad.yaml:");
  EXPECT_HAS(msg, "invalid YAML");
  EXPECT_NE(msg.find("bad.yaml:3"), std::string::npos) << msg;
  EXPECT_HAS(parse_error("- a\n- b\n"), "a mapping of sections");
}

TEST(ConfigErrors, MissingFileIsAConfigError) {
  try {
    Config::load("/nonexistent/shardtrain.yaml");
    FAIL() << "no ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_HAS(std::string(e.what()), "/nonexistent/shardtrain.yaml");
  }
}

TEST(ConfigErrors, LoadNamesTheFileAsOrigin) {
  const std::string path = ::testing::TempDir() + "/test_config_origin.yaml";
  {
    std::ofstream out(path);
    out << "run:\n  seed: 1\noptimizer:\n  lr: -3\n";
  }
  try {
    Config::load(path);
    FAIL() << "no ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_HAS(std::string(e.what()), path + ":4: optimizer.lr: got -3.0");
  }
  std::remove(path.c_str());
}

TEST(ConfigErrors, PrecisionNamesAndScalerRanges) {
  for (const std::string name : {"fp32", "bf16-mixed", "fp16-mixed", "bf16-true"}) {
    EXPECT_EQ(enum_name(Config::parse("precision: " + name + "\n").precision), name);
  }
  const std::string msg = parse_error("", {"precision=fp8"});
  EXPECT_HAS(msg, "precision: got 'fp8'");
  EXPECT_HAS(msg, "bf16-mixed");
  EXPECT_HAS(parse_error("loss_scaler:\n  hysteresis: 0\n"), "loss_scaler.hysteresis: got 0");
  EXPECT_HAS(parse_error("", {"loss_scaler.min_loss_scale=-1"}), "loss_scaler.min_loss_scale");
  EXPECT_HAS(parse_error("", {"distributed.reduce_dtype=fp64"}), "distributed.reduce_dtype: got 'fp64'");
  const Config c = Config::parse("", {"loss_scaler.loss_scale_window=8", "distributed.reduce_dtype=bf16"});
  EXPECT_EQ(c.loss_scaler.loss_scale_window(), 8);
  EXPECT_EQ(c.distributed.reduce_dtype(), DType::Bf16);
}

// ---- batch arithmetic --------------------------------------------------------------------

TEST(ConfigBatch, DerivesAccumulate) {
  Config c;
  c.batch = {32, 8, std::nullopt};
  const BatchPlan p = c.resolve_batch(2);
  EXPECT_EQ(p.global, 32);
  EXPECT_EQ(p.micro, 8);
  EXPECT_EQ(p.accumulate, 2);
  EXPECT_EQ(c.resolve_batch(4).accumulate, 1);
}

TEST(ConfigBatch, DerivesMicro) {
  Config c;
  c.batch = {48, std::nullopt, 2};
  const BatchPlan p = c.resolve_batch(3);
  EXPECT_EQ(p.global, 48);
  EXPECT_EQ(p.micro, 8);
  EXPECT_EQ(p.accumulate, 2);
}

TEST(ConfigBatch, DerivesGlobal) {
  Config c;
  c.batch = {std::nullopt, 4, 3};
  const BatchPlan p = c.resolve_batch(5);
  EXPECT_EQ(p.global, 60);
  EXPECT_EQ(p.micro, 4);
  EXPECT_EQ(p.accumulate, 3);
  EXPECT_EQ(c.resolve_batch(1).global, 12);
}

TEST(ConfigBatch, ConsistentTripleIsAccepted) {
  Config c;
  c.batch = {32, 8, 2};
  EXPECT_EQ(c.resolve_batch(2).accumulate, 2);
}

TEST(ConfigBatch, InconsistentTripleShowsTheArithmetic) {
  const std::string msg = batch_error({30, 8, 2}, 2);
  EXPECT_HAS(msg, "8 × 2 × 2 = 32 ≠ batch.global=30");
  EXPECT_HAS(msg, "batch.micro × batch.accumulate × world_size");
}

TEST(ConfigBatch, NotDivisibleShowsTheArithmetic) {
  EXPECT_HAS(batch_error({30, 8, std::nullopt}, 2),
             "batch.global=30 is not divisible by batch.micro=8 × world_size=2 = 16");
  // Smaller than one micro-batch per rank.
  EXPECT_HAS(batch_error({8, 8, std::nullopt}, 3),
             "batch.global=8 is not divisible by batch.micro=8 × world_size=3 = 24");
  EXPECT_HAS(batch_error({30, std::nullopt, 4}, 1),
             "batch.global=30 is not divisible by batch.accumulate=4 × world_size=1 = 4");
}

TEST(ConfigBatch, FewerThanTwoGivenOrNonPositive) {
  EXPECT_HAS(batch_error({std::nullopt, 8, std::nullopt}, 1), "at least two of batch.global");
  EXPECT_HAS(batch_error({std::nullopt, std::nullopt, std::nullopt}, 1), "at least two");
  EXPECT_HAS(batch_error({32, 0, std::nullopt}, 1), "batch.micro: got 0");
  EXPECT_HAS(batch_error({32, 8, std::nullopt}, 0), "world_size 0");
}
