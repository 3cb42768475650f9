// Collective communication between the ranks of a job.
//
// A Communicator is a fixed group of ranks. Every collective takes flat,
// contiguous CPU tensors and a per-op options struct, and returns a Work.
// Collectives must be called by every rank of the group in the same order
// (they run in that order on one communication thread per communicator, so
// they overlap the caller's compute). Point-to-point send/recv involve only
// the two ranks and may be issued in any order.
//
// Algorithms (bandwidth-optimal, each in its own file under src/comm/):
//   reduce_scatter  ring, each rank sends (n-1)/n of the buffer
//   all_gather      ring, each rank sends (n-1)/n of the buffer
//   all_reduce      ring reduce-scatter then ring all-gather, 2(n-1)/n
//   broadcast       pipelined chain from the root
//   all_to_all      every rank sends each peer its own part directly (after
//                   an all-gather of every rank's counts, which are checked)
// A group whose ranks all share this host runs the first three, and
// all_to_all, through shared memory. A group over several hosts with k > 1 ranks on each runs
// them hierarchically: shared memory inside each host, then one ring per
// local rank index between hosts (each host sends 2(H-1)/H of the buffer
// instead of 2(W-1)/W, over all k ranks' connections), then shared memory
// again; SHARDTRAIN_HIERARCHICAL=0 keeps flat rings (docs/multinode.md).
// Large transfers are cut into segments (CommOptions::segment_bytes) so that
// the reduction of one segment overlaps the transfer of the next. That is the
// gloo backend; under the mpi backend (Backend, src/comm/mpi.h) MPI's own
// algorithms and transports run, with the same contract.
//
// Dtypes: float32, float64, bfloat16, float16, int32 and int64.
// Low-precision accumulation: bfloat16 and float16 sums are computed in
// float32 at each ring hop and rounded back to the tensor's dtype once per
// hop, so a reduction over n ranks rounds n-1 times; the hierarchical path
// rounds k-1 times inside a host and H-1 times between hosts, fewer. Avg
// divides the float32 value by n (the whole group's size) before the final
// rounding, once. Reduce in float32 (a reduce_dtype upstream) when that
// rounding matters.
//
// Errors: a collective that times out or loses a peer throws CommError (a
// TimeoutError for deadlines) from Work::wait(), naming the op, its sequence
// number, the group, this rank and the peer. After such an error the
// communicator is broken: every later call throws at once. World size 1 is a
// real communicator whose collectives are local copies.
#pragma once

#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "shardtrain/core/enum_names.h"
#include "shardtrain/core/options.h"

namespace c10 {
enum class ScalarType : int8_t;
}
namespace at {
class Tensor;
using c10::ScalarType;
}

namespace shardtrain::comm {

namespace detail {
class WorkState;
class Group;
}  // namespace detail

/// What moves the bytes. Gloo: our rings over TCP between hosts, shared
/// memory inside one. Mpi: the MPI library the job was started with
/// (mpirun, srun --mpi=pmix), with its own transports. Auto: Mpi when an MPI
/// launcher started this process, else Gloo. Chosen once, at create().
enum class Backend { Auto, Gloo, Mpi };
ST_ENUM_NAMES(Backend, {Backend::Auto, "auto"}, {Backend::Gloo, "gloo"}, {Backend::Mpi, "mpi"});

/// Reduction applied by all_reduce and reduce_scatter.
enum class ReduceOp { Sum, Avg, Max, Min };
const char* to_string(ReduceOp op);

/// 0 means "the communicator's default timeout".
using Timeout = std::chrono::milliseconds;

/// The slice of a flat buffer of `numel` elements that one rank owns when it
/// is split across `world_size` ranks: as even as possible, with the first
/// numel % world_size ranks holding one element more. reduce_scatter and
/// all_gather use exactly this split.
struct ShardRange {
  int64_t offset = 0;
  int64_t count = 0;
};
ShardRange shard_range(int64_t numel, int world_size, int rank);

struct AllReduceOptions {
  ST_ARG(ReduceOp, op) = ReduceOp::Sum;
  ST_ARG(Timeout, timeout) = Timeout(0);
  /// false: the call returns once the result is in place.
  ST_ARG(bool, async) = false;
};

struct ReduceScatterOptions {
  ST_ARG(ReduceOp, op) = ReduceOp::Sum;
  ST_ARG(Timeout, timeout) = Timeout(0);
  ST_ARG(bool, async) = false;
};

struct AllGatherOptions {
  ST_ARG(Timeout, timeout) = Timeout(0);
  ST_ARG(bool, async) = false;
};

struct BroadcastOptions {
  ST_ARG(int, root) = 0;
  ST_ARG(Timeout, timeout) = Timeout(0);
  ST_ARG(bool, async) = false;
};

struct AllToAllOptions {
  ST_ARG(Timeout, timeout) = Timeout(0);
  ST_ARG(bool, async) = false;
};

struct BarrierOptions {
  ST_ARG(Timeout, timeout) = Timeout(0);
};

struct P2POptions {
  /// Matches a send with a recv between the same two ranks; 0 .. 2^32-1.
  ST_ARG(uint32_t, tag) = 0;
  ST_ARG(Timeout, timeout) = Timeout(0);
};

/// Handle to an issued operation. Copyable; all copies share one state.
class Work {
 public:
  Work() = default;
  explicit Work(std::shared_ptr<detail::WorkState> state);

  /// Blocks until the operation finished; rethrows its error (CommError).
  void wait() const;
  /// True once the operation finished, successfully or not. Never blocks.
  bool is_completed() const;
  /// The stored error of a finished operation, or null.
  std::exception_ptr exception() const;

 private:
  std::shared_ptr<detail::WorkState> state_;
};

/// How to create a communicator. Defaults come from the environment
/// (ClusterEnv::detect(), SHARDTRAIN_TIMEOUT_S, SHARDTRAIN_INIT_METHOD).
struct CommOptions {
  /// Options filled from the process environment (torchrun, SLURM, OpenMPI
  /// variables; SHARDTRAIN_TIMEOUT_S, SHARDTRAIN_INIT_METHOD,
  /// SHARDTRAIN_SEGMENT_BYTES). Throws ConfigError on bad values.
  static CommOptions from_env();

  /// SHARDTRAIN_BACKEND: auto, gloo or mpi.
  ST_ARG(Backend, backend) = Backend::Auto;
  /// "env://" (TCP store at master_addr:master_port, hosted by the launcher
  /// or by rank 0), or "file:///path/to/store" (a file every rank can reach).
  ST_ARG(std::string, init_method) = "env://";
  ST_ARG(int, rank) = 0;
  ST_ARG(int, world_size) = 1;
  ST_ARG(std::string, master_addr) = "127.0.0.1";
  ST_ARG(int, master_port) = 29500;
  /// Default deadline of every op and of the rendezvous (10 minutes;
  /// SHARDTRAIN_TIMEOUT_S).
  ST_ARG(Timeout, timeout) = std::chrono::minutes(10);
  /// The secret that admits a process to the job's store (SHARDTRAIN_JOB_TOKEN,
  /// set by the launcher); empty admits anyone.
  ST_ARG(std::string, job_token) = "";
  /// "address:port" of the store the launcher hosts (SHARDTRAIN_STORE): every
  /// rank connects to it. Empty: rank 0 hosts one at master_addr:master_port.
  ST_ARG(std::string, store) = "";
  /// The restart round (SHARDTRAIN_RESTART_COUNT): keeps the keys of earlier
  /// rounds in a store that outlives them apart from this one's.
  ST_ARG(int, round) = 0;
  /// Largest message of a ring step; smaller values exercise the
  /// multi-segment paths in tests.
  ST_ARG(int64_t, segment_bytes) = int64_t{1} << 20;
};

class Communicator : public std::enable_shared_from_this<Communicator> {
 public:
  /// Joins the group: every rank of the world calls this with matching options.
  /// Throws TimeoutError when the other ranks do not arrive within the timeout,
  /// ConfigError for bad options.
  static std::shared_ptr<Communicator> create(const CommOptions& options);

  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  /// This rank within the group, 0 .. size()-1.
  int rank() const;
  int size() const;
  /// "world", or "group1[0,2]" for sub-groups; used in error messages.
  const std::string& name() const;
  /// Global (world) rank of each member, indexed by group rank.
  const std::vector<int>& global_ranks() const;
  /// The interface and address this rank's connections use and how they
  /// were chosen, e.g. "eth0 10.0.0.2 (routes to 10.0.0.1)"; empty for a
  /// world of one.
  std::string endpoint() const;
  /// Collectives issued so far on this communicator.
  uint64_t sequence_number() const;
  /// Seconds the communication thread has spent running collectives so far
  /// (transfers, reductions and waiting for peers); with the time the caller
  /// waited on Work, it tells how much communication compute hid.
  double busy_seconds() const;
  /// The large collectives on this host's shared memory (all_reduce,
  /// reduce_scatter and all_gather of 256 KB or more): how many read and
  /// wrote the peers' buffers in place (every rank's from allocate(), at the
  /// same place) and how many were staged through the channel. Both zero
  /// without the shared-memory path; counted so that a path that silently
  /// always falls back shows (the strategies' comm_stats, the metrics).
  struct PathCounts {
    int64_t in_place = 0;
    int64_t staged = 0;
  };
  PathCounts path_counts() const;

  /// A zero-filled flat tensor of `numel` elements for collectives to work
  /// on in place; every rank of the group calls it together, with the same
  /// arguments, as it calls a collective. Where all the group's ranks are on
  /// this host (the shared-memory path), all of them map its memory: an
  /// all_reduce of it, or of the same slice of it on every rank, of at least
  /// 256 KB combines each rank's shard straight from the peers' tensors and
  /// writes the result into theirs, with no staging copies (as registered
  /// buffers do in GPU collective libraries); a reduce_scatter whose input,
  /// or an all_gather whose output, is such memory reads the peers' parts
  /// where they are. Anywhere else (ranks on
  /// several hosts, the mpi backend, SHARDTRAIN_SHM=0, a /dev/shm without
  /// room for it) it is an ordinary tensor. Either way every collective
  /// takes it like any other tensor. Peak RSS then counts the pages of the
  /// peers' tensors this rank reads and writes (they are shared, not extra
  /// memory). Throws InvalidArgument for a negative numel or a dtype the
  /// collectives do not move.
  at::Tensor allocate(int64_t numel, at::ScalarType dtype);

  /// In place: every rank ends with the reduction of all ranks' tensors.
  Work all_reduce(const at::Tensor& tensor, const AllReduceOptions& options = {});
  /// `input` has N elements on every rank; `output` receives the reduction of
  /// this rank's shard_range(N, size(), rank()), so it has that many elements.
  /// `input` is left unchanged.
  Work reduce_scatter(const at::Tensor& input, const at::Tensor& output,
                      const ReduceScatterOptions& options = {});
  /// `input` holds this rank's shard_range(N, size(), rank()) of `output`
  /// (N elements on every rank); every rank ends with all shards in `output`.
  /// `input` may alias its slice of `output`.
  Work all_gather(const at::Tensor& input, const at::Tensor& output,
                  const AllGatherOptions& options = {});
  /// Every rank sends a part of `input` to every rank (itself included) and
  /// receives one part from each into `output`, as
  /// torch.distributed.all_to_all_single does (the token dispatch of
  /// mixture-of-experts layers). Splits count rows along dim 0 (elements of a
  /// 1-D tensor); a row is everything after dim 0, the same width in `input`
  /// and `output`. Rows [sum(input_splits[:j]), + input_splits[j]) of
  /// `input` go to group rank j, and the part from rank j lands at row
  /// sum(output_splits[:j]) of `output`. Both splits have size() entries,
  /// none negative, summing to their tensor's rows; input_splits[j] on rank i
  /// must equal output_splits[i] on rank j. The counts are all-gathered
  /// first (one small extra round) and checked on every rank: where they
  /// disagree every rank throws the same InvalidArgument (naming both ranks
  /// and counts) from wait(), and the group is then broken, as after any
  /// failed collective. Parts of zero rows are never sent. `input` and
  /// `output` must not overlap; both contiguous, of the same dtype, and must
  /// stay alive until the Work completes. The group's path: MPI_Alltoallv
  /// under mpi (at most 2^31-1 elements per tensor), shared memory on one
  /// host, else every pair directly over TCP, on several hosts too.
  Work all_to_all(const at::Tensor& input, std::vector<int64_t> input_splits,
                  const at::Tensor& output, std::vector<int64_t> output_splits,
                  const AllToAllOptions& options = {});
  /// In place: every rank ends with the root's tensor.
  Work broadcast(const at::Tensor& tensor, const BroadcastOptions& options = {});
  /// Returns once every rank has entered the barrier.
  void barrier(const BarrierOptions& options = {});

  /// Sends `tensor` to group rank `dst`. The tensor must stay alive and
  /// unchanged until the returned Work completes.
  Work send(const at::Tensor& tensor, int dst, const P2POptions& options = {});
  /// Receives into `tensor` from group rank `src` (same numel and dtype).
  Work recv(const at::Tensor& tensor, int src, const P2POptions& options = {});

  /// A communicator over the listed group ranks (sorted, unique). Every rank
  /// of this communicator must call it, in the same order relative to other
  /// new_group calls; ranks not listed get nullptr.
  std::shared_ptr<Communicator> new_group(std::vector<int> ranks);

 private:
  explicit Communicator(std::unique_ptr<detail::Group> group);
  std::unique_ptr<detail::Group> group_;
};

}  // namespace shardtrain::comm
