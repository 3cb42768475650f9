// The key table: every config key, declared once. Its name and accessor, its
// check and its one-line doc are here; its type and default are in the
// section's struct (config/config.h). The order is to_yaml()'s and the docs'.
//
// A key's own range is its Rule; conditions between keys are in
// check_relations() below, and the docs' Allowed column mentions them.
#include <algorithm>
#include <cmath>

#include "key_table.h"

namespace shardtrain::config::detail {

using shardtrain::detail::str_cat;

namespace {

using strategy::DType;

// Upper bounds of the integer keys that are narrowed to int where they are
// used (threads for at::set_num_threads, checkpoints to keep for prune()):
// a larger value would wrap (4294967296 to 0) instead of being refused.
constexpr int64_t kMaxThreadsPerRank = 1024;
constexpr int64_t kMaxKeep = 1000000;

void declare_run_model_data(std::vector<Key>& keys) {
  section(keys, "run", [](auto& c) -> auto& { return c.run; })
      .key(ST_FIELD(dir), non_empty("a directory path"), "Directory for checkpoints and logs.")
      .key(ST_FIELD(seed), any("0 … 2^64−1"), "Seed for weights, data order and sampling.")
      .key(ST_FIELD(overwrite),
           "Write into a `run.dir` that already holds files shardtrain did not write (another "
           "tool's output, someone's notes), or that a finished or stopped run trained in (its "
           "checkpoints, model and metrics are replaced). Off: such a directory is refused unless "
           "resuming (`checkpoint.resume` set); shardtrain marks the directories it writes with "
           "`.shardtrain.lock`.");

  section(keys, "model", [](auto& c) -> auto& { return c.model; })
      .key(ST_FIELD(type),
           "Which model to build: a family of models/family.h, or `auto`: the family of the "
           "Hugging Face directory `init_from` (its config.json's `model_type`). Left unset, "
           "`auto` when `init_from` is such a directory, else `gpt`.")
      .key(ST_FIELD(n_layer), at_least(1), "gpt, llama: transformer blocks (decoder layers).")
      .key(ST_FIELD(n_head), at_least(1), "gpt, llama: attention heads per block.")
      .key(ST_FIELD(n_embd), at_least(1).allowing("≥ 1, a multiple of `n_head`"),
           "gpt, llama: embedding width (HF `hidden_size`).")
      .key(ST_FIELD(block_size), at_least(1),
           "Training context length in tokens; llama: at most `max_position_embeddings`.")
      .key(ST_FIELD(vocab_size), at_least(1), "gpt, llama: vocabulary size (256: bytes of a text file).")
      .key(ST_FIELD(activation_checkpointing),
           "gpt, llama: recompute block activations in backward to save memory.")
      .key(ST_FIELD(dropout), fraction("a number in [0, 1)"),
           "Dropout probability while training. gpt: as nanoGPT applies it, on the embeddings, "
           "the attention weights and each residual branch; llama: on the attention weights (HF "
           "`attention_dropout`). Masks come from each rank's generator (seeded by `run.seed`), "
           "whose state checkpoints save and a resume at the same world size restores.")
      .key(ST_FIELD(n_kv_head), at_least(0).allowing("≥ 0, dividing `n_head`"),
           "llama: key/value heads (grouped-query attention); 0: `n_head`.")
      .key(ST_FIELD(head_dim), at_least(0), "llama: channels per head; 0: `n_embd / n_head`.")
      .key(ST_FIELD(intermediate_size), at_least(0),
           "llama: SwiGLU width; 0: 8/3 `n_embd` rounded up to a multiple of 64.")
      .key(ST_FIELD(rope_theta), above(0.0, "a number > 0, e.g. 10000 or 500000"),
           "llama: rotary-embedding base.")
      .key(ST_FIELD(rope_scaling), "llama: rotary frequency scaling (`llama3`: Llama-3.1's).")
      .key(ST_FIELD(rope_factor), above(0.0, "a number > 0"), "llama3 rope scaling: `factor`.")
      .key(ST_FIELD(rope_low_freq_factor), above(0.0, "a number > 0"),
           "llama3 rope scaling: `low_freq_factor`.")
      .key(ST_FIELD(rope_high_freq_factor), above(0.0, "a number > 0"),
           "llama3 rope scaling: `high_freq_factor` (> `rope_low_freq_factor`).")
      .key(ST_FIELD(rope_original_max_position), at_least(1),
           "llama3 rope scaling: `original_max_position_embeddings`.")
      .key(ST_FIELD(rms_norm_eps), above(0.0, "a number > 0, e.g. 1e-5 or 1e-6"),
           "llama: RMSNorm epsilon.")
      .key(ST_FIELD(tie_word_embeddings),
           "llama: the output head is the token embedding (gpt: always).")
      .key(ST_FIELD(attention_bias),
           "llama: biases of the attention projections (`qkv`: Qwen2; `all`: HF `attention_bias`).")
      .key(ST_FIELD(mlp_bias), "llama: biases on gate, up and down projections.")
      .key(ST_FIELD(max_position_embeddings), at_least(0),
           "llama: the longest context of the weights; 0: `block_size`.")
      .key(ST_FIELD(hf_model_type), one_of_strings({"llama", "mistral", "qwen2"}),
           "llama: the Hugging Face `model_type` written to an exported config.json.")
      .key(ST_FIELD(num_experts), at_least(1),
           "mixtral, qwen3_moe: experts of each MoE layer (HF `num_local_experts`, `num_experts`).")
      .key(ST_FIELD(num_experts_per_tok), at_least(1).allowing("1 … `num_experts`"),
           "mixtral, qwen3_moe: experts each token is routed to (top-k).")
      .key(ST_FIELD(norm_topk_prob),
           "qwen3_moe: renormalise the top-k routing weights to sum 1 (mixtral always does).")
      .key(ST_FIELD(moe_intermediate_size), at_least(0),
           "qwen3_moe: each expert's SwiGLU width; 0: `intermediate_size`.")
      .key(ST_FIELD(decoder_sparse_step), at_least(1),
           "qwen3_moe: layer i is MoE when (i + 1) is a multiple of it and i is not in `mlp_only_layers`.")
      .key(ST_FIELD(mlp_only_layers), any("a list of layer indices"),
           "qwen3_moe: layers that keep a dense MLP of `intermediate_size`.")
      .key(ST_FIELD(router_aux_loss_coef), not_below(0.0, "a number >= 0, e.g. 0.001"),
           "mixtral, qwen3_moe: weight of the routers' load-balancing loss.")
      .key(ST_FIELD(output_router_logits),
           "mixtral, qwen3_moe: add `router_aux_loss_coef` times the load-balancing loss to the "
           "training loss (HF's switch); metrics.jsonl logs it as `aux_loss` either way.")
      .key(ST_FIELD(mlp_sizes),
           rule([](const std::vector<int64_t>& v) {
                  return v.size() >= 2 &&
                         std::all_of(v.begin(), v.end(), [](int64_t w) { return w >= 1; });
                },
                "a list of at least two layer widths [in, hidden..., out], each an integer >= 1",
                "≥ 2 entries, each ≥ 1"),
           "mlp: layer widths `[in, hidden..., out]`.")
      .key(ST_FIELD(init_from), any("a safetensors file or a Hugging Face model directory"),
           "Initialise the weights before training (fine-tuning): a safetensors file (Hugging Face "
           "GPT-2 names, as `shardtrain checkpoint consolidate` writes; Conv1D weights transposed "
           "on import, `attn.bias` buffers skipped), or a Hugging Face model directory "
           "(`config.json` plus `model.safetensors` or the shards its "
           "`model.safetensors.index.json` names) whose config sets the architecture. A missing, "
           "extra or mis-shaped tensor is a `CheckpointError` listing them.");

  section(keys, "data", [](auto& c) -> auto& { return c.data; })
      .key(ST_FIELD(train), non_empty("a path to a text or token file"),
           "A UTF-8 text file or an llm.c token file; relative to the working directory.")
      .key(ST_FIELD(val_fraction), fraction("a number in [0, 1); 0 disables evaluation data"),
           "Held out for evaluation: the last fraction of the tokens (tokens, text), or of the "
           "whole records (jsonl, never split); 0: none.")
      .key(ST_FIELD(shuffle), "Shuffle the training samples each epoch.")
      .key(ST_FIELD(format),
           "How `train` is read: `auto` (a `.jsonl` name is JSON lines, else a token file by its "
           "magic, else text), `tokens`, `text`, or `jsonl` (records with text, prompt+completion, "
           "Alpaca instruction/input/output, or chat messages; docs/data.md).")
      .key(ST_FIELD(tokenizer), non_empty("`bytes`, `auto` or a path"),
           "`bytes`; `auto` (the tokenizer of the model directory `model.init_from`); or a path to "
           "a tokenizer.json, a tokenizer.model or a directory holding one. Left unset, `auto` "
           "when `model.init_from` is a Hugging Face directory, else `bytes`.")
      .key(ST_FIELD(chat_template),
           "Template for chat records: a built-in by name, or `auto` (recognised from the model "
           "directory's tokenizer_config.json).")
      .key(ST_FIELD(train_on_inputs),
           "jsonl: also train on prompt, system and user tokens; false: only completions and "
           "assistant replies (with their end-of-turn token) count in the loss.")
      .key(ST_FIELD(packing),
           "jsonl: lay several samples into each row (greedy, next-fit; needs a model that honours "
           "segments); false: one padded sample per row.")
      .key(ST_FIELD(overlong),
           "jsonl: a sample longer than `model.block_size` is cut to it (`truncate`) or left out "
           "(`drop`); the start-up line counts them.");

  section(keys, "batch", [](auto& c) -> auto& { return c.batch; })
      .key(ST_FIELD(global), at_least_or_null(1), "Samples per optimizer step, over all ranks.")
      .key(ST_FIELD(micro), at_least_or_null(1), "Samples per forward/backward on one rank.")
      .key(ST_FIELD(accumulate), at_least_or_null(1),
           "Micro-batches accumulated per optimizer step.");
}

void declare_optimization(std::vector<Key>& keys) {
  section(keys, "optimizer", [](auto& c) -> auto& { return c.optimizer; })
      .key(ST_FIELD(name), "The optimizer.")
      .key(ST_FIELD(lr), above(0.0, "a number > 0, e.g. 3e-4"), "Peak learning rate (after warmup).")
      .key(ST_FIELD(weight_decay), not_below(0.0, "a number >= 0"),
           "Decoupled weight decay (adamw) / L2 (sgd).")
      .key(ST_FIELD(betas),
           rule([](const std::vector<double>& v) {
                  return v.size() == 2 && std::all_of(v.begin(), v.end(), [](double b) {
                           return b >= 0.0 && b < 1.0;
                         });
                },
                "a list of two numbers in [0, 1), e.g. [0.9, 0.95]", "2 entries, each in [0, 1)"),
           "adamw: moment decay rates.")
      .key(ST_FIELD(eps), above(0.0, "a number > 0, e.g. 1e-8"), "adamw: denominator epsilon.")
      .key(ST_FIELD(momentum), fraction("a number in [0, 1)"), "sgd: momentum.");

  section(keys, "schedule", [](auto& c) -> auto& { return c.schedule; })
      .key(ST_FIELD(name),
           "Learning-rate shape after warmup: flat at `lr`, or decaying from `lr` to `min_lr` at "
           "`trainer.max_steps`.")
      .key(ST_FIELD(warmup_steps), at_least(0), "Steps of linear warmup from 0 to `lr`.")
      .key(ST_FIELD(min_lr),
           not_below(0.0, "a number >= 0")
               .allowing("≥ 0; ≤ `optimizer.lr` for `linear` and `cosine`"),
           "The learning rate at the last step.");

  section(keys, "trainer", [](auto& c) -> auto& { return c.trainer; })
      .key(ST_FIELD(max_steps), at_least(1), "Optimizer steps to run.")
      .key(ST_FIELD(eval_every), at_least(0), "Evaluate every N steps and at the end; 0: never.")
      .key(ST_FIELD(eval_batches), at_least(1), "Micro-batches per evaluation.")
      .key(ST_FIELD(log_every), at_least(1), "Log a training line every N steps.")
      .key(ST_FIELD(max_grad_norm), not_below(0.0, "a number >= 0; 0 disables clipping"),
           "Clip the global gradient norm to this; 0: no clipping.")
      .key(ST_FIELD(progress),
           "`auto`: a bar on a terminal, plain lines otherwise. Under `shardtrain launch` (and a "
           "multi-rank `shardtrain train`) whose output is a terminal, the launcher draws one bar for "
           "every rank (`auto` and `bar`); `plain`: a line per step; `none`: nothing.")
      .key(ST_FIELD(sample_tokens), at_least(0),
           "Tokens sampled at the end of `shardtrain train`; 0: none.")
      .key(ST_FIELD(profile_step), at_least(0),
           "Profile this step (1-based) with LibTorch's profiler on every rank: each op's own "
           "time, by phase (forward, backward, gradient sync, clip, optimizer), in "
           "`run.dir/profile-rank<R>.json`; 0: never. See docs/performance.md.");

  section(keys, "trainer.early_stopping",
          [](auto& c) -> auto& { return c.trainer.early_stopping; })
      .key(ST_FIELD(enabled), any("needs `trainer.eval_every` > 0 and `data.val_fraction` > 0"),
           "Stop when the monitored metric stops improving.")
      .key(ST_FIELD(monitor), non_empty("a metric name from the evaluation lines, e.g. eval_loss"),
           "A metric name from the evaluation lines.")
      .key(ST_FIELD(patience), at_least(1), "Evaluations without improvement before stopping.")
      .key(ST_FIELD(min_delta), not_below(0.0, "a number >= 0"),
           "Smallest change that counts as an improvement.")
      .key(ST_FIELD(mode), "Whether lower or higher is better.");
}

void declare_distributed(std::vector<Key>& keys) {
  // The fsdp keys are checked whatever the strategy, so a file stays valid
  // when the strategy is switched.
  section(keys, "distributed", [](auto& c) -> auto& { return c.distributed; })
      .key(ST_OPTION(strategy), "How ranks share the work; see below.")
      .auto_count(ST_OPTION(nproc_per_node),
                  "Ranks on this node; `auto`: the number of online CPUs (0 in the struct). With "
                  "`single`: `auto` or 1.")
      .key(ST_OPTION(bucket_cap_mb), above(0.0, "a number of MiB > 0"),
           "ddp: gradient bucket size in MiB.")
      .key(ST_OPTION(first_bucket_mb), above(0.0, "a number of MiB > 0"),
           "ddp: size of the first bucket in MiB, small so communication starts early.")
      .key(ST_OPTION(find_unused_parameters),
           "`true`: parameters without a gradient in a step are reduced as zeros; `false`: such a "
           "parameter is an error that names it.")
      .key(ST_OPTION(backend),
           "What moves the bytes between ranks: `gloo` (our rings over TCP between hosts, shared "
           "memory inside one), `mpi` (the MPI library of a job started by `mpirun` or `srun "
           "--mpi=pmix`), `auto`: mpi when an MPI launcher started the job, else gloo. See "
           "docs/multinode.md.")
      .key(ST_OPTION(threads_per_rank),
           in_range(0, kMaxThreadsPerRank,
                    str_cat("an integer in 0..", kMaxThreadsPerRank, "; 0: cores / local ranks")),
           "Intra-op threads per rank, for LibTorch and OpenBLAS alike; 0: cores / local ranks.")
      .key(ST_OPTION(reduce_dtype), one_of({DType::Fp32, DType::Bf16, DType::Fp16}),
           "dtype gradients are reduced in; bf16/fp16 halve the bytes moved and round once per "
           "ring hop. See [dtypes](#param_dtype-and-reduce_dtype-under-each-precision).")
      .key(ST_OPTION(param_dtype),
           "zero1, fsdp: dtype of the gathered (compute) copy of the parameters; `auto`: each "
           "parameter's own dtype. The sharded master copy keeps the parameter's own dtype. See "
           "[dtypes](#param_dtype-and-reduce_dtype-under-each-precision).")
      .key(ST_OPTION(sharding), "fsdp only: what is sharded; see below.")
      .key(ST_OPTION(auto_wrap_policy),
           "fsdp: which submodules become units (gathered and freed as a whole). `module_type`: "
           "modules whose type name ends with one of `wrap_module_types`; `size`: modules with "
           "children whose not-yet-wrapped parameters number at least `min_num_params` (children "
           "are considered before parents); `none`: one unit, the whole model. Parameters no unit "
           "claims belong to the root unit.")
      .key(ST_OPTION(wrap_module_types),
           rule([](const std::vector<std::string>& v) {
                  return std::none_of(v.begin(), v.end(),
                                      [](const std::string& t) { return t.empty(); });
                },
                "non-empty module type names (or their suffixes), e.g. [BlockImpl]",
                "non-empty names; at least one with `module_type`"),
           "fsdp, `module_type`: class names without namespaces, compared with `Module::name()` "
           "(e.g. `BlockImpl` matches `shardtrain::models::BlockImpl`, not `MLPBlockImpl`).")
      .key(ST_OPTION(min_num_params), at_least(1),
           "fsdp, `size`: parameters a module needs to become a unit.")
      .key(ST_OPTION(backward_prefetch),
           "fsdp: when to gather the next unit in backward: before computing the current unit's "
           "gradients (`backward_pre`, more overlap, one more unit in memory), after them "
           "(`backward_post`), or not ahead of time (`none`).")
      .key(ST_OPTION(forward_prefetch),
           "fsdp: gather the next unit while the current unit's forward runs.")
      .key(ST_OPTION(limit_all_gathers), at_least(1),
           "fsdp: unit all-gathers in flight at most, prefetches included; bounds the gathered "
           "memory.")
      .key(ST_OPTION(accumulation),
           "fsdp `full_shard`, `shard_grad_op`, `hybrid_shard`: how gradients are accumulated over "
           "the micro-steps of `batch.accumulate`; see below.")
      .key(ST_OPTION(memory_budget_mb),
           not_below(0.0, "a number of MiB >= 0; 0: MemAvailable divided by the local ranks"),
           "Memory one rank may use, in MiB, for `strategy: auto`, `shardtrain estimate` and the "
           "check that the model fits before it is built; 0: this machine's MemAvailable "
           "(`/proc/meminfo`) divided by the local ranks.")
      .auto_count(ST_OPTION(tensor_parallel),
                  "Ranks that split every layer (Megatron's tensor parallelism): the mesh's innermost "
                  "dimension, so its ranks share a host; 1: none. The model's heads and key/value heads "
                  "must divide by it; the data-parallel size is the world divided by it. `auto`: the "
                  "least degree at which `strategy` (for `auto`, any strategy) fits "
                  "`memory_budget_mb`, as `shardtrain estimate` shows. See docs/strategies.md.",
                  1024)
      .key(ST_OPTION(sequence_parallel),
           "With `tensor_parallel` > 1: norms, dropout and the residual stream hold 1/tp of the "
           "tokens between the parallel regions (`model.block_size` must divide by "
           "`tensor_parallel`).")
      .key(ST_OPTION(loss_parallel),
           "With `tensor_parallel` > 1: the loss is computed on vocabulary-sharded logits (no rank "
           "holds the whole vocabulary); `false` gathers the logits first.")
      .key(ST_OPTION(pipeline_parallel), in_range(1, 1024, "an integer in 1..1024; 1: no pipeline"),
           "Ranks the model's layers are cut over (pipeline parallelism): the mesh's outermost "
           "dimension, so stages are split across hosts first and only activations cross between "
           "them. The data-parallel size is the world divided by `tensor_parallel` x "
           "`pipeline_parallel`. The micro-batches of a step (`batch.accumulate`) flow through the "
           "stages. See docs/strategies.md.")
      .key(ST_OPTION(pipeline_schedule),
           "With `pipeline_parallel` > 1: the order of each stage's work: `gpipe` (every forward, "
           "then every backward), `1f1b` (one forward, one backward: at most `pipeline_parallel` "
           "micro-batches' activations per rank), `interleaved_1f1b` (`stages_per_rank` stages per "
           "rank, a smaller bubble), `zero_bubble` (1f1b with each backward split into its "
           "input-gradient and weight-gradient halves, the latter filling idle time).")
      .key(ST_OPTION(stages_per_rank), in_range(1, 64, "an integer in 1..64"),
           "`interleaved_1f1b`: stages each rank holds, rank r holding stages r, r + "
           "pipeline_parallel, ...; the micro-batches must make whole rounds of `pipeline_parallel`.")
      .key(ST_OPTION(pipeline_split),
           rule([](const std::vector<int64_t>& v) {
                  for (size_t i = 0; i < v.size(); ++i) {
                    if (v[i] < 1 || (i > 0 && v[i] <= v[i - 1])) return false;
                  }
                  return true;
                },
                "increasing decoder-layer indices >= 1 (the first layer of each stage after the first)",
                "increasing, each ≥ 1"),
           "With `pipeline_parallel` > 1: the first decoder layer of each stage after the first "
           "(one entry fewer than the stages); the embedding goes with the first stage, the final "
           "norm and head with the last. Empty: the cut whose largest stage holds the fewest "
           "parameters, the embedding and the head each counted as a layer.")
      .key(ST_OPTION(load_balance),
           "How each step's samples are split over the data-parallel ranks: `even` (equal "
           "micro-batches), or `measured`: in proportion to each rank's measured compute speed "
           "(ranks of unequal speed). The step's samples and the loss stay exactly those of `even`; "
           "see docs/strategies.md.")
      .key(ST_OPTION(rebalance_every), at_least(1),
           "`measured`: steps between re-plans of the shares.")
      .key(ST_OPTION(rebalance_gain), not_below(0.0, "a number >= 0, e.g. 0.05"),
           "`measured`: the least predicted step-time gain (0.05: 5%) for which the shares are "
           "re-planned, so that ranks of equal speed keep theirs.")
      .key(ST_OPTION(straggler_factor), above(1.0, "a number > 1, e.g. 1.5"),
           "`measured`: a rank whose speed stays this many times below the median is named in the "
           "log, once, with its host; its recovery too.")
      .key(ST_OPTION(shares),
           rule([](const std::vector<double>& v) {
                  return std::all_of(v.begin(), v.end(), [](double w) { return w > 0.0 && std::isfinite(w); });
                },
                "positive weights, one per data-parallel rank, e.g. [2, 1]", "each > 0"),
           "`measured`: each data-parallel rank's starting share of the batch (weights of any "
           "scale); empty: in proportion to the ranks' threads (`threads_per_rank`), so a 4-core "
           "and a 2-core host start at 2:1.");
}

void declare_checkpoint_precision(std::vector<Key>& keys) {
  section(keys, "checkpoint", [](auto& c) -> auto& { return c.checkpoint; })
      .key(ST_FIELD(every_n_steps), at_least(0),
           "Save every this many optimizer steps; 0: only at the end of training (and on a "
           "signal).")
      .key(ST_FIELD(every_n_minutes),
           not_below(0.0, "a number of minutes >= 0; 0 turns time-based saving off"),
           "Also save once this many minutes passed since the last save (any rank's clock); 0: off.")
      .key(ST_FIELD(keep), in_range(0, kMaxKeep, str_cat("an integer in 0..", kMaxKeep, "; 0 keeps all")),
           "Complete checkpoints kept: the newest `keep` (plus the best); torn ones are removed "
           "too. 0 keeps all.")
      .key(ST_FIELD(monitor), any("a metric of the evaluation lines, e.g. `eval_loss`"),
           "Keep the checkpoint of the best evaluation as well; a new best saves at once. `\"\"`: "
           "no best.")
      .key(ST_FIELD(mode), "Which value of `monitor` is best.")
      .key(ST_FIELD(resume), any("`\"\"`, `auto`, `never`, a checkpoint directory"),
           "`auto`: continue from the newest complete checkpoint of `run.dir` that loads (a "
           "damaged one is named in a warning and the previous one is used), or start fresh if "
           "there is none. A path: continue from that checkpoint (written at any world size, by "
           "any strategy). `\"\"`: start fresh, except after a launcher restart, which continues "
           "as `auto` does. `never`: always start fresh. At the same world size and strategy the "
           "continuation is bit-exact in fp32.")
      .key(ST_FIELD(save_on_signal),
           "On SIGTERM, SIGINT or SIGHUP (a closed terminal; not under nohup): finish the step, save, exit with 128 + the signal. `shardtrain "
           "train` gives its ranks 300 s for that before SIGKILL; under your own `shardtrain "
           "launch`, pass `--stop-grace` long enough for a step and a save.")
      .key(ST_FIELD(save_frozen_base),
           "LoRA runs with `model.init_from`: `false` leaves the frozen base out of every "
           "checkpoint, which records the base file's path, size and SHA-256 instead and is "
           "refused when that file changed; `true` copies the base into each checkpoint (needed "
           "to resume without the base file). Without `model.init_from` the base is always copied.")
      .key(ST_FIELD(export_max_shard_mb), above(0.0, "a number > 0, e.g. 5000 (5 GB)"),
           "The model a run exports (`<run.dir>/model`, a Hugging Face directory) is split into "
           "`model-0000k-of-0000n.safetensors` shards of at most this many MB with an index past it.");

  // fp16-mixed is a known name; whether this machine can run it (CUDA) is
  // decided when the precision plugin is created.
  section(keys, "", [](auto& c) -> auto& { return c; })
      .key(ST_FIELD(precision), "How forward and backward compute.");

  section(keys, "loss_scaler", [](auto& c) -> auto& { return c.loss_scaler; })
      .key(ST_OPTION(initial_scale_power),
           in_range(0, 64, "an integer in 0..64 (the first scale is 2^power)"),
           "The first scale is 2^power.")
      .key(ST_OPTION(loss_scale_window), at_least(1),
           "Clean steps since the last overflow before the scale doubles.")
      .key(ST_OPTION(hysteresis), at_least(1),
           "Overflows tolerated before the scale halves; a clean step refills it.")
      .key(ST_OPTION(min_loss_scale), above(0.0, "a number > 0"),
           "The scale never goes below this.")
      .key(ST_OPTION(max_skips_at_min), at_least(0),
           "Consecutive skipped steps at the minimum scale before training fails (each warns); 0: "
           "never fail.");
}

// LoRA fine-tuning (models/lora.h); one block so that it merges cleanly.
void declare_lora(std::vector<Key>& keys) {
  section(keys, "lora", [](auto& c) -> auto& { return c.lora; })
      .key(ST_OPTION(r), in_range(0, 65536, "an integer in 0..65536"),
           "Adapter rank; 0: no LoRA (full training). At most the width of every adapted layer.")
      .key(ST_OPTION(alpha), above(0.0, "a number > 0, e.g. 16"),
           "The adapters' output is scaled by `alpha / r`.")
      .key(ST_OPTION(dropout), fraction("a number in [0, 1)"),
           "Dropout on the adapters' input while training.")
      .key(ST_OPTION(target_modules),
           rule([](const std::vector<std::string>& v) {
                  return std::none_of(v.begin(), v.end(), [](const std::string& t) { return t.empty(); });
                },
                "a list of module names, e.g. [q_proj, v_proj]", "non-empty names"),
           "Linear layers to adapt: a layer whose path equals a name or ends with `.name`; `[]`: "
           "the model family's (gpt: c_attn, c_proj, c_fc; llama: q/k/v/o_proj, gate/up/down_proj).")
      .key(ST_OPTION(quantize),
           "Storage of the frozen base weights of adapted layers: fp32, int8 per output channel, "
           "or 4-bit NormalFloat in blocks of 64 (QLoRA); dequantized on the fly.")
      .key(ST_OPTION(double_quant), "nf4: quantize the block scales again (int8).")
      .key(ST_OPTION(train_bias), "`all`: every bias trains with the adapters; `none`: none.")
      .key(ST_OPTION(init_from), any("`\"\"` or a directory with adapter_model.safetensors"),
           "Continue from a saved adapter (PEFT layout, as a run writes to `<run.dir>/adapter`).");
}

}  // namespace

const std::vector<Key>& keys() {
  static const std::vector<Key> table = [] {
    std::vector<Key> k;
    declare_run_model_data(k);
    declare_optimization(k);
    declare_distributed(k);
    declare_checkpoint_precision(k);
    declare_lora(k);
    return k;
  }();
  return table;
}

const Key* find_key(const std::string& path) {
  for (const Key& k : keys()) {
    if (k.path == path) return &k;
  }
  return nullptr;
}

namespace {

using strategy::StrategyKind;

// The model's shape: heads that divide the width, rope factors in order.
void check_model(const Source& s, const ModelConfig& m) {
  s.require(m.n_embd % m.n_head == 0 || m.head_dim > 0, "model.n_embd", std::to_string(m.n_embd),
            str_cat("a multiple of model.n_head=", m.n_head,
                    " (each head gets n_embd / n_head channels; llama: or set model.head_dim)"),
            {"model.n_head"});
  s.require(m.n_kv_head == 0 || m.n_head % m.n_kv_head == 0, "model.n_kv_head",
            std::to_string(m.n_kv_head),
            str_cat("0 or a divisor of model.n_head=", m.n_head,
                    " (each key/value head serves n_head / n_kv_head query heads)"),
            {"model.n_head"});
  s.require(m.rope_scaling != train::RopeScaling::Llama3 ||
                m.rope_high_freq_factor > m.rope_low_freq_factor,
            "model.rope_high_freq_factor", format_double(m.rope_high_freq_factor),
            str_cat("a number > model.rope_low_freq_factor=", format_double(m.rope_low_freq_factor),
                    " with rope_scaling llama3"),
            {"model.rope_low_freq_factor", "model.rope_scaling"});
}

// A decaying schedule ends at or below the rate it starts from.
void check_schedule(const Source& s, const Config& c) {
  const ScheduleConfig& sc = c.schedule;
  if (sc.name != train::LrSchedule::Constant) {
    s.require(sc.min_lr <= c.optimizer.lr, "schedule.min_lr", format_double(sc.min_lr),
              str_cat("a number <= optimizer.lr=", format_double(c.optimizer.lr), " (the ",
                      enum_name(sc.name), " schedule decays from lr down to min_lr)"),
              {"optimizer.lr", "schedule.name"});
  }
}

// Early stopping needs evaluations, and data held out for them.
void check_early_stopping(const Source& s, const Config& c) {
  if (c.trainer.early_stopping.enabled) {
    s.require(c.trainer.eval_every > 0, "trainer.early_stopping.enabled", "true",
              "false while trainer.eval_every=0: early stopping needs evaluations; set "
              "trainer.eval_every > 0",
              {"trainer.eval_every"});
    s.require(c.data.val_fraction > 0.0, "trainer.early_stopping.enabled", "true",
              "false while data.val_fraction=0: early stopping needs held-out data",
              {"data.val_fraction"});
  }
}

// The strategy: how many processes it runs, and whether it keeps a separate copy.
void check_strategy(const Source& s, const DistributedConfig& d) {
  s.require(d.strategy() != StrategyKind::Single || d.nproc_per_node() <= 1,
            "distributed.nproc_per_node", std::to_string(d.nproc_per_node()),
            "auto or 1 with distributed.strategy=single (it runs one process); use "
            "strategy ddp, zero1, fsdp or auto for more ranks",
            {"distributed.strategy"});
  const bool separate_copy =
      d.strategy() != StrategyKind::Single && d.strategy() != StrategyKind::Ddp;
  s.require(d.param_dtype() == DType::Auto || separate_copy, "distributed.param_dtype",
            enum_name(d.param_dtype()),
            str_cat("auto with strategy ", enum_name(d.strategy()),
                    ": a separate gathered copy needs zero1 or fsdp (fsdp with sharding no_shard "
                    "is ddp through that path); or use precision bf16-mixed"),
            {"distributed.strategy"});
}

// Tensor parallelism: more than one process, on one host, over an even sequence shard.
void check_tensor_parallel(const Source& s, const Config& c) {
  const DistributedConfig& d = c.distributed;
  const int64_t tp = d.tensor_parallel();
  s.require(tp <= 1 || d.strategy() != StrategyKind::Single, "distributed.tensor_parallel",
            std::to_string(tp), "1 with distributed.strategy=single (one process); use ddp, zero1 or fsdp",
            {"distributed.strategy"});
  s.require(tp <= 1 || d.nproc_per_node() == 0 || d.nproc_per_node() % tp == 0, "distributed.tensor_parallel",
            std::to_string(tp),
            str_cat("a divisor of distributed.nproc_per_node=", d.nproc_per_node(),
                    ": a tensor-parallel group must share one host"),
            {"distributed.nproc_per_node"});
  s.require(tp <= 1 || !d.sequence_parallel() || c.model.block_size % tp == 0, "distributed.tensor_parallel",
            std::to_string(tp),
            str_cat("a divisor of model.block_size=", c.model.block_size,
                    " under sequence parallelism (each rank holds block_size / tensor_parallel tokens); or "
                    "set distributed.sequence_parallel: false"),
            {"model.block_size", "distributed.sequence_parallel"});
}

// Pipeline parallelism: more than one process, and stages the model can be cut into.
void check_pipeline_parallel(const Source& s, const Config& c) {
  const DistributedConfig& d = c.distributed;
  const int64_t pp = d.pipeline_parallel();
  s.require(pp <= 1 || d.strategy() != StrategyKind::Single, "distributed.pipeline_parallel",
            std::to_string(pp), "1 with distributed.strategy=single (one process); use ddp, zero1 or fsdp",
            {"distributed.strategy"});
  const int64_t stages = d.pipeline_stages();
  s.require(pp <= 1 || c.model.n_layer + 2 >= stages, "distributed.pipeline_parallel", std::to_string(pp),
            str_cat("at most model.n_layer + 2 = ", c.model.n_layer + 2,
                    " stages (the embedding, each layer and the head), here ", stages),
            {"model.n_layer", "distributed.stages_per_rank"});
  s.require(pp <= 1 || d.pipeline_split().empty() || static_cast<int64_t>(d.pipeline_split().size()) == stages - 1,
            "distributed.pipeline_split", str_cat(d.pipeline_split().size(), " entries"),
            str_cat(stages - 1, " entries (the first layer of each of the ", stages, " stages after the first)"),
            {"distributed.pipeline_parallel", "distributed.stages_per_rank"});
  s.require(pp <= 1 || d.pipeline_split().empty() || d.pipeline_split().back() < c.model.n_layer,
            "distributed.pipeline_split", std::to_string(d.pipeline_split().empty() ? 0 : d.pipeline_split().back()),
            str_cat("layer indices below model.n_layer=", c.model.n_layer), {"model.n_layer"});
}

// A base each rank quantizes on its own block has no whole quantized form
// to write: it is left out of checkpoints and read again from its file.
void check_quantized_base(const Source& s, const Config& c) {
  const int64_t tp = c.distributed.tensor_parallel();
  const bool quantized = c.lora.r() > 0 && c.lora.quantize() != models::LoraQuantize::None;
  s.require(tp <= 1 || !quantized || (!c.model.init_from.empty() && !c.checkpoint.save_frozen_base),
            "distributed.tensor_parallel", std::to_string(tp),
            str_cat("1 with lora.quantize=", enum_name(c.lora.quantize()),
                    " unless model.init_from names the base and checkpoint.save_frozen_base is false (each "
                    "rank quantizes its own block, so checkpoints reference the base file instead of holding it)"),
            {"lora.quantize", "model.init_from", "checkpoint.save_frozen_base"});
}

// module_type wrapping names at least one type.
void check_wrapping(const Source& s, const DistributedConfig& d) {
  s.require(d.auto_wrap_policy() != strategy::AutoWrapPolicy::ModuleType ||
                !d.wrap_module_types().empty(),
            "distributed.wrap_module_types", "[]",
            "at least one module type name with distributed.auto_wrap_policy=module_type, "
            "e.g. [BlockImpl]; for a single unit use auto_wrap_policy none",
            {"distributed.auto_wrap_policy"});
}

}  // namespace

void check_relations(const Source& s, const Config& c) {
  check_model(s, c.model);
  check_batch(s, c.batch);
  check_schedule(s, c);
  check_early_stopping(s, c);
  check_strategy(s, c.distributed);
  check_tensor_parallel(s, c);
  check_pipeline_parallel(s, c);
  check_quantized_base(s, c);
  check_wrapping(s, c.distributed);
}

}  // namespace shardtrain::config::detail
