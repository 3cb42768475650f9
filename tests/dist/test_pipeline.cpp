// What crosses a pipeline stage boundary (parallel/pipeline_transport.h),
// between real processes: tensors of every shape the data makes (rows of
// different lengths, empty dimensions, a scalar), each received as sent;
// a header that announces garbage refused before anything is allocated; a
// neighbour that left is an error within the deadline, never a hang.
// World 2 and 3 (a chain of stages 0 -> 1 -> 2).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <thread>

#include "shardtrain/comm/communicator.h"
#include "shardtrain/core/error.h"
#include "shardtrain/parallel/pipeline_transport.h"
#include "world.h"

using namespace shardtrain;

namespace {

comm::Communicator& world() { return *::shardtrain::testing::world_ptr(); }

// Message k of sender `from`: its shape and values depend on both, so a
// receiver that took another message's shape or another sender's data fails.
at::Tensor message(int from, int k) {
  const std::vector<std::vector<int64_t>> shapes = {
      {2, 7, 16}, {2, 3, 16}, {1, 31, 16}, {0, 5}, {}, {4, 0, 3}, {3, 1, 1, 2, 1, 1, 1, 2}, {1000, 33}};
  const auto& shape = shapes[static_cast<size_t>(k) % shapes.size()];
  const auto dtypes = std::vector<at::ScalarType>{at::kFloat, at::kBFloat16, at::kLong, at::kFloat,
                                                  at::kDouble, at::kHalf, at::kInt, at::kFloat};
  const at::ScalarType dtype = dtypes[static_cast<size_t>(k) % dtypes.size()];
  const at::Tensor t = at::arange(c10::multiply_integers(shape), at::kDouble).reshape(shape) * 0.5 + 100.0 * from + k;
  return t.to(dtype);
}

}  // namespace

TEST(PipelineTransport, EveryShapeArrivesAsSent) {
  const int n = world().size(), r = world().rank();
  std::vector<int> all(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) all[static_cast<size_t>(i)] = i;
  // One communicator per direction, as a pipeline has: activations down the
  // chain of stages, gradients back up. Every rank issues all its sends
  // first, then its receives: each direction is a chain, so its sends
  // drain from the end.
  const auto down = world().new_group(all), up = world().new_group(all);
  constexpr int kMessages = 16;
  std::vector<parallel::StageSend> sends;
  for (int k = 0; k < kMessages; ++k) {
    if (r + 1 < n) sends.push_back(parallel::send_to_stage(*down, message(r, k), r + 1, k));
    if (r > 0) sends.push_back(parallel::send_to_stage(*up, message(r, k + kMessages), r - 1, k));
  }
  for (int k = 0; k < kMessages; ++k) {
    for (const int from : {r - 1, r + 1}) {
      if (from < 0 || from >= n) continue;
      const at::Tensor got = parallel::recv_from_stage(from < r ? *down : *up, from, k);
      const at::Tensor want = message(from, from < r ? k : k + kMessages);
      ASSERT_EQ(got.sizes(), want.sizes()) << "message " << k << " from " << from;
      ASSERT_EQ(got.scalar_type(), want.scalar_type()) << "message " << k << " from " << from;
      EXPECT_TRUE(at::equal(got, want)) << "message " << k << " from " << from;
    }
  }
  for (auto& send : sends) send.wait();
  // A non-contiguous view goes as its values.
  if (r == 0) parallel::send_to_stage(*down, message(0, 0).transpose(1, 2), 1, 99).wait();
  if (r == 1) EXPECT_TRUE(at::equal(parallel::recv_from_stage(*down, 0, 99), message(0, 0).transpose(1, 2)));
  world().barrier();
}

// A header is checked before the receiver allocates what it announces.
TEST(PipelineTransport, GarbageHeadersAreRefusedBeforeAllocating) {
  if (world().rank() > 1) {
    world().barrier();
    return;
  }
  const std::vector<std::vector<int64_t>> headers = {
      {static_cast<int64_t>(at::kFloat), 2, 4, -3, 0, 0, 0, 0, 0, 0},                 // negative size
      {static_cast<int64_t>(at::kFloat), 2, int64_t{1} << 40, 1 << 20, 0, 0, 0, 0, 0, 0},  // 2^62 bytes
      {static_cast<int64_t>(at::kFloat), 9, 1, 1, 1, 1, 1, 1, 1, 1},                  // 9 dimensions
      {-4, 1, 4, 0, 0, 0, 0, 0, 0, 0},                                                 // no dtype
  };
  const std::vector<std::string> says = {"negative size -3", "bytes, more than", "header this build does not send",
                                         "header this build does not send"};
  for (size_t i = 0; i < headers.size(); ++i) {
    const auto tag = static_cast<uint32_t>(i);
    if (world().rank() == 0) {
      at::Tensor h = torch::tensor(headers[i], at::kLong);
      world().send(h, 1, comm::P2POptions().tag(2 * tag)).wait();
    } else {
      try {
        parallel::recv_from_stage(world(), 0, tag);
        ADD_FAILURE() << "header " << i << " was accepted";
      } catch (const CommError& e) {
        EXPECT_NE(std::string(e.what()).find(says[i]), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("from rank 0"), std::string::npos) << e.what();
      }
    }
  }
  world().barrier();
}

// The neighbour left: the receive ends with the Communicator's error, at
// the latest at its deadline (under gloo as soon as the connection closes;
// under mpi, which cannot tell, at the deadline), never a hang.
TEST(PipelineTransport, ANeighbourThatLeftIsAnError) {
  auto pair = world().new_group({0, 1});
  if (world().rank() == 1) {
    pair.reset();  // closes rank 1's side of the pair
  } else if (world().rank() == 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    const auto start = std::chrono::steady_clock::now();
    EXPECT_THROW(parallel::recv_from_stage(*pair, 1, 0, std::chrono::seconds(10)), CommError);
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 40.0);
  }
  world().barrier();
}
