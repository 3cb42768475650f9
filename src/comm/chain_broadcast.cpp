// Pipelined chain broadcast.
//
// Ranks form a chain root, root+1, ..., root-1. Each segment is forwarded as
// soon as it arrives, so for large buffers every link carries the buffer once
// and the time approaches one buffer transfer, not log(n) or n of them.
#include <gloo/context.h>
#include <gloo/transport/unbound_buffer.h>

#include <algorithm>

#include "comm/detail.h"

namespace shardtrain::comm::detail {

void chain_broadcast(const OpContext& oc, void* buf, int64_t numel, DType dtype, int root) {
  const int n = oc.size;
  const int pos = (oc.rank - root + n) % n;  // place in the chain
  const int next = (oc.rank + 1) % n;
  const int prev = (oc.rank + n - 1) % n;
  const size_t es = element_size(dtype);
  const int64_t seg = std::max<int64_t>(1, oc.segment_bytes / static_cast<int64_t>(es));
  auto ub = oc.ctx->createUnboundBuffer(buf, std::max<size_t>(1, numel * es));
  const bool forwards = pos < n - 1;
  int pending_sends = 0;

  if (pos == 0) {
    for (int64_t off = 0; off < numel; off += seg, ++pending_sends) {
      oc.send(*ub, next, oc.slot(0), off * es, std::min(seg, numel - off) * es);
    }
  } else {
    for (int64_t off = 0; off < numel; off += seg) {
      oc.recv(*ub, prev, oc.slot(0), off * es, std::min(seg, numel - off) * es);
    }
    for (int64_t off = 0; off < numel; off += seg) {
      oc.wait_recv(*ub, prev);
      if (forwards) {
        oc.send(*ub, next, oc.slot(0), off * es, std::min(seg, numel - off) * es);
        ++pending_sends;
      }
    }
  }
  for (; pending_sends > 0; --pending_sends) oc.wait_send(*ub, next);
}

}  // namespace shardtrain::comm::detail
