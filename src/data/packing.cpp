// Laying samples into rows: one padded sample per row, or greedy packing.
#include "shardtrain/data/packing.h"

#include "shardtrain/core/error.h"

namespace shardtrain::data {

namespace {

// Opens a new row filled with padding.
void open_row(Rows& r, int64_t pad_id) {
  const auto n = static_cast<size_t>(r.block_size);
  r.input.insert(r.input.end(), n, pad_id);
  r.target.insert(r.target.end(), n, kIgnoreTarget);
  r.position.insert(r.position.end(), n, 0);
  r.segment.insert(r.segment.end(), n, kPadSegment);
  ++r.count;
}

}  // namespace

Rows build_rows(const std::vector<Sample>& samples, const std::vector<int64_t>& order,
                int64_t block_size, bool packing, Overlong overlong, int64_t pad_id) {
  ST_CHECK(block_size > 0, ConfigError, "model.block_size=", block_size, " must be positive");
  Rows r;
  r.block_size = block_size;
  int64_t used = block_size;  // positions filled in the current row; full: none open
  int64_t segment = 0;
  for (const int64_t index : order) {
    const Sample& s = samples.at(static_cast<size_t>(index));
    int64_t pairs = static_cast<int64_t>(s.ids.size()) - 1;
    if (pairs < 1 || (pairs > block_size && overlong == Overlong::Drop)) {
      ++r.dropped;
      continue;
    }
    if (pairs > block_size) {
      pairs = block_size;
      ++r.truncated;
    }
    if (!packing || used + pairs > block_size) {
      open_row(r, pad_id);
      used = 0;
      segment = 0;
    }
    const size_t base = static_cast<size_t>((r.count - 1) * block_size + used);
    for (int64_t i = 0; i < pairs; ++i) {
      const auto at = base + static_cast<size_t>(i);
      const auto next = static_cast<size_t>(i + 1);
      r.input[at] = s.ids[static_cast<size_t>(i)];
      r.target[at] = s.trained[next] ? s.ids[next] : kIgnoreTarget;
      r.position[at] = i;
      r.segment[at] = segment;
    }
    used += pairs;
    ++segment;
    ++r.samples;
    r.real_tokens += pairs;
  }
  return r;
}

}  // namespace shardtrain::data
