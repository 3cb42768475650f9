// The MPI backend (mpi.h): MPI's non-blocking collectives polled to a
// deadline, with our reduction kernels registered as MPI operations.
#include "comm/mpi.h"

#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "shardtrain/core/error.h"

namespace shardtrain::comm::detail {

using ::shardtrain::detail::str_cat;

bool started_by_mpi_launcher() {
  // mpirun (PMIx) and srun --mpi=pmix set PMIX_RANK; older OpenMPI runtimes
  // set their job id for the ranks they start.
  for (const char* name : {"PMIX_RANK", "OMPI_MCA_ess_base_jobid"}) {
    const char* v = std::getenv(name);
    if (v != nullptr && *v != '\0') return true;
  }
  return false;
}

namespace {

std::string mpi_error_text(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) return str_cat("MPI error ", code);
  return std::string(text, length);
}

// The MPI type that carries `dtype`'s elements. Low-precision floats travel
// as 16-bit words; only our operations (below) interpret them.
MPI_Datatype mpi_type(DType dtype) {
  switch (dtype) {
    case DType::Float32: return MPI_FLOAT;
    case DType::Float64: return MPI_DOUBLE;
    case DType::BFloat16:
    case DType::Float16: return MPI_UINT16_T;
    case DType::Int32: return MPI_INT32_T;
    case DType::Int64: return MPI_INT64_T;
  }
  return MPI_DATATYPE_NULL;
}

constexpr DType kDTypes[] = {DType::Float32, DType::Float64, DType::BFloat16,
                             DType::Float16, DType::Int32,   DType::Int64};
constexpr ReduceOp kOps[] = {ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min};

// inout[i] = in[i] (op) inout[i] with the ring's kernel for dtype D.
template <DType D, ReduceOp O>
void combine(void* in, void* inout, int* len, MPI_Datatype*) {
  reduce(inout, in, inout, *len, D, O, 0);
}

template <DType D>
void register_ops(MPI_Op (&row)[3]) {
  MPI_Op_create(&combine<D, ReduceOp::Sum>, /*commute=*/1, &row[0]);
  MPI_Op_create(&combine<D, ReduceOp::Max>, 1, &row[1]);
  MPI_Op_create(&combine<D, ReduceOp::Min>, 1, &row[2]);
}

// Process-wide MPI state: initialised by the first world(), finalised at exit.
struct Runtime {
  std::once_flag once;
  MPI_Op ops[6][3] = {};  // [dtype][Sum, Max, Min]
  int tag_ub = 32767;     // the least every MPI allows
  std::string version;
  std::string host;
};

Runtime& runtime() {
  static Runtime* r = new Runtime;  // outlives every group, even at exit
  return *r;
}

void finalize_at_exit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

MPI_Op mpi_op(DType dtype, ReduceOp op) {
  const int row = static_cast<int>(std::find(std::begin(kDTypes), std::end(kDTypes), dtype) -
                                    std::begin(kDTypes));
  const int col = op == ReduceOp::Max ? 1 : op == ReduceOp::Min ? 2 : 0;  // Avg sums
  return runtime().ops[row][col];
}

void initialise() {
  Runtime& r = runtime();
  std::call_once(r.once, [&r] {
    int initialised = 0;
    MPI_Initialized(&initialised);
    int provided = 0;
    if (initialised) {
      MPI_Query_thread(&provided);
    } else {
      const int code = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
      ST_CHECK(code == MPI_SUCCESS, CommError, "MPI_Init_thread failed: ", mpi_error_text(code));
      std::atexit(finalize_at_exit);
    }
    ST_CHECK(provided == MPI_THREAD_MULTIPLE, ConfigError,
             "the MPI library gives thread level ", provided, ", but the mpi backend needs "
             "MPI_THREAD_MULTIPLE (every group has its own communication thread). Hint: use an MPI "
             "built with thread support, or distributed.backend: gloo");
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    register_ops<DType::Float32>(r.ops[0]);
    register_ops<DType::Float64>(r.ops[1]);
    register_ops<DType::BFloat16>(r.ops[2]);
    register_ops<DType::Float16>(r.ops[3]);
    register_ops<DType::Int32>(r.ops[4]);
    register_ops<DType::Int64>(r.ops[5]);
    int* ub = nullptr;
    int found = 0;
    MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &ub, &found);
    if (found && ub != nullptr) r.tag_ub = *ub;
    char version[MPI_MAX_LIBRARY_VERSION_STRING];
    int length = 0;
    MPI_Get_library_version(version, &length);
    r.version = std::string(version, length);
    r.version = r.version.substr(0, r.version.find(','));
    char host[MPI_MAX_PROCESSOR_NAME];
    MPI_Get_processor_name(host, &length);
    r.host = std::string(host, length);
  });
}

// Polls `request` until it completes or `oc`'s deadline passes. MPI makes
// progress only inside its calls, so the first 20 ms poll back to back
// (yielding the core between polls): an op of up to tens of megabytes ends
// in that window at full speed. Longer waits (a peer still computing) poll
// every 50 µs, since ranks share cores with the compute threads.
void poll(const OpContext& oc, MPI_Request& request, int peer, const char* what) {
  const auto eager_until = Clock::now() + std::chrono::milliseconds(20);
  for (;;) {
    int done = 0;
    const int code = MPI_Test(&request, &done, MPI_STATUS_IGNORE);
    if (code != MPI_SUCCESS) {
      throw CommError(str_cat(oc.describe(peer), ": MPI ", what, " failed: ", mpi_error_text(code),
                              ". Hint: a peer probably exited; see its own output for why."));
    }
    if (done) return;
    const auto now = Clock::now();
    if (now >= oc.deadline) {
      throw TimeoutError(str_cat(
          oc.describe(peer), ": timed out waiting for MPI to ", what,
          ". Hint: a peer may have died, hung, or issued collectives in another order; raise "
          "SHARDTRAIN_TIMEOUT_S if steps are legitimately this slow"));
    }
    if (now < eager_until) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
}

// Starts one non-blocking MPI call and polls it to completion.
template <typename Start>
void run(const OpContext& oc, const char* what, Start start) {
  MPI_Request request = MPI_REQUEST_NULL;
  const int code = start(&request);
  if (code != MPI_SUCCESS) {
    throw CommError(str_cat(oc.describe(-1), ": MPI ", what, " could not start: ",
                            mpi_error_text(code)));
  }
  poll(oc, request, -1, what);
}

int checked_count(const OpContext& oc, int64_t n) {
  ST_CHECK(n <= INT_MAX, InvalidArgument, oc.op, ": ", n, " elements in one call is more than the "
           "mpi backend moves at once (2^31-1); split the buffer (smaller buckets or units)");
  return static_cast<int>(n);
}

// Bytes per call of a chunked op. MPI allocates scratch as large as a call
// for its reductions; above glibc's mmap threshold (at most 32 MB) every call
// maps fresh pages and faults them in (64 MB all-reduce at 0.26 GB/s here,
// against 2.8 GB/s when the scratch stays on the heap). 8 MB pieces keep it
// there, and count well within MPI's int.
constexpr int64_t kPieceBytes = int64_t{8} << 20;

}  // namespace

struct MpiComm::Handle {
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0;
  int size = 1;
  ~Handle() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized && comm != MPI_COMM_NULL && comm != MPI_COMM_WORLD) MPI_Comm_free(&comm);
  }
};

struct MpiRequest {
  MPI_Request request = MPI_REQUEST_NULL;
};

MpiComm::MpiComm(std::unique_ptr<Handle> handle) : handle_(std::move(handle)) {}
MpiComm::~MpiComm() = default;

std::unique_ptr<MpiComm> MpiComm::world(int rank, int size) {
  initialise();
  auto handle = std::make_unique<Handle>();
  handle->comm = MPI_COMM_WORLD;
  MPI_Comm_rank(MPI_COMM_WORLD, &handle->rank);
  MPI_Comm_size(MPI_COMM_WORLD, &handle->size);
  ST_CHECK(handle->rank == rank && handle->size == size, ConfigError, "MPI says this is rank ",
           handle->rank, " of ", handle->size, ", but the environment says rank ", rank, " of ",
           size, ". Hint: start every rank with one mpirun (or srun --mpi=pmix), and do not set "
           "RANK/WORLD_SIZE by hand under it");
  return std::unique_ptr<MpiComm>(new MpiComm(std::move(handle)));
}

std::unique_ptr<MpiComm> MpiComm::split(bool member, int key) const {
  MPI_Comm out = MPI_COMM_NULL;
  const int code = MPI_Comm_split(handle_->comm, member ? 0 : MPI_UNDEFINED, key, &out);
  ST_CHECK(code == MPI_SUCCESS, CommError, "new_group: MPI_Comm_split failed on rank ",
           handle_->rank, ": ", mpi_error_text(code));
  if (!member) return nullptr;
  MPI_Comm_set_errhandler(out, MPI_ERRORS_RETURN);
  auto handle = std::make_unique<Handle>();
  handle->comm = out;
  MPI_Comm_rank(out, &handle->rank);
  MPI_Comm_size(out, &handle->size);
  return std::unique_ptr<MpiComm>(new MpiComm(std::move(handle)));
}

void MpiComm::all_reduce(const OpContext& oc, void* buf, int64_t numel, DType dtype,
                         ReduceOp op) const {
  const size_t es = element_size(dtype);
  const int64_t per_piece = kPieceBytes / static_cast<int64_t>(es);
  for (int64_t at = 0; at < numel; at += per_piece) {
    const int count = static_cast<int>(std::min(per_piece, numel - at));
    char* piece = static_cast<char*>(buf) + at * es;
    run(oc, "all-reduce", [&](MPI_Request* r) {
      return MPI_Iallreduce(MPI_IN_PLACE, piece, count, mpi_type(dtype), mpi_op(dtype, op),
                            handle_->comm, r);
    });
  }
  if (op == ReduceOp::Avg && numel > 0) divide(buf, buf, numel, dtype, handle_->size);
}

void MpiComm::reduce_scatter(const OpContext& oc, const void* in, void* out, int64_t numel,
                             DType dtype, ReduceOp op) const {
  checked_count(oc, numel);
  const size_t es = element_size(dtype);
  const int size = handle_->size, me = handle_->rank;
  const ShardRange mine = shard_range(numel, size, me);
  // MPI needs a receive buffer that does not overlap the send buffer.
  const bool overlaps = out >= in && static_cast<const char*>(out) <
                                         static_cast<const char*>(in) + numel * es;
  char* target = overlaps ? oc.scratch->get(0, std::max<size_t>(1, mine.count * es))
                          : static_cast<char*>(out);
  const MPI_Datatype type = mpi_type(dtype);
  const MPI_Op mop = mpi_op(dtype, op);
  if (static_cast<int64_t>(numel * es) <= kPieceBytes) {
    std::vector<int> counts(size);
    for (int r = 0; r < size; ++r) counts[r] = static_cast<int>(shard_range(numel, size, r).count);
    run(oc, "reduce-scatter", [&](MPI_Request* r) {
      return MPI_Ireduce_scatter(in, target, counts.data(), type, mop, handle_->comm, r);
    });
  } else {
    // Large: each shard is reduced to its owner in pieces (see kPieceBytes).
    const int64_t per_piece = kPieceBytes / static_cast<int64_t>(es);
    for (int root = 0; root < size; ++root) {
      const ShardRange shard = shard_range(numel, size, root);
      for (int64_t at = 0; at < shard.count; at += per_piece) {
        const int count = static_cast<int>(std::min(per_piece, shard.count - at));
        const char* from = static_cast<const char*>(in) + (shard.offset + at) * es;
        run(oc, "reduce-scatter", [&](MPI_Request* r) {
          return MPI_Ireduce(from, root == me ? target + at * es : nullptr, count, type, mop, root,
                             handle_->comm, r);
        });
      }
    }
  }
  if (overlaps && mine.count > 0) std::memcpy(out, target, mine.count * es);
  if (op == ReduceOp::Avg && mine.count > 0) divide(out, out, mine.count, dtype, size);
}

void MpiComm::all_gather(const OpContext& oc, void* buf, int64_t numel, DType dtype) const {
  checked_count(oc, numel);
  std::vector<int> counts(handle_->size), offsets(handle_->size);
  for (int r = 0; r < handle_->size; ++r) {
    const ShardRange range = shard_range(numel, handle_->size, r);
    counts[r] = static_cast<int>(range.count);
    offsets[r] = static_cast<int>(range.offset);
  }
  run(oc, "all-gather", [&](MPI_Request* r) {
    return MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buf, counts.data(), offsets.data(),
                           mpi_type(dtype), handle_->comm, r);
  });
}

void MpiComm::broadcast(const OpContext& oc, void* buf, int64_t numel, DType dtype,
                        int root) const {
  const size_t es = element_size(dtype);
  const int64_t per_piece = kPieceBytes / static_cast<int64_t>(es);
  for (int64_t at = 0; at < numel; at += per_piece) {
    const int count = static_cast<int>(std::min(per_piece, numel - at));
    char* piece = static_cast<char*>(buf) + at * es;
    run(oc, "broadcast", [&](MPI_Request* r) {
      return MPI_Ibcast(piece, count, mpi_type(dtype), root, handle_->comm, r);
    });
  }
}

void MpiComm::all_to_all(const OpContext& oc, const void* in, void* out, const AllToAllPlan& plan,
                         DType dtype) const {
  checked_count(oc, plan.largest);  // every rank's offsets and counts then fit an int
  const int size = handle_->size;
  std::vector<int> send_counts(size), send_offsets(size), recv_counts(size), recv_offsets(size);
  for (int r = 0; r < size; ++r) {
    send_counts[r] = static_cast<int>(plan.send[r].count);
    send_offsets[r] = static_cast<int>(plan.send[r].offset);
    recv_counts[r] = static_cast<int>(plan.recv[r].count);
    recv_offsets[r] = static_cast<int>(plan.recv[r].offset);
  }
  run(oc, "all-to-all", [&](MPI_Request* r) {
    return MPI_Ialltoallv(in, send_counts.data(), send_offsets.data(), mpi_type(dtype), out,
                          recv_counts.data(), recv_offsets.data(), mpi_type(dtype), handle_->comm, r);
  });
}

void MpiComm::barrier(const OpContext& oc) const {
  run(oc, "barrier", [&](MPI_Request* r) { return MPI_Ibarrier(handle_->comm, r); });
}

std::shared_ptr<MpiRequest> MpiComm::post(const OpContext& oc, void* buf, size_t nbytes, int peer,
                                          uint32_t tag, bool is_send) const {
  const int tag_ub = runtime().tag_ub;
  ST_CHECK(tag <= static_cast<uint32_t>(tag_ub), InvalidArgument, oc.op, ": tag ", tag,
           " is above the largest this MPI allows (", tag_ub, ")");
  ST_CHECK(nbytes <= static_cast<size_t>(INT_MAX), InvalidArgument, oc.op, ": ", nbytes,
           " bytes in one message is more than the mpi backend sends at once (2^31-1)");
  auto request = std::make_shared<MpiRequest>();
  const int count = static_cast<int>(nbytes);
  const int code = is_send ? MPI_Isend(buf, count, MPI_BYTE, peer, static_cast<int>(tag),
                                       handle_->comm, &request->request)
                           : MPI_Irecv(buf, count, MPI_BYTE, peer, static_cast<int>(tag),
                                       handle_->comm, &request->request);
  if (code != MPI_SUCCESS) {
    throw CommError(str_cat(oc.describe(peer), ": MPI ", is_send ? "send" : "receive",
                            " could not start: ", mpi_error_text(code)));
  }
  return request;
}

void MpiComm::wait(const OpContext& oc, MpiRequest& request, int peer) const {
  poll(oc, request.request, peer, oc.op);
}

std::string MpiComm::describe() const {
  return str_cat(runtime().version, " on ", runtime().host);
}

}  // namespace shardtrain::comm::detail
