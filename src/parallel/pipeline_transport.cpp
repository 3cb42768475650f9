// Tensors with their shapes between pipeline stages (pipeline_transport.h).
#include "shardtrain/parallel/pipeline_transport.h"

#include <ATen/ATen.h>

#include "shardtrain/core/error.h"

namespace shardtrain::parallel {

namespace {

constexpr int kMaxDims = 8;
constexpr int64_t kHeader = 2 + kMaxDims;  // dtype, rank, sizes
constexpr uint32_t kMaxTag = uint32_t{1} << 31;

// The dtypes a stage boundary carries (the Communicator's): activations and
// their gradients, token ids and positions.
bool carried(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
    case at::kBFloat16:
    case at::kHalf:
    case at::kDouble:
    case at::kLong:
    case at::kInt:
      return true;
    default:
      return false;
  }
}

}  // namespace

void StageSend::wait() {
  for (const comm::Work& w : works_) w.wait();
  works_.clear();
}

StageSend send_to_stage(comm::Communicator& comm, const at::Tensor& tensor, int dst, uint32_t tag,
                        comm::Timeout timeout) {
  ST_CHECK(tag < kMaxTag, InvalidArgument, "send_to_stage: tag ", tag, " must be below 2^31");
  ST_CHECK(tensor.dim() <= kMaxDims && carried(tensor.scalar_type()), InvalidArgument,
           "send_to_stage: a ", tensor.dim(), "-dimensional ", tensor.scalar_type(),
           " tensor; a stage boundary carries at most ", kMaxDims, " dimensions of float, bf16, half, double, "
           "int64 or int32");
  StageSend s;
  s.header_ = at::zeros({kHeader}, at::kLong);
  int64_t* h = s.header_.data_ptr<int64_t>();
  h[0] = static_cast<int64_t>(tensor.scalar_type());
  h[1] = tensor.dim();
  for (int64_t d = 0; d < tensor.dim(); ++d) h[2 + d] = tensor.size(d);
  const auto options = comm::P2POptions().timeout(timeout);
  s.works_.push_back(comm.send(s.header_, dst, comm::P2POptions(options).tag(2 * tag)));
  if (tensor.numel() > 0) {
    s.data_ = tensor.contiguous();
    s.works_.push_back(comm.send(s.data_, dst, comm::P2POptions(options).tag(2 * tag + 1)));
  }
  return s;
}

at::Tensor recv_from_stage(comm::Communicator& comm, int src, uint32_t tag, comm::Timeout timeout,
                           int64_t max_bytes) {
  ST_CHECK(tag < kMaxTag, InvalidArgument, "recv_from_stage: tag ", tag, " must be below 2^31");
  const auto options = comm::P2POptions().timeout(timeout);
  const at::Tensor header = at::empty({kHeader}, at::kLong);
  comm.recv(header, src, comm::P2POptions(options).tag(2 * tag)).wait();
  const int64_t* h = header.data_ptr<int64_t>();
  const auto what = [&] { return detail::str_cat("pipeline message ", tag, " from rank ", src); };
  ST_CHECK(h[0] >= 0 && h[0] < static_cast<int64_t>(at::ScalarType::NumOptions) &&
               carried(static_cast<at::ScalarType>(h[0])) && h[1] >= 0 && h[1] <= kMaxDims,
           CommError, what(), " has a header this build does not send (dtype code ", h[0], ", ", h[1],
           " dimensions): the ranks run different builds, or the stream is out of step");
  const auto dtype = static_cast<at::ScalarType>(h[0]);
  std::vector<int64_t> sizes(h + 2, h + 2 + h[1]);
  // Counted in doubles: sizes near 2^63 must not wrap into a small product.
  double bytes = static_cast<double>(at::elementSize(dtype));
  for (const int64_t n : sizes) {
    ST_CHECK(n >= 0, CommError, what(), " announces a negative size ", n);
    bytes *= static_cast<double>(n);
  }
  ST_CHECK(bytes <= static_cast<double>(max_bytes), CommError, what(), " announces ", bytes,
           " bytes, more than the ", max_bytes, " a stage boundary may carry");
  at::Tensor out = at::empty(sizes, at::TensorOptions().dtype(dtype));
  if (out.numel() > 0) comm.recv(out, src, comm::P2POptions(options).tag(2 * tag + 1)).wait();
  return out;
}

}  // namespace shardtrain::parallel
