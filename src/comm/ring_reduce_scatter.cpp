// Ring reduce-scatter.
//
// The buffer is cut into one chunk per rank (shard_range). In step s every
// rank sends one partially reduced chunk to its right neighbour and receives
// another from its left, so after n-1 steps rank r holds the full reduction
// of chunk r, and each rank has sent (n-1)/n of the buffer: the bandwidth
// lower bound. Step 0 sends straight from the input; later steps send the
// partial sums just computed, one segment at a time, so reducing segment k
// overlaps the transfer of segment k+1 and of the next step's first segments.
#include <gloo/context.h>
#include <gloo/transport/unbound_buffer.h>

#include <algorithm>

#include "comm/detail.h"

namespace shardtrain::comm::detail {

void ring_reduce_scatter(const OpContext& oc, const void* in, void* out, int64_t numel,
                         DType dtype, ReduceOp op, int avg_divisor) {
  const int n = oc.size;
  const int r = oc.rank;
  const int right = (r + 1) % n;
  const int left = (r + n - 1) % n;
  const size_t es = element_size(dtype);
  const auto mod = [n](int x) { return ((x % n) + n) % n; };
  // Chunk rank r receives in step s, and the one it sends (its right
  // neighbour's receive): chosen so that the last step delivers chunk r.
  const auto recv_chunk = [&](int s) { return mod(r - s - 2); };
  const auto send_chunk = [&](int s) { return mod(r - s - 1); };
  const int64_t seg = std::max<int64_t>(1, oc.segment_bytes / static_cast<int64_t>(es));
  const int64_t max_chunk = shard_range(numel, n, 0).count;

  // Two partial-sum buffers and two receive buffers, alternating by step, so
  // step s+1 can be receiving while step s's partial sums are still being
  // sent. Fewer rings need fewer: steps 0..n-3 stage, steps 0..n-2 receive.
  const size_t chunk_bytes = std::max<size_t>(1, max_chunk * es);
  char* stage[2] = {nullptr, nullptr};
  char* incoming[2] = {nullptr, nullptr};
  std::unique_ptr<gloo::transport::UnboundBuffer> stage_ub[2], incoming_ub[2];
  for (int i = 0; i < std::min(2, n - 1); ++i) {
    incoming[i] = oc.scratch->get(i, chunk_bytes);
    incoming_ub[i] = oc.ctx->createUnboundBuffer(incoming[i], chunk_bytes);
  }
  for (int i = 0; i < std::min(2, n - 2); ++i) {
    stage[i] = oc.scratch->get(2 + i, chunk_bytes);
    stage_ub[i] = oc.ctx->createUnboundBuffer(stage[i], chunk_bytes);
  }
  auto* input = static_cast<char*>(const_cast<void*>(in));  // only read, never written
  auto input_ub = oc.ctx->createUnboundBuffer(input, std::max<size_t>(1, numel * es));
  int pending_input_sends = 0;
  int pending_stage_sends[2] = {0, 0};

  const auto post_receives = [&](int s) {
    const int64_t count = shard_range(numel, n, recv_chunk(s)).count;
    for (int64_t off = 0; off < count; off += seg) {
      const int64_t len = std::min(seg, count - off);
      oc.recv(*incoming_ub[s % 2], left, oc.slot(s), off * es, len * es);
    }
  };
  const auto drain = [&](gloo::transport::UnboundBuffer& ub, int& pending) {
    for (; pending > 0; --pending) oc.wait_send(ub, right);
  };

  // Step 0: this rank's own slice of the chunk its neighbour starts with.
  {
    const ShardRange c = shard_range(numel, n, send_chunk(0));
    for (int64_t off = 0; off < c.count; off += seg, ++pending_input_sends) {
      const int64_t len = std::min(seg, c.count - off);
      oc.send(*input_ub, right, oc.slot(0), (c.offset + off) * es, len * es);
    }
  }
  post_receives(0);
  if (n > 2) post_receives(1);

  for (int s = 0; s <= n - 2; ++s) {
    const bool last = s == n - 2;
    const int b = s % 2;
    const ShardRange c = shard_range(numel, n, recv_chunk(s));
    // The partial sums written now overwrite what step s-2 sent from here.
    if (!last) drain(*stage_ub[b], pending_stage_sends[b]);
    char* dst = last ? static_cast<char*>(out) : stage[b];
    const int divisor = (last && op == ReduceOp::Avg) ? (avg_divisor > 0 ? avg_divisor : n) : 0;
    for (int64_t off = 0; off < c.count; off += seg) {
      const int64_t len = std::min(seg, c.count - off);
      oc.wait_recv(*incoming_ub[b], left);
      reduce(dst + off * es, input + (c.offset + off) * es, incoming[b] + off * es, len,
             dtype, op, divisor);
      if (!last) {
        oc.send(*stage_ub[b], right, oc.slot(s + 1), off * es, len * es);
        ++pending_stage_sends[b];
      }
    }
    // This receive buffer is consumed; it takes step s+2 next.
    if (s + 2 <= n - 2) post_receives(s + 2);
  }
  drain(*input_ub, pending_input_sends);
  for (int i = 0; i < 2; ++i) {
    if (stage_ub[i]) drain(*stage_ub[i], pending_stage_sends[i]);
  }
}

}  // namespace shardtrain::comm::detail
