// The communicator within one process: a world of one, the reduction
// kernels, option checks, and a rendezvous whose peer never arrives.
#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <gtest/gtest.h>

#include <chrono>
#include <limits>

#include "comm/detail.h"
#include "shardtrain/comm/communicator.h"
#include "shardtrain/core/error.h"
#include "shardtrain/launch/launcher.h"

using namespace shardtrain;
using namespace shardtrain::comm;
namespace cd = shardtrain::comm::detail;

namespace {

std::shared_ptr<Communicator> world_of_one() {
  return Communicator::create(CommOptions().rank(0).world_size(1));
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

TEST(WorldOfOne, CollectivesAreLocalAndExact) {
  auto comm = world_of_one();
  EXPECT_EQ(comm->size(), 1);
  EXPECT_EQ(comm->rank(), 0);
  for (int64_t numel : {0, 1, 7, 1000}) {
    auto t = at::arange(numel, at::kFloat);
    auto ref = t.clone();
    for (auto op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min}) {
      comm->all_reduce(t, AllReduceOptions().op(op));
      EXPECT_TRUE(at::equal(t, ref));
    }
    auto out = at::empty({numel});
    comm->reduce_scatter(ref, out);
    EXPECT_TRUE(at::equal(out, ref));
    auto gathered = at::empty({numel});
    comm->all_gather(ref, gathered);
    EXPECT_TRUE(at::equal(gathered, ref));
    comm->broadcast(t);
    EXPECT_TRUE(at::equal(t, ref));
  }
  comm->barrier();
  Work w = comm->all_reduce(at::ones({3}), AllReduceOptions().async(true));
  w.wait();
  EXPECT_TRUE(w.is_completed());
  // Four sizes of seven collectives, the barrier and the async all_reduce.
  EXPECT_EQ(comm->sequence_number(), 4u * 7u + 2u);
  EXPECT_THROW(comm->send(at::ones({1}), 0), InvalidArgument);
  auto sub = comm->new_group({0});
  ASSERT_NE(sub, nullptr);
  EXPECT_EQ(sub->size(), 1);
}

TEST(Reduce, LowPrecisionSumsRoundOncePerHop) {
  // 256 + 1 is not representable in bfloat16 (8 bits of mantissa): one
  // rounding gives 256; 1 + 1 + 256 in float32 then one rounding gives 258.
  c10::BFloat16 a(256.0f), b(1.0f), out;
  cd::reduce(&out, &a, &b, 1, cd::DType::BFloat16, ReduceOp::Sum, 0);
  EXPECT_EQ(static_cast<float>(out), 256.0f);
  // Avg divides the float32 sum before rounding: (3 + 4) / 2 = 3.5 exactly.
  c10::Half x(3.0f), y(4.0f), avg;
  cd::reduce(&avg, &x, &y, 1, cd::DType::Float16, ReduceOp::Avg, 2);
  EXPECT_EQ(static_cast<float>(avg), 3.5f);
}

TEST(Reduce, InfAndNanSurviveEveryOp) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  c10::Half a[3] = {c10::Half(inf), c10::Half(nan), c10::Half(1.0f)};
  c10::Half b[3] = {c10::Half(1.0f), c10::Half(1.0f), c10::Half(nan)};
  c10::Half out[3];
  for (auto op : {ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min}) {
    cd::reduce(out, a, b, 3, cd::DType::Float16, op, 0);
    const float first = static_cast<float>(out[0]);
    EXPECT_EQ(first, op == ReduceOp::Min ? 1.0f : inf) << to_string(op);
    EXPECT_TRUE(std::isnan(static_cast<float>(out[1]))) << to_string(op);
    EXPECT_TRUE(std::isnan(static_cast<float>(out[2]))) << to_string(op);
  }
}

TEST(Options, BadValuesAreConfigErrors) {
  // Outside mpirun: the mpi backend has no job to join.
  EXPECT_THROW(Communicator::create(CommOptions().backend(Backend::Mpi).world_size(2)), ConfigError);
  EXPECT_THROW(Communicator::create(CommOptions().rank(2).world_size(2)), ConfigError);
  EXPECT_THROW(Communicator::create(CommOptions().world_size(0)), ConfigError);
  EXPECT_THROW(Communicator::create(CommOptions().world_size(2).init_method("carrier-pigeon://")),
               ConfigError);
  EXPECT_THROW(Communicator::create(CommOptions().world_size(2).master_port(70000)), ConfigError);
}

TEST(Options, EnvironmentIsRead) {
  setenv("SHARDTRAIN_TIMEOUT_S", "2.5", 1);
  setenv("SHARDTRAIN_SEGMENT_BYTES", "4096", 1);
  const CommOptions o = CommOptions::from_env();
  EXPECT_EQ(o.timeout(), std::chrono::milliseconds(2500));
  EXPECT_EQ(o.segment_bytes(), 4096);
  setenv("SHARDTRAIN_TIMEOUT_S", "soon", 1);
  EXPECT_THROW(CommOptions::from_env(), ConfigError);
  unsetenv("SHARDTRAIN_TIMEOUT_S");
  unsetenv("SHARDTRAIN_SEGMENT_BYTES");
}

// Rank 0 of two hosts the store; rank 1 never comes. Rendezvous fails with a
// TimeoutError soon after the timeout, never a hang: well under a minute
// (room for a loaded machine), where the default timeout is 10.
TEST(Rendezvous, MissingPeerTimesOut) {
  const auto start = std::chrono::steady_clock::now();
  const int port = dist::find_free_port();
  try {
    Communicator::create(CommOptions().rank(0).world_size(2).master_port(port).timeout(
        std::chrono::milliseconds(1500)));
    FAIL() << "rendezvous without the peer returned";
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("Hint"), std::string::npos) << e.what();
  }
  EXPECT_LT(seconds_since(start), 60.0);
}

// The line that says who is still missing comes at most once per second
// waited: near the deadline it used to repeat, the same "(1 s of 1 s)", as
// the last wait of under a millisecond ended again and again before it.
TEST(Rendezvous, TheWaitingLineIsNotRepeatedNearTheDeadline) {
  const int port = dist::find_free_port();
  ::testing::internal::CaptureStderr();
  EXPECT_THROW(Communicator::create(CommOptions().rank(0).world_size(2).master_port(port).timeout(
                   std::chrono::milliseconds(1500))),
               TimeoutError);
  const std::string err = ::testing::internal::GetCapturedStderr();
  int lines = 0;
  for (size_t at = 0; (at = err.find("waiting for rank", at)) != std::string::npos; ++at) ++lines;
  EXPECT_LE(lines, 1) << err;
}

// Rank 1 of two with nobody hosting the store at the master address.
TEST(Rendezvous, MissingMasterTimesOut) {
  const auto start = std::chrono::steady_clock::now();
  const int port = dist::find_free_port();
  EXPECT_THROW(Communicator::create(CommOptions().rank(1).world_size(2).master_port(port).timeout(
                   std::chrono::milliseconds(1500))),
               CommError);
  EXPECT_LT(seconds_since(start), 60.0);
}

// A file store: the same rendezvous over a shared file, missing peer included.
TEST(Rendezvous, FileStoreMissingPeerTimesOut) {
  const std::string path = ::testing::TempDir() + "/shardtrain_store_" + std::to_string(getpid());
  std::remove(path.c_str());
  EXPECT_THROW(Communicator::create(CommOptions().rank(0).world_size(2).init_method("file://" + path)
                                        .timeout(std::chrono::milliseconds(1500))),
               CommError);
  std::remove(path.c_str());
}
