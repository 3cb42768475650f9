// Serves built rows (packing.h) as micro-batches, with WindowSampler's
// global-order contract: epoch e visits the rows in a permutation drawn from
// (seed, e) (in order without shuffle); global batch s is rows
// [s*G, (s+1)*G) of that order, whatever the world size or the micro/
// accumulation split; rank k's micro-step j gets rows (j*W + k)*B .. +B of
// the step. An epoch is the largest whole number of global batches.
#pragma once

#include <cstdint>

#include "shardtrain/data/packing.h"
#include "shardtrain/data/tokens.h"

namespace shardtrain::data {

class RowSampler {
 public:
  /// Throws ConfigError naming `what` when there are fewer rows than G.
  RowSampler(const Rows& rows, int64_t global_batch, uint64_t seed, bool shuffle,
             const std::string& what);

  int64_t num_rows() const { return input_.size(0); }
  int64_t steps_per_epoch() const { return num_rows() / global_batch_; }
  int64_t epoch_of(int64_t step) const { return step / steps_per_epoch(); }

  /// The micro-batch of micro-step `micro_step` of step `step` for `rank`.
  Batch micro_batch(int64_t step, int64_t micro_step, int64_t micro_batch, int rank,
                    int world_size) const;
  /// Rows [first, first + count) of step `step`'s global batch, in the
  /// order of its micro-steps and ranks (micro_batch's rows are the even
  /// split of these); count 0 gives a batch of no rows.
  Batch step_rows(int64_t step, int64_t first, int64_t count) const;
  /// Rows [first, first + count) in stored order (evaluation).
  Batch rows(int64_t first, int64_t count) const;

 private:
  at::Tensor input_, target_, position_, segment_;
  int64_t global_batch_;
  uint64_t seed_;
  bool shuffle_;
  mutable int64_t cached_epoch_ = -1;
  mutable at::Tensor cached_order_;
};

}  // namespace shardtrain::data
