// What moves between pipeline stages: an activation forward, its gradient
// backward, each a tensor whose shape travels with it, so micro-batches of
// different lengths (packed or variable-length rows) flow through a
// pipeline without either side knowing the shape in advance.
//
// A message is a header (dtype, rank, sizes: 10 int64) on tag 2k and, for a
// non-empty tensor, the data on tag 2k + 1, through Communicator::send/recv
// (shared memory on one host, TCP or MPI between hosts). The receiver
// checks the header before it allocates: a dtype the Communicator does not
// carry (it carries float32/64, bf16, fp16, int32 and int64), more than 8
// dimensions, a negative size or a tensor larger than the cap is a
// CommError naming the sender, never an allocation of garbage. A sender
// that died is the Communicator's CommError within the op's deadline.
//
// A send may wait until its receiver takes it, and one communicator runs
// its point-to-point ops in the order issued: two ranks that both send
// first to each other on one communicator wait forever. A pipeline
// therefore moves activations and gradients on two communicators, one per
// direction; each direction is a chain of stages, which drains from its end.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "shardtrain/comm/communicator.h"

namespace shardtrain::parallel {

/// A send in flight: the tensors must live until wait() returns.
class StageSend {
 public:
  StageSend() = default;
  /// Blocks until every part went out; rethrows the Communicator's error.
  void wait();

 private:
  friend StageSend send_to_stage(comm::Communicator&, const at::Tensor&, int, uint32_t, comm::Timeout);
  at::Tensor header_, data_;
  std::vector<comm::Work> works_;
};

/// Sends `tensor` (any shape with at most 8 dimensions, any size including
/// 0; a contiguous copy is taken when it is not) to group rank `dst` as
/// message `tag` (< 2^31). Returns at once; wait() before reusing the tensor.
StageSend send_to_stage(comm::Communicator& comm, const at::Tensor& tensor, int dst, uint32_t tag,
                        comm::Timeout timeout = comm::Timeout(0));

/// Receives message `tag` from group rank `src`: a new tensor of the shape
/// and dtype the sender sent. `max_bytes` caps what a header may announce.
at::Tensor recv_from_stage(comm::Communicator& comm, int src, uint32_t tag, comm::Timeout timeout = comm::Timeout(0),
                           int64_t max_bytes = int64_t{1} << 34);

}  // namespace shardtrain::parallel
