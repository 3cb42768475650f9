// All-reduce of a small buffer in one round.
//
// A ring takes 2(n-1) steps, each a full network round trip however few
// bytes it carries: for a 1 KB buffer across hosts that latency is the whole
// cost. Here every rank sends its whole buffer to every peer at once and
// combines what arrives itself, so the op takes one round, at the price of
// sending (n-1) times the buffer instead of 2(n-1)/n of it: worth it below
// some tens of kilobytes. Every rank combines the contributions in the same
// order (rank 0, 1, ..., n-1), so every rank ends with the same bits.
// tcp_all_reduce chooses between it and the rings.
#include <gloo/context.h>
#include <gloo/transport/unbound_buffer.h>

#include <cstring>
#include <memory>
#include <vector>

#include "comm/detail.h"

namespace shardtrain::comm::detail {

void one_round_all_reduce(const OpContext& oc, void* buf, int64_t numel, DType dtype, ReduceOp op,
                          int avg_divisor) {
  const int n = oc.size;
  if (n == 1 || numel == 0) return;
  const size_t bytes = static_cast<size_t>(numel) * element_size(dtype);
  // Rank p's contribution lands in part p (this rank's own is copied there).
  char* parts = oc.scratch->get(0, bytes * static_cast<size_t>(n));
  const auto part = [&](int p) { return parts + static_cast<size_t>(p) * bytes; };
  std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> in(n), out(n);
  for (int p = 0; p < n; ++p) {
    if (p == oc.rank) continue;
    in[p] = oc.ctx->createUnboundBuffer(part(p), bytes);
    oc.recv(*in[p], p, oc.slot(0), 0, bytes);
  }
  for (int p = 0; p < n; ++p) {
    if (p == oc.rank) continue;
    out[p] = oc.ctx->createUnboundBuffer(buf, bytes);
    oc.send(*out[p], p, oc.slot(0), 0, bytes);
  }
  std::memcpy(part(oc.rank), buf, bytes);
  for (int p = 0; p < n; ++p) {
    if (p == oc.rank) continue;
    oc.wait_recv(*in[p], p);
  }
  // The sends read `buf`: done before it is overwritten.
  for (int p = 0; p < n; ++p) {
    if (p != oc.rank) oc.wait_send(*out[p], p);
  }
  for (int p = 1; p < n; ++p) {
    const int divisor = p == n - 1 && op == ReduceOp::Avg ? (avg_divisor > 0 ? avg_divisor : n) : 0;
    reduce(buf, p == 1 ? part(0) : buf, part(p), numel, dtype, op, divisor);
  }
}

void tcp_all_reduce(const OpContext& oc, void* buf, int64_t numel, DType dtype, ReduceOp op,
                    int avg_divisor) {
  const size_t es = element_size(dtype);
  if (numel * static_cast<int64_t>(es) <= oc.one_round_bytes) {
    return one_round_all_reduce(oc, buf, numel, dtype, op, avg_divisor);
  }
  char* all = static_cast<char*>(buf);
  const ShardRange mine = shard_range(numel, oc.size, oc.rank);
  ring_reduce_scatter(oc, all, all + mine.offset * es, numel, dtype, op, avg_divisor);
  OpContext gather = oc;
  gather.phase = 1;
  ring_all_gather(gather, all, numel, dtype);
}

}  // namespace shardtrain::comm::detail
