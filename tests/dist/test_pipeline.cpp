// What crosses a pipeline stage boundary (parallel/pipeline_transport.h),
// between real processes: tensors of every shape the data makes (rows of
// different lengths, empty dimensions, a scalar), each received as sent;
// a header that announces garbage refused before anything is allocated; a
// neighbour that left is an error within the deadline, never a hang.
// And the executor (parallel/pipeline.h): micro-batches of different shapes
// through every schedule. World 2 and 3 (a chain of stages 0 -> 1 -> 2).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <thread>

#include "shardtrain/comm/communicator.h"
#include "shardtrain/comm/mesh.h"
#include "shardtrain/core/error.h"
#include "shardtrain/data/tokens.h"
#include "shardtrain/models/llama.h"
#include "shardtrain/parallel/pipeline.h"
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
// Variable-length data makes micro-batches of different rows and lengths in
// one step. Under every schedule each crosses the stages with its own shape,
// and every rank's gradients are the whole model's, run in one process on
// the same micro-batches (a tied head's summed over its two ends). The
// model itself is checked against an independent implementation elsewhere
// (tests/models); this checks the executor.
TEST(PipelineExecutor, MicroBatchesOfDifferentShapesGiveTheWholeModelsGradients) {
  const int p = world().size();
  models::LlamaConfig c;
  c.vocab_size = 40;
  c.hidden_size = 16;
  c.intermediate_size = 32;
  c.num_layers = 4;
  c.num_heads = 2;
  c.num_kv_heads = 1;
  c.head_dim = 8;
  c.block_size = c.max_positions = 16;
  c.tie_word_embeddings = true;
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{2, 5}, {1, 9}, {3, 3}, {2, 16}};  // [rows, length]
  auto gen = at::detail::createCPUGenerator(7);
  std::vector<data::Batch> window;
  int64_t targets = 0;
  for (const auto& [rows, length] : shapes) {
    data::Batch b;
    b.input = at::randint(c.vocab_size, {rows, length}, gen, at::kLong);
    b.target = at::randint(c.vocab_size, {rows, length}, gen, at::kLong);
    b.target.masked_fill_(at::rand({rows, length}, gen) < 0.2, -100);
    targets += b.target.ne(-100).sum().item<int64_t>();
    window.push_back(b);
  }
  const auto loss_sum = [&](const at::Tensor& logits, const data::Batch& b) {
    return at::cross_entropy_loss(logits.reshape({-1, c.vocab_size}), b.target.reshape({-1}), {},
                                  at::Reduction::Sum, -100);
  };
  torch::manual_seed(3);
  auto whole = std::make_shared<models::LlamaImpl>(c);
  for (const auto& b : window) (loss_sum(whole->forward(b.input), b) / static_cast<double>(targets)).backward();
  const auto mesh = comm::DeviceMesh::create(::shardtrain::testing::world_ptr(), comm::MeshShape().pp(p));
  for (const auto schedule : {parallel::PipelineSchedule::GPipe, parallel::PipelineSchedule::OneFOneB,
                              parallel::PipelineSchedule::Interleaved1F1B, parallel::PipelineSchedule::ZeroBubble}) {
    SCOPED_TRACE(enum_name(schedule));
    torch::manual_seed(3);
    auto model = std::make_shared<models::LlamaImpl>(c);
    const int v = schedule == parallel::PipelineSchedule::Interleaved1F1B ? 2 : 1;
    parallel::Pipeline pipe(*model, mesh, parallel::PipelineOptions().schedule(schedule).stages_per_rank(v));
    parallel::PipelineStepFns fns;
    fns.loss_sum = loss_sum;
    fns.in_precision = [](const std::function<at::Tensor()>& f) { return f(); };
    fns.backward_root = [&](const at::Tensor& loss) { return loss / static_cast<double>(targets); };
    fns.set_gradient_sync = [](bool) {};
    const parallel::PipelineStepStats stats = pipe.run_step(window, fns);
    EXPECT_EQ(stats.spans.size(), static_cast<size_t>(v) * shapes.size() *
                                      (schedule == parallel::PipelineSchedule::ZeroBubble ? 3 : 2));
    const auto reference = whole->named_parameters();
    const auto held = model->named_parameters();
    EXPECT_LT(held.size(), reference.size());  // a stage holds part of the model
    for (const std::string& name : pipe.tied_names()) {  // every rank, in the same order
      const at::Tensor* t = held.find(name);
      at::Tensor g = t != nullptr && t->grad().defined() ? t->grad().clone() : at::zeros_like(*reference.find(name));
      world().all_reduce(g);
      EXPECT_TRUE(at::allclose(g, reference.find(name)->grad(), 1e-5, 1e-7)) << name;
    }
    for (const auto& item : held) {
      if (std::find(pipe.tied_names().begin(), pipe.tied_names().end(), item.key()) != pipe.tied_names().end()) continue;
      ASSERT_TRUE(item.value().grad().defined()) << item.key();
      EXPECT_TRUE(at::allclose(item.value().grad(), reference.find(item.key())->grad(), 1e-5, 1e-7))
          << item.key() << " differs by " << (item.value().grad() - reference.find(item.key())->grad()).abs().max();
    }
  }
}

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
