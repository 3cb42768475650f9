// Ring all-gather, in place.
//
// In step s every rank forwards to its right neighbour the chunk it received
// in step s-1 (its own chunk in step 0), so after n-1 steps every rank holds
// every chunk and has sent (n-1)/n of the buffer. Every receive is posted up
// front straight into its final place, and a segment is forwarded as soon as
// it arrives, so the ring runs as a pipeline with no extra copies.
#include <gloo/context.h>
#include <gloo/transport/unbound_buffer.h>

#include <algorithm>

#include "comm/detail.h"

namespace shardtrain::comm::detail {

void ring_all_gather(const OpContext& oc, void* buf, int64_t numel, DType dtype) {
  const int n = oc.size;
  const int r = oc.rank;
  const int right = (r + 1) % n;
  const int left = (r + n - 1) % n;
  const size_t es = element_size(dtype);
  const auto mod = [n](int x) { return ((x % n) + n) % n; };
  const int64_t seg = std::max<int64_t>(1, oc.segment_bytes / static_cast<int64_t>(es));
  auto ub = oc.ctx->createUnboundBuffer(buf, std::max<size_t>(1, numel * es));
  int pending_sends = 0;

  // Step s receives chunk r-s-1 (the left neighbour's step-s send).
  for (int s = 0; s <= n - 2; ++s) {
    const ShardRange c = shard_range(numel, n, mod(r - s - 1));
    for (int64_t off = 0; off < c.count; off += seg) {
      oc.recv(*ub, left, oc.slot(s), (c.offset + off) * es, std::min(seg, c.count - off) * es);
    }
  }
  const ShardRange own = shard_range(numel, n, r);
  for (int64_t off = 0; off < own.count; off += seg, ++pending_sends) {
    oc.send(*ub, right, oc.slot(0), (own.offset + off) * es, std::min(seg, own.count - off) * es);
  }
  for (int s = 0; s <= n - 2; ++s) {
    const ShardRange c = shard_range(numel, n, mod(r - s - 1));
    for (int64_t off = 0; off < c.count; off += seg) {
      oc.wait_recv(*ub, left);
      if (s < n - 2) {
        oc.send(*ub, right, oc.slot(s + 1), (c.offset + off) * es, std::min(seg, c.count - off) * es);
        ++pending_sends;
      }
    }
  }
  for (; pending_sends > 0; --pending_sends) oc.wait_send(*ub, right);
}

}  // namespace shardtrain::comm::detail
