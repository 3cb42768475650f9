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

namespace {

// One ring reduce-scatter's fixed geometry: this rank, its neighbours, the
// element size and the segment length every transfer is cut into.
struct Ring {
  const OpContext& oc;
  int64_t numel;
  DType dtype;
  int n, r, right, left;
  size_t es;
  int64_t seg;

  Ring(const OpContext& oc, int64_t numel, DType dtype)
      : oc(oc), numel(numel), dtype(dtype), n(oc.size), r(oc.rank), right((r + 1) % n),
        left((r + n - 1) % n), es(element_size(dtype)),
        seg(std::max<int64_t>(1, oc.segment_bytes / static_cast<int64_t>(es))) {}

  int mod(int x) const { return ((x % n) + n) % n; }
  // Chunk rank r receives in step s, and the one it sends (its right
  // neighbour's receive): chosen so that the last step delivers chunk r.
  int recv_chunk(int s) const { return mod(r - s - 2); }
  int send_chunk(int s) const { return mod(r - s - 1); }
};

// The ring's buffers and the sends still in flight from each.
struct RingBuffers {
  char* stage[2] = {nullptr, nullptr};
  char* incoming[2] = {nullptr, nullptr};
  std::unique_ptr<gloo::transport::UnboundBuffer> stage_ub[2], incoming_ub[2];
  char* input = nullptr;
  std::unique_ptr<gloo::transport::UnboundBuffer> input_ub;
  int pending_input_sends = 0;
  int pending_stage_sends[2] = {0, 0};
};

RingBuffers make_buffers(const Ring& ring, const void* in) {
  const OpContext& oc = ring.oc;
  const int n = ring.n;
  const int64_t max_chunk = shard_range(ring.numel, n, 0).count;

  // Two partial-sum buffers and two receive buffers, alternating by step, so
  // step s+1 can be receiving while step s's partial sums are still being
  // sent. Fewer rings need fewer: steps 0..n-3 stage, steps 0..n-2 receive.
  RingBuffers b;
  const size_t chunk_bytes = std::max<size_t>(1, max_chunk * ring.es);
  for (int i = 0; i < std::min(2, n - 1); ++i) {
    b.incoming[i] = oc.scratch->get(i, chunk_bytes);
    b.incoming_ub[i] = oc.ctx->createUnboundBuffer(b.incoming[i], chunk_bytes);
  }
  for (int i = 0; i < std::min(2, n - 2); ++i) {
    b.stage[i] = oc.scratch->get(2 + i, chunk_bytes);
    b.stage_ub[i] = oc.ctx->createUnboundBuffer(b.stage[i], chunk_bytes);
  }
  b.input = static_cast<char*>(const_cast<void*>(in));  // only read, never written
  b.input_ub = oc.ctx->createUnboundBuffer(b.input, std::max<size_t>(1, ring.numel * ring.es));
  return b;
}

void post_receives(const Ring& ring, RingBuffers& b, int s) {
  const int64_t count = shard_range(ring.numel, ring.n, ring.recv_chunk(s)).count;
  for (int64_t off = 0; off < count; off += ring.seg) {
    const int64_t len = std::min(ring.seg, count - off);
    ring.oc.recv(*b.incoming_ub[s % 2], ring.left, ring.oc.slot(s), off * ring.es,
                 len * ring.es);
  }
}

void drain(const Ring& ring, gloo::transport::UnboundBuffer& ub, int& pending) {
  for (; pending > 0; --pending) ring.oc.wait_send(ub, ring.right);
}

// Step 0: this rank's own slice of the chunk its neighbour starts with.
void send_own_slice(const Ring& ring, RingBuffers& b) {
  const ShardRange c = shard_range(ring.numel, ring.n, ring.send_chunk(0));
  for (int64_t off = 0; off < c.count; off += ring.seg, ++b.pending_input_sends) {
    const int64_t len = std::min(ring.seg, c.count - off);
    ring.oc.send(*b.input_ub, ring.right, ring.oc.slot(0), (c.offset + off) * ring.es,
                 len * ring.es);
  }
}

// Step s: reduces the chunk received from the left with this rank's input,
// segment by segment, into the partial-sum buffer (sent on right away) or,
// in the last step, into `out`.
void reduce_step(const Ring& ring, RingBuffers& b, void* out, int s, ReduceOp op,
                 int avg_divisor) {
  const int n = ring.n;
  const size_t es = ring.es;
  const bool last = s == n - 2;
  const int k = s % 2;
  const ShardRange c = shard_range(ring.numel, n, ring.recv_chunk(s));
  // The partial sums written now overwrite what step s-2 sent from here.
  if (!last) drain(ring, *b.stage_ub[k], b.pending_stage_sends[k]);
  char* dst = last ? static_cast<char*>(out) : b.stage[k];
  const int divisor = (last && op == ReduceOp::Avg) ? (avg_divisor > 0 ? avg_divisor : n) : 0;
  for (int64_t off = 0; off < c.count; off += ring.seg) {
    const int64_t len = std::min(ring.seg, c.count - off);
    ring.oc.wait_recv(*b.incoming_ub[k], ring.left);
    reduce(dst + off * es, b.input + (c.offset + off) * es, b.incoming[k] + off * es, len,
           ring.dtype, op, divisor);
    if (!last) {
      ring.oc.send(*b.stage_ub[k], ring.right, ring.oc.slot(s + 1), off * es, len * es);
      ++b.pending_stage_sends[k];
    }
  }
  // This receive buffer is consumed; it takes step s+2 next.
  if (s + 2 <= n - 2) post_receives(ring, b, s + 2);
}

}  // namespace

void ring_reduce_scatter(const OpContext& oc, const void* in, void* out, int64_t numel,
                         DType dtype, ReduceOp op, int avg_divisor) {
  const Ring ring(oc, numel, dtype);
  const int n = ring.n;
  RingBuffers b = make_buffers(ring, in);

  send_own_slice(ring, b);
  post_receives(ring, b, 0);
  if (n > 2) post_receives(ring, b, 1);

  for (int s = 0; s <= n - 2; ++s) reduce_step(ring, b, out, s, op, avg_divisor);
  drain(ring, *b.input_ub, b.pending_input_sends);
  for (int i = 0; i < 2; ++i) {
    if (b.stage_ub[i]) drain(ring, *b.stage_ub[i], b.pending_stage_sends[i]);
  }
}

}  // namespace shardtrain::comm::detail
