// What the Trainer trains: a TrainTask names the model, how to get a
// micro-batch and how to score it. make_task() builds one for the built-in
// models (GPT on token data, MLP on synthetic data) from the config.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>

#include "shardtrain/config/config.h"
#include "shardtrain/data/tokens.h"
#include "shardtrain/train/callback.h"

namespace torch::nn {
class Module;
}
namespace shardtrain::checkpoint {
class CheckpointReader;
}
namespace shardtrain::models {
struct GPTConfig;
}

namespace shardtrain::train {

struct TrainTask {
  /// The model; its parameters are trained in place.
  std::shared_ptr<torch::nn::Module> model;
  /// Summed loss over the targets of one micro-batch (a scalar with a
  /// graph), e.g. cross entropy with reduction sum and an ignore index.
  std::function<at::Tensor(const data::Batch&)> loss_sum;
  /// The same from the model's logits (a language model's last pipeline
  /// stage computes them; the loss is taken there). Empty: the task cannot
  /// be pipelined.
  std::function<at::Tensor(const at::Tensor& logits, const data::Batch&)> logits_loss_sum;
  /// Targets that loss_sum sums over (tokens not equal to the ignore index).
  /// The trainer divides by the count over the whole accumulation window on
  /// all ranks, so uneven or padded micro-batches give the big-batch gradient.
  std::function<int64_t(const data::Batch&)> count_targets;
  /// Micro-batch `micro_step` of optimizer step `step` for `rank` of `world`.
  /// The union over micro-steps and ranks must be the step's global batch.
  std::function<data::Batch(int64_t step, int64_t micro_step, int64_t micro_batch, int rank,
                            int world)>
      train_batch;
  /// Rows [first, first + count) of optimizer step `step`'s global batch
  /// (count may be 0: a batch of no rows), in the order train_batch's
  /// micro-steps and ranks take them. Empty: the task serves only even
  /// splits (distributed.load_balance: measured is refused).
  std::function<data::Batch(int64_t step, int64_t first, int64_t count)> train_rows;
  /// Evaluation micro-batch `index` for `rank`; empty: no evaluation.
  std::function<data::Batch(int64_t index, int64_t micro_batch, int rank, int world)> eval_batch;
  /// Epoch of a step; empty: always epoch 0.
  std::function<int64_t(int64_t step)> epoch_of;
  /// The model's auxiliary loss of the last loss_sum (models::CausalLMImpl::
  /// auxiliary_loss); empty or undefined: none. The trainer logs its mean
  /// over the step's forwards as aux_loss and, with aux_loss_weight > 0,
  /// adds weight * that mean to the training loss.
  std::function<at::Tensor()> aux_loss;
  double aux_loss_weight = 0.0;
  /// Tokens in one sample, for tokens/s (block_size for language models).
  int64_t tokens_per_sample = 1;
  /// Extra fields of every metrics line (e.g. the model's parameter count).
  Metrics static_metrics;
};

/// The task for the config's model: a language model of any family on the
/// config's data (data::make_lm_data: tokens, text or JSON-lines samples,
/// split by data.val_fraction) or an MLP on a synthetic regression set. The same seed gives the same initial weights on every rank;
/// `world_size` fixes the batch plan the data order is built for.
TrainTask make_task(const config::Config& config, int world_size);

/// The run's model directory: model.init_from when it names a directory (a
/// Hugging Face model, whose tokenizer and chat template live there), else "".
std::string model_dir(const config::Config& config);

/// The GPT described by the config's model section.
models::GPTConfig gpt_config(const config::ModelConfig& model);

/// Fills `model`, freshly built from `config` (the config the checkpoint's
/// training state records), with the Trainer checkpoint `reader` opened.
/// For a LoRA run it first loads model.init_from and attaches the adapters
/// as the Trainer does; a checkpoint that references its frozen base instead
/// of holding it is checked against that file. CheckpointError names what
/// is missing or differs.
void load_trained_model(torch::nn::Module& model, const config::Config& config,
                        checkpoint::CheckpointReader& reader);

/// Target id the built-in losses skip (padding), as in PyTorch.
constexpr int64_t kIgnoreIndex = -100;

/// Counts the targets of a batch that are not kIgnoreIndex.
int64_t count_non_ignored(const data::Batch& batch);

}  // namespace shardtrain::train
