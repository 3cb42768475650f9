// The language-model data of a training run, whatever its format: the one
// entry point the trainer's task calls (train/task.cpp).
//
//   tokens, text  windows of block_size + 1 tokens (WindowSampler); the last
//                 val_fraction of the tokens is held out
//   jsonl         records tokenized and masked (samples.h), laid into rows
//                 (packing.h), served by RowSampler; the last val_fraction
//                 of the records, whole, is held out
//
// Every rank calls make_lm_data with the same arguments and gets the same
// data; the batches obey WindowSampler's global-order contract.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "shardtrain/config/config.h"
#include "shardtrain/data/tokenizer.h"
#include "shardtrain/data/tokens.h"

namespace shardtrain::data {

/// What start-up reports about the data.
struct LmDataStats {
  std::string format;          // "tokens", "text" or "jsonl"
  int64_t train_samples = 0;   // records (jsonl) or windows (tokens, text)
  int64_t val_samples = 0;
  int64_t train_rows = 0;
  int64_t val_rows = 0;
  int64_t truncated = 0;       // jsonl: samples cut to the block (train and validation)
  int64_t dropped = 0;         // jsonl: samples left out
  int64_t untrained = 0;       // jsonl: records with no trained target (no assistant turn), left out
  double packing_efficiency = 1.0;  // share of training positions that are not padding
  int64_t max_token = -1;      // largest id in the data, to check against the vocabulary
  /// One line for the start-up log.
  std::string summary() const;
};

struct LmData {
  std::function<Batch(int64_t step, int64_t micro_step, int64_t micro_batch, int rank, int world)>
      train_batch;
  /// Rows [first, first + count) of a step's global batch (TrainTask::train_rows).
  std::function<Batch(int64_t step, int64_t first, int64_t count)> train_rows;
  /// Empty when val_fraction is 0. Index i wraps around the held-out rows.
  std::function<Batch(int64_t index, int64_t micro_batch, int rank, int world)> eval_batch;
  std::function<int64_t(int64_t step)> epoch_of;
  LmDataStats stats;
};

/// The data of `config` for a model of `block_size` positions. `eval_rows`
/// is the rows of one evaluation batch over all ranks (micro * world);
/// `model_dir` is where data.chat_template=auto looks (may be empty).
/// ConfigError names the file (and line) for anything wrong with the data.
LmData make_lm_data(const config::DataConfig& config, const Tokenizer& tokenizer,
                    int64_t block_size, int64_t global_batch, int64_t eval_rows, uint64_t seed,
                    const std::string& model_dir = "");

}  // namespace shardtrain::data
