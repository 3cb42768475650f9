// Packing: samples laid into rows of block_size input positions.
//
// A sample of n ids gives n-1 (input, target) pairs: inputs ids[0..n-2],
// targets ids[1..n-1], a target the ignore index (-100) where not trained.
// A sample of more than block_size pairs is cut to block_size (Overlong::
// Truncate) or left out (Drop); a sample of fewer than 2 ids is left out.
//
// Without packing every sample is one row, padded at the end: input the pad
// id, target -100, segment -1, so no real token attends to padding (it comes
// after them) and padding attends only to padding. With packing the samples
// are laid greedily in the given order: a sample goes into the current row
// when it fits in what is left, else the row is closed (padded) and a new
// one begun (next-fit). Segments number the samples of a row 0, 1, ...;
// positions restart at 0 with each sample.
#pragma once

#include <cstdint>
#include <vector>

#include "shardtrain/data/choices.h"
#include "shardtrain/data/samples.h"

namespace shardtrain::data {

constexpr int64_t kPadSegment = -1;
constexpr int64_t kIgnoreTarget = -100;  // = train::kIgnoreIndex

/// Rows, row-major [rows, block_size].
struct Rows {
  int64_t block_size = 0;
  int64_t count = 0;
  std::vector<int64_t> input, target, position, segment;
  int64_t samples = 0;      // samples laid into rows
  int64_t truncated = 0;    // of them, cut to the block
  int64_t dropped = 0;      // left out: too long (Drop) or under two ids
  int64_t real_tokens = 0;  // non-padding positions
  /// Share of the positions that are not padding (0 with no rows).
  double efficiency() const {
    return count == 0 ? 0.0 : static_cast<double>(real_tokens) / static_cast<double>(count * block_size);
  }
};

/// Lays `samples[order[i]]` for i = 0.. into rows as described above.
Rows build_rows(const std::vector<Sample>& samples, const std::vector<int64_t>& order,
                int64_t block_size, bool packing, Overlong overlong, int64_t pad_id);

}  // namespace shardtrain::data
