// RowSampler: rows in a fixed global order, sliced per rank and micro-step.
#include "shardtrain/data/row_sampler.h"

#include <torch/torch.h>

#include "shardtrain/core/error.h"
#include "shuffle.h"

namespace shardtrain::data {

namespace {

at::Tensor to_tensor(const std::vector<int64_t>& v, int64_t rows, int64_t cols) {
  return torch::tensor(at::ArrayRef<int64_t>(v), torch::kLong).view({rows, cols});
}

}  // namespace

RowSampler::RowSampler(const Rows& rows, int64_t global_batch, uint64_t seed, bool shuffle,
                       const std::string& what)
    : global_batch_(global_batch), seed_(seed), shuffle_(shuffle) {
  ST_CHECK(global_batch > 0, ConfigError, "global batch size ", global_batch,
           " must be positive; hint: set batch.global");
  ST_CHECK(rows.count >= global_batch, ConfigError, what, " gives ", rows.count,
           " rows of block_size ", rows.block_size, " (", rows.samples, " samples, ",
           rows.dropped, " dropped), fewer than one global batch (batch.global) of ",
           global_batch, "; hint: use more data or a smaller global batch");
  input_ = to_tensor(rows.input, rows.count, rows.block_size);
  target_ = to_tensor(rows.target, rows.count, rows.block_size);
  position_ = to_tensor(rows.position, rows.count, rows.block_size);
  segment_ = to_tensor(rows.segment, rows.count, rows.block_size);
}

Batch RowSampler::micro_batch(int64_t step, int64_t micro_step, int64_t micro_batch, int rank,
                              int world_size) const {
  ST_CHECK(step >= 0 && micro_batch > 0 && world_size > 0 && rank >= 0 && rank < world_size &&
               micro_step >= 0 && (micro_step + 1) * world_size * micro_batch <= global_batch_,
           InvalidArgument, "RowSampler::micro_batch: step ", step, ", micro-step ", micro_step,
           ", micro_batch ", micro_batch, ", rank ", rank, " of ", world_size,
           " is not a split of the global batch ", global_batch_);
  return step_rows(step, (micro_step * world_size + rank) * micro_batch, micro_batch);
}

Batch RowSampler::step_rows(int64_t step, int64_t first, int64_t count) const {
  ST_CHECK(step >= 0 && first >= 0 && count >= 0 && first + count <= global_batch_, InvalidArgument,
           "RowSampler::step_rows: rows [", first, ", ", first + count, ") of step ", step,
           " are outside its global batch of ", global_batch_);
  const int64_t epoch = epoch_of(step);
  const int64_t start = (step % steps_per_epoch()) * global_batch_ + first;
  at::Tensor index = torch::arange(start, start + count, torch::kLong);
  if (shuffle_) {
    if (cached_epoch_ != epoch) {
      const std::vector<int64_t> order = detail::permutation(num_rows(), seed_, epoch);
      cached_order_ = torch::tensor(at::ArrayRef<int64_t>(order), torch::kLong);
      cached_epoch_ = epoch;
    }
    index = cached_order_.index_select(0, index);
  }
  return Batch{input_.index_select(0, index), target_.index_select(0, index),
               position_.index_select(0, index), segment_.index_select(0, index)};
}

Batch RowSampler::rows(int64_t first, int64_t count) const {
  ST_CHECK(first >= 0 && count > 0 && first + count <= num_rows(), InvalidArgument,
           "RowSampler::rows [", first, ", ", first + count, ") is outside [0, ", num_rows(), ")");
  return Batch{input_.narrow(0, first, count), target_.narrow(0, first, count),
               position_.narrow(0, first, count), segment_.narrow(0, first, count)};
}

}  // namespace shardtrain::data
