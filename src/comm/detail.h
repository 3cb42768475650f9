// Internals shared by the communicator and its algorithms. Not installed.
#pragma once

#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "shardtrain/comm/communicator.h"

namespace gloo {
class Context;
namespace transport {
class UnboundBuffer;
}
}  // namespace gloo

namespace shardtrain::comm::detail {

class ShmChannel;
class MpiComm;

/// Element types the algorithms move and reduce.
enum class DType { Float32, Float64, BFloat16, Float16, Int32, Int64 };
const char* to_string(DType dtype);
size_t element_size(DType dtype);

using Clock = std::chrono::steady_clock;

/// Scratch memory a group's collectives reuse from call to call, so the hot
/// path neither allocates nor page-faults fresh memory. Grows to the largest
/// request and stays; only the communication thread touches it.
class ScratchArena {
 public:
  /// Buffer number `index`, at least `bytes` long, valid until the next call.
  char* get(int index, size_t bytes) {
    if (index >= static_cast<int>(slots_.size())) slots_.resize(index + 1);
    Slot& slot = slots_[index];
    if (slot.size < bytes) {
      slot.data.reset(new char[bytes]);  // uninitialised: every byte is received first
      slot.size = bytes;
    }
    return slot.data.get();
  }

 private:
  struct Slot {
    std::unique_ptr<char[]> data;
    size_t size = 0;
  };
  std::vector<Slot> slots_;
};

/// Everything one running collective needs to move bytes and, when it fails,
/// to say exactly what failed.
struct OpContext {
  gloo::Context* ctx = nullptr;
  int rank = 0;
  int size = 1;
  const char* op = "";
  uint64_t seq = 0;
  const std::string* group_name = nullptr;
  const std::vector<int>* global_ranks = nullptr;
  // Ranks per node when the world spans several nodes (errors name the
  // peer's node), else 0.
  int ranks_per_node = 0;
  Clock::time_point deadline;
  int64_t segment_bytes = int64_t{1} << 20;
  // All-reduces of up to this many bytes go in one round where they would
  // take a ring (one_round_all_reduce).
  int64_t one_round_bytes = 0;
  ScratchArena* scratch = nullptr;
  // The group's shared-memory path when all its ranks are on this host (shm.h).
  ShmChannel* shm = nullptr;
  // The group's MPI communicator under the mpi backend (mpi.h); then ctx and
  // shm are null and every op goes through it.
  const MpiComm* mpi = nullptr;

  /// Phase of a multi-phase op (all_reduce: 0 reduce-scatter, 1 all-gather).
  uint32_t phase = 0;

  /// The same op on this rank's two levels when the group's all_reduce goes
  /// hierarchically (hierarchical.cpp): the ranks of this host, and the
  /// ranks with this rank's local index on every host. Null when flat.
  std::shared_ptr<const OpContext> host, cross;

  /// Slot for step `step` of this op's current phase; distinct per op and
  /// phase, so a message can only ever match the receive it was meant for.
  uint64_t slot(uint32_t step) const {
    return (seq << 24) | (uint64_t{phase} << 20) | (step & 0xFFFFF);
  }

  /// Posts a send of `nbytes` at byte `offset` of `buf` to group rank `peer`
  /// on `slot` (and a receive from it); failures become CommError.
  void send(gloo::transport::UnboundBuffer& buf, int peer, uint64_t slot, size_t offset,
            size_t nbytes) const;
  void recv(gloo::transport::UnboundBuffer& buf, int peer, uint64_t slot, size_t offset,
            size_t nbytes) const;

  /// Waits for one receive (send) completion on `buf`, expected from (to)
  /// group rank `peer`; turns gloo's errors and the deadline into
  /// CommError / TimeoutError naming op, seq, group, rank and peer.
  void wait_recv(gloo::transport::UnboundBuffer& buf, int peer) const;
  void wait_send(gloo::transport::UnboundBuffer& buf, int peer) const;

  /// The message of a CommError raised by this op, without the cause.
  std::string describe(int peer) const;
};

/// The byte count in environment variable `name`, or `fallback` when it is
/// unset or empty; ConfigError when it is not an integer of at least `least`.
int64_t byte_count_from_env(const char* name, int64_t fallback, int64_t least);

/// The first line of an exception's text (c10d appends a C++ stack trace).
std::string first_line(const std::exception& e);

/// Whether an error text from Gloo or c10d reports a deadline that passed.
bool mentions_timeout(const std::string& text);

/// Throws TimeoutError(text) when `cause` reports a timeout, else CommError(text).
[[noreturn]] void throw_comm_error(const std::exception& cause, const std::string& text);

/// dst[i] = a[i] (op) b[i] for n elements. Low-precision types are combined
/// in float32 and rounded once. With `avg_divisor` > 0 (the final hop of an
/// Avg reduction) the combined value is divided by it before rounding; Avg
/// otherwise combines as Sum.
void reduce(void* dst, const void* a, const void* b, int64_t n, DType dtype,
            ReduceOp op, int avg_divisor);

/// dst[i] = a[i] / divisor, rounded once: Avg on a single rank.
void divide(void* dst, const void* a, int64_t n, DType dtype, int divisor);

/// Ring reduce-scatter: `out` (count of this rank's shard) receives the
/// reduction of every rank's shard_range of `in` (numel elements). Avg
/// divides by `avg_divisor`, or by the ring's size when it is 0.
void ring_reduce_scatter(const OpContext& oc, const void* in, void* out, int64_t numel,
                         DType dtype, ReduceOp op, int avg_divisor = 0);

/// Ring all-gather in place: `buf` (numel elements) holds this rank's shard at
/// its shard_range; on return it holds every rank's shard.
void ring_all_gather(const OpContext& oc, void* buf, int64_t numel, DType dtype);

/// All-reduce in place in one round: every rank sends `buf` to every peer
/// and combines all contributions in rank order. Avg divides by
/// `avg_divisor`, or by the group's size when it is 0. For buffers of up to
/// oc.one_round_bytes, where a ring's 2(n-1) steps of latency cost more than
/// sending the buffer n-1 times. Uses oc.scratch slot 0.
void one_round_all_reduce(const OpContext& oc, void* buf, int64_t numel, DType dtype, ReduceOp op,
                          int avg_divisor = 0);
/// OpContext::one_round_bytes unless SHARDTRAIN_ONE_ROUND_BYTES says
/// otherwise (0 turns the path off).
constexpr int64_t kOneRoundBytes = int64_t{64} << 10;

/// All-reduce in place over the group's TCP connections: in one round up to
/// oc.one_round_bytes, else a ring reduce-scatter and all-gather. Avg as in
/// one_round_all_reduce.
void tcp_all_reduce(const OpContext& oc, void* buf, int64_t numel, DType dtype, ReduceOp op,
                    int avg_divisor = 0);

/// Pipelined chain broadcast from group rank `root` along root, root+1, ...
void chain_broadcast(const OpContext& oc, void* buf, int64_t numel, DType dtype, int root);

/// Where the parts of one all_to_all lie, in elements: send[j] the part of
/// the input for group rank j, recv[j] the part of the output from it. The
/// same `most` and `largest` on every rank (agree_all_to_all).
struct AllToAllPlan {
  std::vector<ShardRange> send, recv;
  int64_t most = 0;     // the largest part any rank sends any rank
  int64_t largest = 0;  // the largest input or output of any rank
};

/// All-gathers every rank's dtype, row width and splits (in rows) over the
/// group's own path and checks them, alike on every rank: InvalidArgument on
/// every rank, naming both ranks, when rank i's input_splits[j] differs from
/// rank j's output_splits[i], or row widths or dtypes differ. Uses phase 0.
AllToAllPlan agree_all_to_all(const OpContext& oc, DType dtype, int64_t row,
                              const std::vector<int64_t>& input_splits,
                              const std::vector<int64_t>& output_splits);

/// all_to_all over the group's TCP connections: every receive is posted
/// straight into its place in `out`, then the sends in the order rank+1,
/// rank+2, ... (so no two ranks start on the same peer); parts of zero
/// elements are skipped on both sides. `in` and `out` do not overlap.
void pairwise_all_to_all(const OpContext& oc, const void* in, void* out,
                         const AllToAllPlan& plan, DType dtype);

/// The two levels of a hierarchical group, as group ranks in group-rank
/// order: `host` the ranks on this rank's host, `cross` the ranks with this
/// rank's local index on every host.
struct Levels {
  std::vector<int> host, cross;
  int host_index = 0;   // this rank's host among the group's hosts
  int local_index = 0;  // this rank among its host's ranks
};

/// The levels of a group whose ranks (`global_ranks`, node = global /
/// ranks_per_node) sit on several hosts with the same k > 1 ranks on each;
/// nullopt for any other layout (one host, one rank per host, uneven hosts,
/// ranks_per_node 0).
std::optional<Levels> plan_levels(const std::vector<int>& global_ranks, int rank,
                                  int ranks_per_node);

/// Whether SHARDTRAIN_HIERARCHICAL allows hierarchical collectives: unset,
/// empty or "1" yes, "0" no; ConfigError otherwise.
bool hierarchical_from_env();

/// All-reduce in place through oc.host and oc.cross: reduce-scatter inside
/// the host, ring all-reduce of this rank's piece across hosts, all-gather
/// inside the host.
void hierarchical_all_reduce(const OpContext& oc, void* buf, int64_t numel, DType dtype,
                             ReduceOp op);

/// reduce_scatter and all_gather through oc.host and oc.cross, with the
/// world's shard_range(numel, W, rank) split; `in` and `out` as in
/// ring_reduce_scatter, and for all_gather `in` is this rank's shard and
/// `out` the whole buffer. They use oc.scratch slots 0 and 1.
void hierarchical_reduce_scatter(const OpContext& oc, const void* in, void* out, int64_t numel,
                                 DType dtype, ReduceOp op);
void hierarchical_all_gather(const OpContext& oc, const void* in, void* out, int64_t numel,
                             DType dtype);

}  // namespace shardtrain::comm::detail
