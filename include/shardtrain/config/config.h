// The run configuration: YAML in, plain structs out.
//
// Each struct below is one section of the YAML file, and where the library
// has an options struct for a section, the section is that struct: the
// `distributed` section is strategy::StrategyOptions plus the launch keys,
// `loss_scaler` is precision::LossScalerOptions. Closed sets of values are
// enums whose names are the YAML values (strategy/options.h,
// precision/precision.h, train/choices.h).
//
// The structs give each key its type and default; its name, its check and
// its meaning are declared once, in the key table of src/config/schema.cpp.
// Reading, validation, to_yaml() and the key tables of docs/config.md are
// all derived from that table (config/schema.h).
//
// Loading is strict: an unknown key, a value of the wrong type or an
// impossible combination is a ConfigError that names the key, the value and
// what is allowed. `--set a.b=c` overrides are applied to the YAML before it
// is read, so they obey the same rules.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "shardtrain/comm/communicator.h"
#include "shardtrain/core/options.h"
#include "shardtrain/data/choices.h"
#include "shardtrain/models/lora.h"
#include "shardtrain/parallel/pipeline_schedule.h"
#include "shardtrain/precision/precision.h"
#include "shardtrain/strategy/options.h"
#include "shardtrain/train/choices.h"

namespace shardtrain::config {

struct RunConfig {
  std::string dir = "runs/default";
  uint64_t seed = 1337;
  /// Write into a run directory that already holds files shardtrain did not
  /// write there (without it, such a directory is refused unless resuming).
  bool overwrite = false;
};

/// The model section. gpt and llama share the sizes; the llama keys are the
/// fields of a Hugging Face LlamaConfig under our names. When init_from is a
/// Hugging Face directory its config.json sets the architecture (every key
/// but block_size, activation_checkpointing, dropout and init_from), once,
/// as the config is read (models/family.h).
struct ModelConfig {
  train::ModelType type = train::ModelType::Gpt;
  // gpt and llama
  int64_t n_layer = 4;
  int64_t n_head = 4;
  int64_t n_embd = 128;
  int64_t block_size = 64;
  int64_t vocab_size = 256;
  bool activation_checkpointing = false;
  /// Dropout probability while training (gpt: embeddings, attention,
  /// residuals; llama: the attention weights, as HF's attention_dropout).
  double dropout = 0.0;
  // llama
  /// Key/value heads (grouped-query attention); 0: n_head.
  int64_t n_kv_head = 0;
  /// Channels per head; 0: n_embd / n_head.
  int64_t head_dim = 0;
  /// SwiGLU width; 0: 8/3 n_embd rounded up to a multiple of 64.
  int64_t intermediate_size = 0;
  double rope_theta = 10000.0;
  train::RopeScaling rope_scaling = train::RopeScaling::None;
  double rope_factor = 8.0;
  double rope_low_freq_factor = 1.0;
  double rope_high_freq_factor = 4.0;
  int64_t rope_original_max_position = 8192;
  double rms_norm_eps = 1e-5;
  bool tie_word_embeddings = false;
  train::AttentionBias attention_bias = train::AttentionBias::None;
  bool mlp_bias = false;
  /// The longest context the weights were trained for; 0: block_size.
  int64_t max_position_embeddings = 0;
  /// config.json's model_type on export: llama, mistral or qwen2.
  std::string hf_model_type = "llama";
  // mixtral, qwen3_moe (mixture of experts; the keys above describe the rest)
  /// Experts of each MoE layer (HF num_local_experts, num_experts).
  int64_t num_experts = 8;
  /// Experts each token is routed to (top-k).
  int64_t num_experts_per_tok = 2;
  /// qwen3_moe: the top-k routing weights renormalised to sum 1 (mixtral always).
  bool norm_topk_prob = true;
  /// qwen3_moe: each expert's SwiGLU width (intermediate_size is the dense layers').
  int64_t moe_intermediate_size = 0;
  /// qwen3_moe: layer i is MoE when (i + 1) % decoder_sparse_step == 0 and
  /// i is not in mlp_only_layers; the others are dense.
  int64_t decoder_sparse_step = 1;
  std::vector<int64_t> mlp_only_layers;
  /// Weight of the router load-balancing loss in the training loss.
  double router_aux_loss_coef = 0.001;
  /// Whether that loss is added to the training loss (HF's switch of the
  /// same name); it is logged as aux_loss either way.
  bool output_router_logits = false;
  // mlp: layer widths {in, hidden..., out}
  std::vector<int64_t> mlp_sizes = {64, 128, 64};
  /// A safetensors file or a Hugging Face model directory to initialise the
  /// weights from; "": from the seed.
  std::string init_from;
};

/// Sharded checkpoints under <run.dir>/checkpoints/step-NNNNNN.
struct CheckpointConfig {
  int64_t every_n_steps = 0;
  double every_n_minutes = 0.0;
  int64_t keep = 3;
  /// "": keep no best checkpoint.
  std::string monitor;
  train::MonitorMode mode = train::MonitorMode::Min;
  /// "": start fresh (after a launcher restart: as "auto"); "auto": the
  /// newest complete checkpoint of run.dir that loads, if any; "never":
  /// always start fresh; otherwise a checkpoint directory.
  std::string resume;
  bool save_on_signal = true;
  /// LoRA with model.init_from: false keeps the frozen base out of every
  /// checkpoint (it records the base file and its SHA-256 instead); true
  /// copies the base into each checkpoint.
  bool save_frozen_base = false;
  /// The exported Hugging Face directory (run.dir/model) splits its weights
  /// into shards of at most this many MB (10^6 bytes), as transformers does.
  double export_max_shard_mb = 5000.0;
};

struct DataConfig {
  std::string train = "data/corpus.txt";
  double val_fraction = 0.05;
  bool shuffle = true;
  data::DataFormat format = data::DataFormat::Auto;
  std::string tokenizer = "bytes";
  data::ChatTemplateKind chat_template = data::ChatTemplateKind::Auto;
  bool train_on_inputs = false;
  bool packing = false;
  data::Overlong overlong = data::Overlong::Truncate;
};

/// Batch sizes in samples (sequences). Any two of the three may be given;
/// resolve_batch() derives the third: global = micro * accumulate * world_size.
struct BatchConfig {
  std::optional<int64_t> global = 64;
  std::optional<int64_t> micro = 16;
  std::optional<int64_t> accumulate;
};

/// The three batch numbers after resolve_batch().
struct BatchPlan {
  int64_t global = 0;
  int64_t micro = 0;
  int64_t accumulate = 0;
};

struct OptimizerConfig {
  train::OptimizerKind name = train::OptimizerKind::AdamW;
  double lr = 4.0e-3;
  double weight_decay = 0.1;
  std::vector<double> betas = {0.9, 0.95};
  double eps = 1.0e-8;
  /// sgd only.
  double momentum = 0.9;
};

struct ScheduleConfig {
  train::LrSchedule name = train::LrSchedule::Cosine;
  int64_t warmup_steps = 20;
  double min_lr = 4.0e-4;
};

struct EarlyStoppingConfig {
  bool enabled = false;
  std::string monitor = "eval_loss";
  int64_t patience = 3;
  double min_delta = 0.0;
  train::MonitorMode mode = train::MonitorMode::Min;
};

struct TrainerConfig {
  int64_t max_steps = 600;
  /// 0: never evaluate.
  int64_t eval_every = 100;
  int64_t eval_batches = 10;
  int64_t log_every = 1;
  /// 0: no clipping.
  double max_grad_norm = 1.0;
  train::ProgressMode progress = train::ProgressMode::Auto;
  int64_t sample_tokens = 200;
  /// Profile this optimizer step (1-based) on every rank; 0: never.
  int64_t profile_step = 0;
  EarlyStoppingConfig early_stopping;
};

/// The strategy's options (every field a key of the same name) and the keys
/// that say how to start the ranks.
struct DistributedConfig : strategy::StrategyOptions {
  /// Ranks on this node; 0 means auto: the number of online CPUs.
  ST_ARG(int64_t, nproc_per_node) = 0;
  /// Intra-op threads per rank; 0 means cores / local ranks.
  ST_ARG(int64_t, threads_per_rank) = 0;
  /// Memory per rank that strategy Auto may plan for, in MiB; 0 means this
  /// machine's MemAvailable divided by the local ranks.
  ST_ARG(double, memory_budget_mb) = 0.0;
  /// What moves the bytes between ranks; auto: MPI under mpirun/srun, else
  /// Gloo. Not auto: wins over SHARDTRAIN_BACKEND.
  ST_ARG(comm::Backend, backend) = comm::Backend::Auto;
  /// Ranks that split each layer (the mesh's tp dimension, innermost: they
  /// share a host); 1: none. The data-parallel size is what is left.
  ST_ARG(int64_t, tensor_parallel) = 1;
  /// Under tensor parallelism: norms, dropout and the residual stream hold
  /// 1/tp of the tokens (all-gather in, reduce-scatter out of each region).
  ST_ARG(bool, sequence_parallel) = true;
  /// Under tensor parallelism: the loss on vocabulary-sharded logits.
  ST_ARG(bool, loss_parallel) = true;
  /// Pipeline stages over ranks (the mesh's pp dimension, outermost: stages
  /// split across hosts first); 1: none.
  ST_ARG(int64_t, pipeline_parallel) = 1;
  /// The order of the micro-batches' forward and backward work on each stage.
  ST_ARG(parallel::PipelineSchedule, pipeline_schedule) = parallel::PipelineSchedule::OneFOneB;
  /// interleaved_1f1b: stages each rank holds (the model is cut into
  /// pipeline_parallel x stages_per_rank stages).
  ST_ARG(int64_t, stages_per_rank) = 2;
  /// The first decoder layer of each stage after the first; empty: the cut
  /// that balances the stages' parameters.
  ST_ARG(std::vector<int64_t>, pipeline_split) = {};
  /// How each step's samples are split over the data-parallel ranks:
  /// equally, or by each rank's measured compute speed.
  ST_ARG(train::LoadBalance, load_balance) = train::LoadBalance::Even;
  /// measured: steps between re-plans of the shares.
  ST_ARG(int64_t, rebalance_every) = 20;
  /// measured: the least predicted step-time gain (0.05: 5%) worth a re-plan.
  ST_ARG(double, rebalance_gain) = 0.05;
  /// measured: a rank this many times slower than the median is named.
  ST_ARG(double, straggler_factor) = 1.5;
  /// measured: each data-parallel rank's starting share (any positive
  /// weights); empty: in proportion to the ranks' threads.
  ST_ARG(std::vector<double>, shares) = {};

 public:
  /// The ranks that see different data among `world`: world / (tensor_parallel x pipeline_parallel).
  int data_parallel_size(int world) const {
    return world / static_cast<int>(std::max<int64_t>(1, tensor_parallel()) * std::max<int64_t>(1, pipeline_parallel()));
  }
  /// Pipeline stages of the model: pipeline_parallel, times stages_per_rank
  /// under interleaved_1f1b.
  int64_t pipeline_stages() const {
    return pipeline_parallel() *
           (pipeline_schedule() == parallel::PipelineSchedule::Interleaved1F1B ? stages_per_rank() : 1);
  }
};

/// LoRA fine-tuning (models/lora.h): the adapter options, off while r is 0,
/// and an adapter to continue from.
struct LoraConfig : models::LoraOptions {
  /// Off; target_modules empty: the model family's defaults.
  LoraConfig() { r(0).target_modules({}); }
  /// A directory with adapter_model.safetensors (PEFT layout); "": fresh adapters.
  ST_ARG(std::string, init_from);
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
  precision::PrecisionKind precision = precision::PrecisionKind::Fp32;
  precision::LossScalerOptions loss_scaler;
  CheckpointConfig checkpoint;
  LoraConfig lora;

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
