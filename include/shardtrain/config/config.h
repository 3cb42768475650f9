// The run configuration: YAML in, plain structs out.
//
// Every key, its type and its default are listed in docs/config.md. Loading
// is strict: an unknown key, a value of the wrong type or an impossible
// combination is a ConfigError that names the key, the value and what is
// allowed. `--set a.b=c` overrides are applied to the YAML before it is
// read, so they obey the same rules.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace shardtrain::config {

struct RunConfig {
  std::string dir = "runs/default";
  uint64_t seed = 1337;
};

struct ModelConfig {
  /// "gpt" or "mlp".
  std::string type = "gpt";
  // gpt
  int64_t n_layer = 4;
  int64_t n_head = 4;
  int64_t n_embd = 128;
  int64_t block_size = 128;
  int64_t vocab_size = 256;
  bool activation_checkpointing = false;
  // mlp: layer widths {in, hidden..., out}
  std::vector<int64_t> mlp_sizes = {64, 128, 64};
  /// A safetensors file (Hugging Face GPT-2 names) to initialise the
  /// weights from, for fine-tuning; "" starts from the seed.
  std::string init_from;
};

/// Sharded checkpoints under <run.dir>/checkpoints/step-NNNNNN.
struct CheckpointConfig {
  /// Save every this many optimizer steps; 0: only at the end (and on
  /// SIGTERM / SIGINT).
  int64_t every_n_steps = 0;
  /// Save when this many minutes passed since the last save; 0: off.
  double every_n_minutes = 0.0;
  /// Complete checkpoints kept (the newest); 0 keeps all.
  int64_t keep = 3;
  /// Also keep the best checkpoint by this metric of the evaluation lines
  /// (e.g. "eval_loss"); "" keeps none for that reason.
  std::string monitor;
  /// "min" or "max": which value of `monitor` is best.
  std::string mode = "min";
  /// "" starts fresh; "auto" resumes from the newest complete checkpoint of
  /// run.dir if there is one; any other value is a checkpoint directory.
  std::string resume;
  /// Save before exiting when SIGTERM or SIGINT arrives.
  bool save_on_signal = true;
};

struct DataConfig {
  /// A UTF-8 text file or an llm.c token file; relative paths are taken from
  /// the working directory.
  std::string train = "data/corpus.txt";
  /// The last fraction of the tokens, held out for evaluation; 0 disables it.
  double val_fraction = 0.05;
  bool shuffle = true;
};

/// Batch sizes in samples (sequences). Any two of the three may be given;
/// resolve() derives the third: global = micro * accumulate * world_size.
struct BatchConfig {
  std::optional<int64_t> global = 32;
  std::optional<int64_t> micro = 8;
  std::optional<int64_t> accumulate;
};

/// The three batch numbers after resolve().
struct BatchPlan {
  int64_t global = 0;
  int64_t micro = 0;
  int64_t accumulate = 0;
};

struct OptimizerConfig {
  /// "adamw" or "sgd".
  std::string name = "adamw";
  double lr = 3.0e-4;
  double weight_decay = 0.1;
  std::vector<double> betas = {0.9, 0.95};
  double eps = 1.0e-8;
  /// sgd only.
  double momentum = 0.9;
};

struct ScheduleConfig {
  /// "constant", "linear" or "cosine"; each starts with linear warmup.
  std::string name = "cosine";
  int64_t warmup_steps = 20;
  double min_lr = 3.0e-5;
};

struct EarlyStoppingConfig {
  bool enabled = false;
  /// A metric name present in evaluation lines, e.g. "eval_loss".
  std::string monitor = "eval_loss";
  int64_t patience = 3;
  double min_delta = 0.0;
  /// "min" or "max".
  std::string mode = "min";
};

struct TrainerConfig {
  int64_t max_steps = 500;
  /// Evaluate every N optimizer steps and at the end; 0 disables.
  int64_t eval_every = 100;
  int64_t eval_batches = 10;
  int64_t log_every = 1;
  /// Clip the global gradient norm to this; 0 disables clipping.
  double max_grad_norm = 1.0;
  /// "auto" (a bar on a terminal, plain lines otherwise), "bar", "plain", "none".
  std::string progress = "auto";
  /// Tokens sampled at the end of `shardtrain train`; 0 disables.
  int64_t sample_tokens = 200;
  EarlyStoppingConfig early_stopping;
};

struct DistributedConfig {
  /// "single", "ddp", "zero1", "fsdp" or "auto" (the strategy with the least
  /// communication whose memory estimate fits memory_budget_mb; see
  /// strategy/estimate.h).
  std::string strategy = "ddp";
  /// Ranks on this node; 0 means "auto": the number of online CPUs.
  int64_t nproc_per_node = 0;
  double bucket_cap_mb = 25.0;
  double first_bucket_mb = 1.0;
  /// true: parameters that get no gradient in a step are detected and
  /// reduced as zeros; false: such a parameter is an error that names it.
  bool find_unused_parameters = false;
  /// Intra-op threads per rank; 0 means cores / local ranks.
  int64_t threads_per_rank = 0;
  /// dtype gradients are reduced in: "fp32", "bf16" or "fp16".
  std::string reduce_dtype = "fp32";
  /// zero1/fsdp: dtype of the gathered (compute) copy of the parameters:
  /// "auto" (each parameter's own dtype), "fp32", "bf16" or "fp16".
  std::string param_dtype = "auto";
  /// fsdp: "full_shard", "shard_grad_op", "no_shard" or "hybrid_shard".
  std::string sharding = "full_shard";
  /// fsdp: which submodules become units: "module_type", "size" or "none".
  std::string auto_wrap_policy = "module_type";
  /// fsdp, auto_wrap_policy module_type: type-name suffixes of the units.
  std::vector<std::string> wrap_module_types = {"BlockImpl"};
  /// fsdp, auto_wrap_policy size: parameters a unit needs at least.
  int64_t min_num_params = 1048576;
  /// fsdp: "backward_pre", "backward_post" or "none".
  std::string backward_prefetch = "backward_pre";
  /// fsdp: gather the next unit while this one's forward runs.
  bool forward_prefetch = false;
  /// fsdp: unit all-gathers in flight at most.
  int64_t limit_all_gathers = 2;
  /// fsdp: "sharded" (reduce-scatter every micro-step) or "unsharded" (keep
  /// whole gradients until the last micro-step).
  std::string accumulation = "sharded";
  /// Memory per rank that strategy "auto" may plan for, in MiB; 0 means
  /// this machine's MemAvailable divided by the local ranks.
  double memory_budget_mb = 0.0;
};

/// Dynamic loss scaling for precision fp16-mixed (DeepSpeed's defaults).
struct LossScalerConfig {
  int64_t initial_scale_power = 16;
  int64_t loss_scale_window = 1000;
  int64_t hysteresis = 2;
  double min_loss_scale = 1.0;
  /// Consecutive skipped steps at the minimum scale before training fails; 0: never.
  int64_t max_skips_at_min = 50;
};

struct Config {
  RunConfig run;
  ModelConfig model;
  DataConfig data;
  BatchConfig batch;
  OptimizerConfig optimizer;
  ScheduleConfig schedule;
  TrainerConfig trainer;
  DistributedConfig distributed;
  /// "fp32", "bf16-mixed", "fp16-mixed" (needs CUDA) or "bf16-true".
  std::string precision = "fp32";
  LossScalerConfig loss_scaler;
  CheckpointConfig checkpoint;

  /// Reads a YAML file, applies "a.b=c" overrides, validates.
  static Config load(const std::string& path, const std::vector<std::string>& overrides = {});
  /// The same from YAML text; `origin` names it in messages.
  static Config parse(const std::string& yaml, const std::vector<std::string>& overrides = {},
                      const std::string& origin = "<string>");
  /// Every key with its value, as YAML that parse() reads back to an equal Config.
  std::string to_yaml() const;

  /// Derives the missing batch number for `world_size` ranks; throws
  /// ConfigError showing the arithmetic when the three do not agree.
  BatchPlan resolve_batch(int world_size) const;
};

}  // namespace shardtrain::config
