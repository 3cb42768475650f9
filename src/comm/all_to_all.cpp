// all_to_all: the agreement on counts every path shares, and the TCP path.
//
// A rank that expects fewer (or more) elements than its peer sends would,
// on any transport, read past its buffer or wait for bytes that never come.
// So every rank first all-gathers every rank's dtype, row width and splits
// (2n + 2 integers each) over the group's own path and checks the whole
// matrix: the same verdict on every rank, so either all of them move data
// or all of them throw the same error. Then each pair exchanges its two
// parts directly; a part of zero elements is skipped on both sides (both
// know it is empty), so a rank that receives nothing never waits for it.
#include <gloo/context.h>
#include <gloo/transport/unbound_buffer.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "comm/detail.h"
#include "comm/mpi.h"
#include "comm/shm.h"
#include "shardtrain/core/error.h"

namespace shardtrain::comm::detail {

using ::shardtrain::detail::str_cat;

namespace {

// Every rank's `fields` integers, rank after rank, over the group's path.
std::vector<int64_t> gather_fields(const OpContext& oc, const std::vector<int64_t>& mine) {
  const auto k = static_cast<int64_t>(mine.size());
  std::vector<int64_t> all(static_cast<size_t>(k * oc.size));
  std::copy(mine.begin(), mine.end(), all.begin() + oc.rank * k);
  if (oc.mpi != nullptr) {
    oc.mpi->all_gather(oc, all.data(), k * oc.size, DType::Int64);
  } else if (oc.shm != nullptr) {
    oc.shm->all_gather(oc, all.data(), k * oc.size, DType::Int64);
  } else {
    ring_all_gather(oc, all.data(), k * oc.size, DType::Int64);  // the full mesh, on any layout
  }
  return all;
}

// Offsets and counts in elements of `rows` parts of `row` elements each.
std::vector<ShardRange> parts(const int64_t* rows, int n, int64_t row) {
  std::vector<ShardRange> out(static_cast<size_t>(n));
  int64_t at = 0;
  for (int j = 0; j < n; ++j) {
    out[j] = {at * row, rows[j] * row};
    at += rows[j];
  }
  return out;
}

}  // namespace

AllToAllPlan agree_all_to_all(const OpContext& oc, DType dtype, int64_t row,
                              const std::vector<int64_t>& input_splits,
                              const std::vector<int64_t>& output_splits) {
  const int n = oc.size;
  const int64_t k = 2 * int64_t{n} + 2;  // dtype, row width, input splits, output splits
  std::vector<int64_t> mine{static_cast<int64_t>(dtype), row};
  mine.insert(mine.end(), input_splits.begin(), input_splits.end());
  mine.insert(mine.end(), output_splits.begin(), output_splits.end());
  const std::vector<int64_t> all = gather_fields(oc, mine);
  const auto field = [&](int r, int64_t f) { return all[static_cast<size_t>(r * k + f)]; };
  AllToAllPlan plan;
  for (int i = 0; i < n; ++i) {
    ST_CHECK(field(i, 0) == field(0, 0) && field(i, 1) == field(0, 1), InvalidArgument, oc.describe(i),
             ": all_to_all moves ", to_string(static_cast<DType>(field(0, 0))), " rows of ", field(0, 1),
             " elements on rank 0 but ", to_string(static_cast<DType>(field(i, 0))), " rows of ",
             field(i, 1), " on rank ", i, "; give every rank tensors of one dtype and row width");
    int64_t in_rows = 0, out_rows = 0;
    for (int j = 0; j < n; ++j) {
      const int64_t sent = field(i, 2 + j), expected = field(j, 2 + n + i);
      ST_CHECK(sent == expected, InvalidArgument, oc.describe(-1), ": all_to_all rank ", i, " sends rank ",
               j, " ", sent, " rows (its input_splits[", j, "]) but rank ", j, " expects ", expected,
               " (its output_splits[", i, "]); make each rank's output_splits the rows its peers send it");
      plan.most = std::max(plan.most, sent * row);
      in_rows += sent;
      out_rows += field(i, 2 + n + j);
    }
    plan.largest = std::max({plan.largest, in_rows * row, out_rows * row});
  }
  plan.send = parts(input_splits.data(), n, row);
  plan.recv = parts(output_splits.data(), n, row);
  return plan;
}

void pairwise_all_to_all(const OpContext& oc, const void* in, void* out, const AllToAllPlan& plan,
                         DType dtype) {
  const int n = oc.size, r = oc.rank;
  const size_t es = element_size(dtype);
  char* src = const_cast<char*>(static_cast<const char*>(in));  // only ever sent from
  char* dst = static_cast<char*>(out);
  const auto bytes = [es](const ShardRange& part) { return static_cast<size_t>(part.count) * es; };
  std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> recvs(n), sends(n);
  for (int s = 1; s < n; ++s) {
    const int from = (r - s + n) % n;
    const ShardRange part = plan.recv[from];
    if (part.count == 0) continue;
    recvs[from] = oc.ctx->createUnboundBuffer(dst + part.offset * es, bytes(part));
    oc.recv(*recvs[from], from, oc.slot(0), 0, bytes(part));
  }
  for (int s = 1; s < n; ++s) {
    const int to = (r + s) % n;
    const ShardRange part = plan.send[to];
    if (part.count == 0) continue;
    sends[to] = oc.ctx->createUnboundBuffer(src + part.offset * es, bytes(part));
    oc.send(*sends[to], to, oc.slot(0), 0, bytes(part));
  }
  if (plan.send[r].count > 0) {
    std::memcpy(dst + plan.recv[r].offset * es, src + plan.send[r].offset * es, bytes(plan.send[r]));
  }
  for (int s = 1; s < n; ++s) {
    const int from = (r - s + n) % n;
    if (recvs[from]) oc.wait_recv(*recvs[from], from);
  }
  for (int s = 1; s < n; ++s) {
    const int to = (r + s) % n;
    if (sends[to]) oc.wait_send(*sends[to], to);
  }
}

}  // namespace shardtrain::comm::detail
