// The MPI backend: a group's collectives through an MPI communicator.
//
// MPI does the rendezvous (the job was started by mpirun or srun) and picks
// its own transports (shared memory inside a host, TCP or a fast fabric
// between hosts). The algorithms above this file see the same contract as
// on the Gloo path:
//   - Collectives are MPI's non-blocking ones, started and then polled on the
//     group's communication thread until done or until the op's deadline,
//     which is a TimeoutError naming op, group and rank (MPI cannot cancel a
//     collective, so the group is broken afterwards, as on the Gloo path).
//   - Reductions are ours, registered as MPI operations over every dtype: the
//     same element-wise kernels as the rings (reduce.cpp), so bfloat16 and
//     float16 are combined in float32 and rounded once per combining step,
//     and a NaN wins max and min. Avg is a sum followed by one division, so a
//     low-precision avg rounds once more than on the Gloo path (where the
//     last hop divides before rounding).
//   - reduce_scatter and all_gather use shard_range's split as their counts.
//   - Reductions and broadcasts go in pieces of 8 MB (reduce_scatter as one
//     reduce per owner and piece), so that MPI's own scratch stays on the
//     heap instead of being mapped and faulted in afresh by every call.
//   - MPI counts are ints: reduce_scatter and all_gather refuse more than
//     2^31-1 elements in one call (an InvalidArgument saying so).
// MPI is initialised once per process with MPI_THREAD_MULTIPLE (the
// communication threads of several groups and the point-to-point waiter
// call it concurrently) and finalised at exit.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "comm/detail.h"

namespace shardtrain::comm::detail {

/// Whether an MPI launcher started this process (mpirun's or srun's PMIx
/// variables), which is when Backend::Auto chooses MPI.
bool started_by_mpi_launcher();

/// A posted point-to-point transfer, completed by MpiComm::wait.
struct MpiRequest;

class MpiComm {
 public:
  /// The world of this job: initialises MPI (once) and checks that MPI's rank
  /// and size are `rank` and `size` (the environment's); ConfigError when
  /// they differ or the library lacks MPI_THREAD_MULTIPLE.
  static std::unique_ptr<MpiComm> world(int rank, int size);
  ~MpiComm();
  MpiComm(const MpiComm&) = delete;
  MpiComm& operator=(const MpiComm&) = delete;

  /// The communicator of this rank's sub-group: every rank of this one calls
  /// it together (on its communication thread); null for non-members.
  std::unique_ptr<MpiComm> split(bool member, int key) const;

  void all_reduce(const OpContext& oc, void* buf, int64_t numel, DType dtype, ReduceOp op) const;
  void reduce_scatter(const OpContext& oc, const void* in, void* out, int64_t numel, DType dtype,
                      ReduceOp op) const;
  /// In place: `buf` holds this rank's shard_range and receives every rank's.
  void all_gather(const OpContext& oc, void* buf, int64_t numel, DType dtype) const;
  void broadcast(const OpContext& oc, void* buf, int64_t numel, DType dtype, int root) const;
  /// MPI_Alltoallv over the plan's parts; InvalidArgument (on every rank
  /// alike) when some rank's input or output is over 2^31-1 elements.
  void all_to_all(const OpContext& oc, const void* in, void* out, const AllToAllPlan& plan,
                  DType dtype) const;
  void barrier(const OpContext& oc) const;

  /// Posts a send (recv) of `nbytes` to (from) group rank `peer` with `tag`;
  /// InvalidArgument when the tag is above what this MPI allows.
  std::shared_ptr<MpiRequest> post(const OpContext& oc, void* buf, size_t nbytes, int peer,
                                   uint32_t tag, bool is_send) const;
  /// Waits for a posted transfer until `oc`'s deadline.
  void wait(const OpContext& oc, MpiRequest& request, int peer) const;

  /// "Open MPI v4.1.4 on host1" for the start-up line.
  std::string describe() const;

 private:
  struct Handle;
  explicit MpiComm(std::unique_ptr<Handle> handle);
  std::unique_ptr<Handle> handle_;
};

}  // namespace shardtrain::comm::detail
