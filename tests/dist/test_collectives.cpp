// Collective correctness, run by every rank under `shardtrain launch`.
//
// Each rank fills its buffers from (rank, index) so every rank can compute
// the expected result locally, and checks it after the collective. Sizes 0,
// 1, 7, one not divisible by the world size, and about 3 M elements are in
// every matrix.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <numeric>
#include <cstdlib>
#include <thread>

#include "shardtrain/comm/communicator.h"
#include "shardtrain/core/error.h"
#include "world.h"

using namespace shardtrain;
using namespace shardtrain::comm;

namespace {

std::shared_ptr<Communicator>& g_world = ::shardtrain::testing::world_ptr();

Communicator& world() { return *g_world; }

const std::vector<at::ScalarType> kDtypes = {at::kFloat, at::kDouble, at::kBFloat16,
                                             at::kHalf, at::kInt, at::kLong};
const std::vector<ReduceOp> kOps = {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min};

bool is_float(at::ScalarType t) { return at::isFloatingType(t); }

std::vector<int64_t> sizes() {
  const int64_t n = world().size();
  return {0, 1, 7, 5 * n + 1, (int64_t{3} << 20) + 3};  // 12-24 MB: several 1 MB segments
}

// Rank r's contribution: small integers, exact in every dtype and in sums.
at::Tensor contribution(int64_t numel, int rank, at::ScalarType dtype) {
  auto idx = at::arange(numel, at::kLong);
  return ((idx * 7 + rank * 3) % 13 + rank + 1).to(dtype);
}

at::Tensor expected_reduction(int64_t numel, at::ScalarType dtype, ReduceOp op) {
  const int n = world().size();
  auto acc = contribution(numel, 0, at::kDouble);
  for (int r = 1; r < n; ++r) {
    auto c = contribution(numel, r, at::kDouble);
    switch (op) {
      case ReduceOp::Sum:
      case ReduceOp::Avg: acc = acc + c; break;
      case ReduceOp::Max: acc = at::maximum(acc, c); break;
      case ReduceOp::Min: acc = at::minimum(acc, c); break;
    }
  }
  if (op == ReduceOp::Avg) acc = acc / n;
  return acc;
}

// Sums, maxima and minima of the small integers are exact in every dtype;
// only Avg rounds, once, so the tolerance is a few units of the dtype's
// epsilon (float32 2^-23, bfloat16 2^-8, float16 2^-11).
void expect_close(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  ASSERT_EQ(got.numel(), want.numel()) << what;
  if (got.numel() == 0) return;
  const double tol = got.scalar_type() == at::kBFloat16 ? 1e-2
                     : got.scalar_type() == at::kHalf  ? 1e-3
                     : got.scalar_type() == at::kFloat ? 1e-6
                                                       : 1e-12;
  const double err = (got.to(at::kDouble) - want).abs().max().item<double>();
  const double scale = want.abs().max().item<double>() + 1.0;
  EXPECT_LE(err, tol * scale) << what;
}

std::string label(at::ScalarType dtype, int64_t numel, ReduceOp op) {
  return std::string(c10::toString(dtype)) + " n=" + std::to_string(numel) + " op=" + to_string(op);
}

bool large(int64_t numel) { return numel > (int64_t{1} << 20); }

}  // namespace

TEST(ShardRange, CoversTheBufferWithoutGaps) {
  for (int64_t numel : {0, 1, 7, 13, 1000003}) {
    for (int n = 1; n <= 5; ++n) {
      int64_t next = 0;
      for (int r = 0; r < n; ++r) {
        const ShardRange s = shard_range(numel, n, r);
        EXPECT_EQ(s.offset, next);
        EXPECT_GE(s.count, numel / n);
        EXPECT_LE(s.count, numel / n + 1);
        next += s.count;
      }
      EXPECT_EQ(next, numel);
    }
  }
}

TEST(Collectives, AllReduce) {
  for (auto dtype : kDtypes) {
    for (int64_t numel : sizes()) {
      for (auto op : kOps) {
        if (op == ReduceOp::Avg && !is_float(dtype)) continue;
        if (large(numel) && op != ReduceOp::Sum && dtype != at::kFloat) continue;
        auto t = contribution(numel, world().rank(), dtype);
        world().all_reduce(t, AllReduceOptions().op(op));
        expect_close(t, expected_reduction(numel, dtype, op), "all_reduce " + label(dtype, numel, op));
      }
    }
  }
}

TEST(Collectives, ReduceScatter) {
  for (auto dtype : kDtypes) {
    for (int64_t numel : sizes()) {
      for (auto op : kOps) {
        if (op == ReduceOp::Avg && !is_float(dtype)) continue;
        if (large(numel) && op != ReduceOp::Sum && dtype != at::kFloat) continue;
        auto in = contribution(numel, world().rank(), dtype);
        auto in_copy = in.clone();
        const ShardRange mine = shard_range(numel, world().size(), world().rank());
        auto out = at::full({mine.count}, -1, dtype);
        world().reduce_scatter(in, out, ReduceScatterOptions().op(op));
        auto want = expected_reduction(numel, dtype, op).narrow(0, mine.offset, mine.count);
        expect_close(out, want, "reduce_scatter " + label(dtype, numel, op));
        EXPECT_TRUE(at::equal(in, in_copy)) << "reduce_scatter changed its input";
      }
    }
  }
}

TEST(Collectives, AllGather) {
  for (auto dtype : kDtypes) {
    for (int64_t numel : sizes()) {
      const ShardRange mine = shard_range(numel, world().size(), world().rank());
      // Rank r contributes its own slice of the reference, so the result is it.
      auto want = contribution(numel, 0, dtype);
      auto out = at::full({numel}, -1, dtype);
      world().all_gather(want.narrow(0, mine.offset, mine.count).clone(), out);
      EXPECT_TRUE(at::equal(out, want)) << "all_gather " << label(dtype, numel, ReduceOp::Sum);
      // In place: the input is this rank's slice of the output itself.
      auto inplace = at::full({numel}, -1, dtype);
      inplace.narrow(0, mine.offset, mine.count).copy_(want.narrow(0, mine.offset, mine.count));
      world().all_gather(inplace.narrow(0, mine.offset, mine.count), inplace);
      EXPECT_TRUE(at::equal(inplace, want)) << "in-place all_gather " << numel;
    }
  }
}

TEST(Collectives, Broadcast) {
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kLong}) {
    for (int64_t numel : sizes()) {
      for (int root = 0; root < world().size(); ++root) {
        if (large(numel) && root > 1) continue;
        auto t = contribution(numel, world().rank(), dtype);
        world().broadcast(t, BroadcastOptions().root(root));
        EXPECT_TRUE(at::equal(t, contribution(numel, root, dtype)))
            << "broadcast root " << root << " " << label(dtype, numel, ReduceOp::Sum);
      }
    }
  }
}

// No rank leaves the barrier before the last rank entered it. The ranks run
// on this machine, whose monotonic clock (steady_clock, CLOCK_MONOTONIC) they
// share, so their times compare directly; the wall clock (system_clock) could
// be stepped between two readings and order them wrongly.
TEST(Collectives, BarrierWaitsForTheLastRank) {
  const auto now_us = [] {
    return static_cast<double>(std::chrono::duration_cast<std::chrono::microseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
  };
  const int n = world().size(), r = world().rank();
  world().barrier();
  double entered = 0.0;
  if (r == n - 1) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    entered = now_us();
  }
  world().barrier();
  const double left = now_us();
  auto mine = at::tensor({entered, left}, at::kDouble);
  auto all = at::empty({2 * n}, at::kDouble);
  world().all_gather(mine, all);
  const double last_entered = all[2 * (n - 1)].item<double>();
  for (int k = 0; k < n; ++k) {
    EXPECT_GE(all[2 * k + 1].item<double>(), last_entered)
        << "rank " << k << " left the barrier before the last rank entered it";
  }
}

TEST(Collectives, SeveralInFlightAtOnce) {
  const int64_t numel = 100003;
  auto a = contribution(numel, world().rank(), at::kFloat);
  auto b_in = contribution(numel, world().rank(), at::kBFloat16);
  const ShardRange mine = shard_range(numel, world().size(), world().rank());
  auto b_out = at::empty({mine.count}, at::kBFloat16);
  auto c = contribution(numel, world().rank(), at::kDouble);
  Work wa = world().all_reduce(a, AllReduceOptions().async(true));
  Work wb = world().reduce_scatter(b_in, b_out, ReduceScatterOptions().async(true).op(ReduceOp::Max));
  Work wc = world().all_reduce(c, AllReduceOptions().async(true).op(ReduceOp::Avg));
  wc.wait();
  wb.wait();
  wa.wait();
  EXPECT_TRUE(wa.is_completed() && wb.is_completed() && wc.is_completed());
  EXPECT_EQ(wa.exception(), nullptr);
  expect_close(a, expected_reduction(numel, at::kFloat, ReduceOp::Sum), "async all_reduce");
  expect_close(b_out, expected_reduction(numel, at::kBFloat16, ReduceOp::Max).narrow(0, mine.offset, mine.count),
               "async reduce_scatter");
  expect_close(c, expected_reduction(numel, at::kDouble, ReduceOp::Avg), "async avg");
}

TEST(Collectives, SequenceNumbersCountCollectives) {
  const uint64_t before = world().sequence_number();
  auto t = at::ones({3});
  world().all_reduce(t);
  world().broadcast(t);
  EXPECT_EQ(world().sequence_number(), before + 2);
}

// ---- memory from allocate() ------------------------------------------------

namespace {

// Whether `t`'s memory is in one of this process's shared-memory segments.
bool in_shared_memory(const at::Tensor& t) {
  std::ifstream maps("/proc/self/maps");
  const auto at = reinterpret_cast<uintptr_t>(t.data_ptr());
  std::string line;
  while (std::getline(maps, line)) {
    uintptr_t lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx", &lo, &hi) == 2 && at >= lo && at < hi) {
      return line.find("/dev/shm/shardtrain-") != std::string::npos;
    }
  }
  return false;
}

bool shares_memory(const Communicator& c) {
  return c.endpoint().find("through shared memory") != std::string::npos;
}

// Rank-dependent values that round when summed, so that a different order
// of combining would show in the bits.
at::Tensor uneven_values(int64_t numel, int rank, at::ScalarType dtype) {
  return ((at::arange(numel, at::kDouble) * 0.37 + rank * 1.3).sin() * 100.0 + rank).to(dtype);
}

}  // namespace

TEST(Allocated, IsZeroedAndSharedWhereTheGroupSharesMemory) {
  auto t = world().allocate(1000, at::kFloat);
  EXPECT_EQ(t.scalar_type(), at::kFloat);
  EXPECT_TRUE(at::equal(t, at::zeros({1000}, at::kFloat)));
  EXPECT_EQ(in_shared_memory(t), shares_memory(world())) << world().endpoint();
  auto empty = world().allocate(0, at::kBFloat16);
  EXPECT_EQ(empty.numel(), 0);
  EXPECT_EQ(empty.scalar_type(), at::kBFloat16);
  EXPECT_THROW(world().allocate(-1, at::kFloat), InvalidArgument);
  EXPECT_THROW(world().allocate(4, at::kBool), InvalidArgument);
}

// Sizes that differ by rank are an error on every rank, not memory one rank
// reads past the end of (in a group of its own: the error breaks it).
TEST(Allocated, SizesThatDifferByRankAreRefused) {
  if (!shares_memory(world())) return;  // an ordinary tensor on each rank: nothing shared
  std::vector<int> everyone(static_cast<size_t>(world().size()));
  std::iota(everyone.begin(), everyone.end(), 0);
  auto group = world().new_group(everyone);
  EXPECT_THROW(group->allocate(100000 + 1000 * world().rank(), at::kFloat), InvalidArgument);
}

// In place (every rank's buffer at the same place of one allocation, whole
// or a slice) the result is the staged path's, bit for bit, and the rest
// of the allocation is left alone; on exact values it is the fp64 sum.
TEST(Allocated, AllReduceInPlaceGivesTheStagedResultToTheBit) {
  const int n = world().size();
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kDouble, at::kInt}) {
    const int64_t at_threshold = (int64_t{256} << 10) / static_cast<int64_t>(c10::elementSize(dtype));
    for (int64_t numel : {int64_t{0}, int64_t{1}, int64_t{7}, 5 * int64_t{n} + 1, at_threshold - 1,
                          at_threshold, at_threshold * 3 + 2 * n + 1, (int64_t{1} << 20) + 3}) {
      for (auto op : kOps) {
        if (op == ReduceOp::Avg && !is_float(dtype)) continue;
        const auto opts = AllReduceOptions().op(op);
        const at::Tensor values = uneven_values(numel, world().rank(), dtype);
        at::Tensor staged = values.clone();
        world().all_reduce(staged, opts);
        at::Tensor whole = world().allocate(numel, dtype);
        whole.copy_(values);
        world().all_reduce(whole, opts);
        EXPECT_TRUE(at::equal(whole, staged)) << "whole allocation " << label(dtype, numel, op);
        at::Tensor big = world().allocate(numel + 9, dtype);
        at::Tensor slice = big.narrow(0, 5, numel);
        slice.copy_(values);
        world().all_reduce(slice, opts);
        EXPECT_TRUE(at::equal(slice, staged)) << "slice " << label(dtype, numel, op);
        EXPECT_EQ(big.narrow(0, 0, 5).count_nonzero().item<int64_t>(), 0) << label(dtype, numel, op);
        EXPECT_EQ(big.narrow(0, numel + 5, 4).count_nonzero().item<int64_t>(), 0) << label(dtype, numel, op);
        // And against the reduction computed here in fp64, not by any path.
        at::Tensor exact = world().allocate(numel, dtype);
        exact.copy_(contribution(numel, world().rank(), dtype));
        world().all_reduce(exact, opts);
        expect_close(exact, expected_reduction(numel, dtype, op), "allocated " + label(dtype, numel, op));
      }
    }
  }
}

// Buffers that are not at the same place on every rank go the staged way,
// with the same result: allocated on one rank only, at offsets that differ
// by rank, in different allocations by rank.
TEST(Allocated, BuffersThatDifferByRankAreStillReduced) {
  const int64_t numel = (int64_t{1} << 18) + 5;
  const int rank = world().rank();
  const at::Tensor values = uneven_values(numel, rank, at::kFloat);
  at::Tensor want = values.clone();
  world().all_reduce(want);
  at::Tensor a = world().allocate(numel + 8, at::kFloat);
  at::Tensor b = world().allocate(numel, at::kFloat);
  const std::vector<at::Tensor> per_rank = {
      rank == 0 ? a.narrow(0, 0, numel) : values.clone(),
      a.narrow(0, rank % 2, numel),
      rank % 2 == 0 ? a.narrow(0, 0, numel) : b,
  };
  for (size_t k = 0; k < per_rank.size(); ++k) {
    at::Tensor t = per_rank[k];
    t.copy_(values);
    world().all_reduce(t);
    EXPECT_TRUE(at::equal(t, want)) << "case " << k;
  }
}

// reduce_scatter from allocated input and all_gather into allocated output
// (whole, or a slice at the same place on every rank) read the peers'
// buffers in place: the staged result to the bit, the fp64 reduction on
// exact values, and (where the group shares memory) the op counted as in
// place, while the same op on ordinary tensors is counted as staged. A
// path that silently always fell back would show in the counts.
TEST(Allocated, ReduceScatterAndAllGatherInPlaceGiveTheStagedResultToTheBit) {
  const int n = world().size(), rank = world().rank();
  const int64_t shared = shares_memory(world()) ? 1 : 0;
  // A float and an integer type: the paths move bytes and combine through
  // the one function the all-reduce test covers for every dtype.
  for (auto dtype : {at::kFloat, at::kInt}) {
    const int64_t at_threshold = (int64_t{256} << 10) / static_cast<int64_t>(c10::elementSize(dtype));
    for (int64_t numel : {int64_t{0}, int64_t{1}, int64_t{7}, 5 * int64_t{n} + 1, at_threshold - 1, at_threshold,
                          at_threshold * 3 + 2 * n + 1}) {
      const ShardRange mine = shard_range(numel, n, rank);
      const bool large = numel >= at_threshold;
      for (auto op : kOps) {
        if (op == ReduceOp::Avg && !is_float(dtype)) continue;
        const auto opts = ReduceScatterOptions().op(op);
        const at::Tensor values = uneven_values(numel, rank, dtype);
        at::Tensor staged = at::empty({mine.count}, values.options());
        auto before = world().path_counts();
        world().reduce_scatter(values, staged, opts);
        auto after = world().path_counts();
        EXPECT_EQ(after.staged - before.staged, large ? shared : 0) << "ordinary input " << label(dtype, numel, op);
        // Into a fresh shard, and into the input's own range.
        at::Tensor big = world().allocate(numel + 9, dtype);
        at::Tensor in = big.narrow(0, 5, numel);
        in.copy_(values);
        at::Tensor out = at::empty({mine.count}, values.options());
        before = world().path_counts();
        world().reduce_scatter(in, out, opts);
        after = world().path_counts();
        EXPECT_EQ(after.in_place - before.in_place, large ? shared : 0) << "allocated input " << label(dtype, numel, op);
        EXPECT_EQ(after.staged - before.staged, 0) << "allocated input " << label(dtype, numel, op);
        EXPECT_TRUE(at::equal(out, staged)) << "reduce_scatter, slice " << label(dtype, numel, op);
        EXPECT_EQ(big.narrow(0, 0, 5).count_nonzero().item<int64_t>(), 0) << label(dtype, numel, op);
        at::Tensor whole = world().allocate(numel, dtype);
        whole.copy_(values);
        at::Tensor own = whole.narrow(0, mine.offset, mine.count);
        world().reduce_scatter(whole, own, opts);
        EXPECT_TRUE(at::equal(own, staged)) << "reduce_scatter into its own range " << label(dtype, numel, op);
        // And against the reduction computed here in fp64, not by any path.
        at::Tensor exact = world().allocate(numel, dtype);
        exact.copy_(contribution(numel, rank, dtype));
        at::Tensor exact_out = at::empty({mine.count}, values.options());
        world().reduce_scatter(exact, exact_out, opts);
        expect_close(exact_out, expected_reduction(numel, dtype, op).narrow(0, mine.offset, mine.count),
                     "allocated reduce_scatter " + label(dtype, numel, op));
      }
      // all_gather: each rank's shard is its rank's values over its range.
      const at::Tensor expected = at::empty({numel}, at::TensorOptions().dtype(dtype));
      for (int p = 0; p < n; ++p) {
        const ShardRange r = shard_range(numel, n, p);
        expected.narrow(0, r.offset, r.count).copy_(uneven_values(numel, p, dtype).narrow(0, r.offset, r.count));
      }
      const at::Tensor shard = expected.narrow(0, mine.offset, mine.count).clone();
      at::Tensor staged = at::empty({numel}, shard.options());
      auto before = world().path_counts();
      world().all_gather(shard, staged);
      auto after = world().path_counts();
      EXPECT_EQ(after.staged - before.staged, large ? shared : 0) << "ordinary output " << label(dtype, numel, ReduceOp::Sum);
      EXPECT_TRUE(at::equal(staged, expected)) << "staged all_gather " << numel;
      at::Tensor big = world().allocate(numel + 9, dtype);
      at::Tensor out = big.narrow(0, 3, numel);
      out.narrow(0, mine.offset, mine.count).copy_(shard);
      before = world().path_counts();
      world().all_gather(out.narrow(0, mine.offset, mine.count), out);  // the shard already in place
      after = world().path_counts();
      EXPECT_EQ(after.in_place - before.in_place, large ? shared : 0) << "allocated output " << numel;
      EXPECT_TRUE(at::equal(out, expected)) << "all_gather into a slice, input in place " << numel;
      EXPECT_EQ(big.narrow(0, 0, 3).count_nonzero().item<int64_t>(), 0) << numel;
      EXPECT_EQ(big.narrow(0, numel + 3, 6).count_nonzero().item<int64_t>(), 0) << numel;
      at::Tensor whole = world().allocate(numel, dtype);
      world().all_gather(shard, whole);  // copied into its range first
      EXPECT_TRUE(at::equal(whole, expected)) << "all_gather into a whole allocation " << numel;
    }
  }
}

// ---- all_to_all ---------------------------------------------------------------

namespace {

// Rows rank i sends rank j, for each layout of the all_to_all matrix.
using Layout = int64_t (*)(int i, int j, int n);
struct NamedLayout {
  const char* name;
  Layout rows;
};
const NamedLayout kLayouts[] = {
    {"empty", [](int, int, int) -> int64_t { return 0; }},
    {"one", [](int, int, int) -> int64_t { return 1; }},
    {"uneven", [](int i, int j, int) -> int64_t { return (i + 2 * j) % 3 + i; }},
    {"last rank sends nothing", [](int i, int j, int n) -> int64_t { return i == n - 1 ? 0 : (i + j) % 4 + 1; }},
    {"rank 0 receives nothing", [](int i, int j, int) -> int64_t { return j == 0 ? 0 : 2 * i + j + 1; }},
    // Several pieces of the shared-memory slots, and several 1 MB segments' worth over TCP.
    {"large", [](int i, int j, int) -> int64_t { return 3001 + 7 * i + 5 * j; }},
};

// The value at element `index` of the part rank `src` sends rank `dst`:
// every part distinct, exact in float32 (below 2^24) and int64.
at::Tensor part_values(int src, int dst, int64_t numel) {
  return at::arange(numel, at::kLong) % 10000 + (int64_t{1000000} * src + int64_t{10000} * dst);
}

// Rank `me`'s input (what it sends each rank, in rank order) or the output
// it must end with (what each rank sends it), rows of `width` elements.
at::Tensor all_to_all_buffer(Layout rows, int me, int n, int64_t width, at::ScalarType dtype, bool input,
                             std::vector<int64_t>* splits) {
  std::vector<at::Tensor> pieces;
  splits->clear();
  for (int p = 0; p < n; ++p) {
    const int64_t count = input ? rows(me, p, n) : rows(p, me, n);
    splits->push_back(count);
    pieces.push_back(input ? part_values(me, p, count * width) : part_values(p, me, count * width));
  }
  const int64_t total = std::accumulate(splits->begin(), splits->end(), int64_t{0});
  return at::cat(pieces).to(dtype).reshape({total, width});
}

// Every layout, in float32 and int64, rows of 1 and of 3 elements, on `c`:
// the output equals the parts computed here, and the input is unchanged.
void check_all_to_all(Communicator& c, const std::string& where) {
  const int n = c.size(), me = c.rank();
  for (auto dtype : {at::kFloat, at::kLong}) {
    for (int64_t width : {1, 3}) {
      for (const NamedLayout& layout : kLayouts) {
        std::vector<int64_t> in_splits, out_splits;
        at::Tensor in = all_to_all_buffer(layout.rows, me, n, width, dtype, true, &in_splits);
        const at::Tensor want = all_to_all_buffer(layout.rows, me, n, width, dtype, false, &out_splits);
        if (width == 1) in = in.flatten();  // 1-D: splits count elements
        const at::Tensor in_copy = in.clone();
        at::Tensor out = at::full(width == 1 ? want.flatten().sizes() : want.sizes(), -1, dtype);
        c.all_to_all(in, in_splits, out, out_splits).wait();
        EXPECT_TRUE(at::equal(out.reshape(want.sizes()), want))
            << where << " all_to_all " << layout.name << " " << c10::toString(dtype) << " width " << width;
        EXPECT_TRUE(at::equal(in, in_copy)) << where << " all_to_all changed its input";
      }
    }
  }
}

}  // namespace

TEST(Collectives, AllToAll) { check_all_to_all(world(), "world"); }

// Two at once, asynchronously, beside an all_reduce: each keeps its own parts.
TEST(Collectives, AllToAllInFlightWithOthers) {
  const int n = world().size(), me = world().rank();
  std::vector<int64_t> a_in, a_out, b_in, b_out;
  const Layout uneven = kLayouts[2].rows, silent = kLayouts[3].rows;
  at::Tensor a = all_to_all_buffer(uneven, me, n, 1, at::kFloat, true, &a_in).flatten();
  at::Tensor b = all_to_all_buffer(silent, me, n, 2, at::kLong, true, &b_in);
  const at::Tensor a_want = all_to_all_buffer(uneven, me, n, 1, at::kFloat, false, &a_out).flatten();
  const at::Tensor b_want = all_to_all_buffer(silent, me, n, 2, at::kLong, false, &b_out);
  at::Tensor a_got = at::empty_like(a_want), b_got = at::empty_like(b_want);
  auto sum = contribution(1001, me, at::kFloat);
  Work wa = world().all_to_all(a, a_in, a_got, a_out, AllToAllOptions().async(true));
  Work ws = world().all_reduce(sum, AllReduceOptions().async(true));
  Work wb = world().all_to_all(b, b_in, b_got, b_out, AllToAllOptions().async(true));
  wb.wait();
  ws.wait();
  wa.wait();
  EXPECT_TRUE(at::equal(a_got, a_want));
  EXPECT_TRUE(at::equal(b_got, b_want));
  expect_close(sum, expected_reduction(1001, at::kFloat, ReduceOp::Sum), "all_reduce between all_to_alls");
}

TEST(PointToPoint, RingExchangeWithoutDeadlock) {
  if (world().size() < 2) GTEST_SKIP() << "needs two ranks";
  const int n = world().size(), r = world().rank();
  for (int64_t numel : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{1} << 21}) {
    auto out = contribution(numel, r, at::kFloat);
    auto in = at::full({numel}, -1.0f);
    // Both sides post their send before their recv: must not deadlock.
    Work s = world().send(out, (r + 1) % n, P2POptions().tag(5));
    Work q = world().recv(in, (r + n - 1) % n, P2POptions().tag(5));
    s.wait();
    q.wait();
    EXPECT_TRUE(at::equal(in, contribution(numel, (r + n - 1) % n, at::kFloat))) << numel;
  }
}

TEST(PointToPoint, TagsKeepMessagesApart) {
  if (world().size() < 2) GTEST_SKIP() << "needs two ranks";
  if (world().rank() == 0) {
    auto a = at::full({4}, 1.0f), b = at::full({4}, 2.0f);
    Work wa = world().send(a, 1, P2POptions().tag(1));
    Work wb = world().send(b, 1, P2POptions().tag(2));
    wa.wait();
    wb.wait();
  } else if (world().rank() == 1) {
    auto b = at::zeros({4}), a = at::zeros({4});
    world().recv(b, 0, P2POptions().tag(2)).wait();  // received in the other order
    world().recv(a, 0, P2POptions().tag(1)).wait();
    EXPECT_TRUE(at::equal(a, at::full({4}, 1.0f)));
    EXPECT_TRUE(at::equal(b, at::full({4}, 2.0f)));
  }
  world().barrier();
}

TEST(SubGroups, EvenAndOddRanksReduceSeparately) {
  const int n = world().size(), r = world().rank();
  std::vector<int> even, odd;
  for (int i = 0; i < n; ++i) (i % 2 == 0 ? even : odd).push_back(i);
  auto g_even = world().new_group(even);
  auto g_odd = odd.empty() ? nullptr : world().new_group(odd);
  auto mine = r % 2 == 0 ? g_even : g_odd;
  ASSERT_NE(mine, nullptr);
  EXPECT_EQ(r % 2 == 0 ? g_odd : g_even, nullptr);
  const auto& members = r % 2 == 0 ? even : odd;
  EXPECT_EQ(mine->size(), static_cast<int>(members.size()));
  EXPECT_EQ(mine->global_ranks(), members);

  for (int64_t numel : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{100001}}) {
    auto t = contribution(numel, r, at::kFloat);
    // A world op in flight at the same time as the sub-group op.
    auto w = contribution(numel, r, at::kFloat);
    Work ww = world().all_reduce(w, AllReduceOptions().async(true));
    mine->all_reduce(t);
    ww.wait();
    auto want = at::zeros({numel}, at::kDouble);
    for (int m : members) want += contribution(numel, m, at::kDouble);
    expect_close(t, want, "sub-group all_reduce n=" + std::to_string(numel));
    expect_close(w, expected_reduction(numel, at::kFloat, ReduceOp::Sum), "world beside sub-group");

    const ShardRange s = shard_range(numel, mine->size(), mine->rank());
    auto out = at::empty({s.count});
    mine->reduce_scatter(contribution(numel, r, at::kFloat), out);
    expect_close(out, want.narrow(0, s.offset, s.count), "sub-group reduce_scatter");
  }
  world().barrier();
}

// The even and the odd ranks each run every all_to_all layout in a group of
// their own, at the same time.
TEST(SubGroups, AllToAllInEachGroup) {
  const int n = world().size(), r = world().rank();
  std::vector<int> even, odd;
  for (int i = 0; i < n; ++i) (i % 2 == 0 ? even : odd).push_back(i);
  auto g_even = world().new_group(even);
  auto g_odd = odd.empty() ? nullptr : world().new_group(odd);
  auto mine = r % 2 == 0 ? g_even : g_odd;
  ASSERT_NE(mine, nullptr);
  check_all_to_all(*mine, mine->name());
  world().barrier();
}

// Local mistakes throw at the call; counts that disagree between ranks throw
// the same error on every rank (in a group of its own: the error breaks it),
// never a hang or a write past a buffer.
TEST(Errors, AllToAllBadArgumentsAreTypedErrors) {
  const int n = world().size(), me = world().rank();
  const std::vector<int64_t> ones(static_cast<size_t>(n), 1);
  auto in = at::ones({n}), out = at::zeros({n});
  std::vector<int64_t> short_splits(ones.begin(), ones.end() - 1);
  EXPECT_THROW(world().all_to_all(in, short_splits, out, ones), InvalidArgument);
  EXPECT_THROW(world().all_to_all(in, ones, out, std::vector<int64_t>(n + 1, 0)), InvalidArgument);
  std::vector<int64_t> too_many = ones;
  too_many[0] = 2;
  EXPECT_THROW(world().all_to_all(in, too_many, out, ones), InvalidArgument);
  std::vector<int64_t> negative = ones;
  negative[0] = -1;
  if (n > 1) negative[n - 1] += 2;  // the right sum, one count negative
  EXPECT_THROW(world().all_to_all(in, ones, out, negative), InvalidArgument);
  EXPECT_THROW(world().all_to_all(in, ones, at::zeros({n}, at::kLong), ones), InvalidArgument);
  EXPECT_THROW(world().all_to_all(in, ones, at::zeros({n, 2}), ones), InvalidArgument);
  EXPECT_THROW(world().all_to_all(at::ones({2 * n}).view({n, 2}).t(), ones, at::zeros({2, n}), ones), InvalidArgument);
  EXPECT_THROW(world().all_to_all(at::ones({}), {1}, at::zeros({}), {1}), InvalidArgument);
  EXPECT_THROW(world().all_to_all(in, ones, in, ones), InvalidArgument);  // overlap
  if (n < 2) return;
  std::vector<int> everyone(static_cast<size_t>(n));
  std::iota(everyone.begin(), everyone.end(), 0);
  auto group = world().new_group(everyone);
  // Rank 0 sends rank 1 two rows where rank 1 expects one.
  std::vector<int64_t> sends = ones;
  if (me == 0) sends[1] = 2;
  auto bigger = at::ones({me == 0 ? n + 1 : n});
  try {
    group->all_to_all(bigger, sends, out, ones);
    ADD_FAILURE() << "all_to_all with counts that disagree returned";
  } catch (const InvalidArgument& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("rank 0 sends rank 1 2 rows"), std::string::npos) << msg;
    EXPECT_NE(msg.find("expects 1"), std::string::npos) << msg;
  }
  world().barrier();
}

TEST(Errors, BadArgumentsAreTypedErrors) {
  auto t = at::ones({10});
  EXPECT_THROW(world().all_reduce(t.t().contiguous().unsqueeze(1).expand({10, 2})), InvalidArgument);
  EXPECT_THROW(world().all_reduce(at::ones({3}, at::kBool)), InvalidArgument);
  EXPECT_THROW(world().all_reduce(at::ones({3}, at::kInt), AllReduceOptions().op(ReduceOp::Avg)),
               InvalidArgument);
  auto wrong = at::empty({shard_range(10, world().size(), world().rank()).count + 1});
  EXPECT_THROW(world().reduce_scatter(t, wrong), InvalidArgument);
  EXPECT_THROW(world().broadcast(t, BroadcastOptions().root(world().size())), InvalidArgument);
  EXPECT_THROW(world().new_group({world().size()}), InvalidArgument);
}

// Whether the world runs on the mpi backend: the endpoint text, which
// `shardtrain train` prints at start-up, says so.
bool on_mpi(const Communicator& c) { return c.endpoint().rfind("MPI: ", 0) == 0; }

// Under mpirun (which sets PMIX_RANK) every group runs on the mpi backend;
// otherwise ranks of one host exchange through shared memory, in every
// group, unless SHARDTRAIN_SHM=0 (the TCP path then carries everything).
TEST(Transport, RanksOfOneHostShareMemoryUnlessTurnedOff) {
  const bool mpirun = std::getenv("PMIX_RANK") != nullptr;
  EXPECT_EQ(on_mpi(world()), mpirun && world().size() > 1) << world().endpoint();
  if (world().size() > 2) {
    auto pair = world().new_group({0, 1});
    if (pair) EXPECT_EQ(on_mpi(*pair), mpirun) << pair->endpoint();
  }
  const char* off = std::getenv("SHARDTRAIN_SHM");
  const bool expect = !mpirun && world().size() > 1 && !(off != nullptr && std::string(off) == "0");
  const auto shares = [](const Communicator& c) {
    return c.endpoint().find("through shared memory") != std::string::npos;
  };
  EXPECT_EQ(shares(world()), expect) << world().endpoint();
  if (world().size() > 2) {
    auto pair = world().new_group({0, 1});
    if (pair) EXPECT_EQ(shares(*pair), expect) << pair->endpoint();
  }
}

// Gloo writes to its sockets without MSG_NOSIGNAL, so on the gloo path a
// write to a peer that died must fail with EPIPE instead of killing this
// rank with SIGPIPE: the op then fails with an error that names the peer.
// Checked with a plain write() to a socket whose other end is closed.
TEST(Transport, AWriteToADeadPeerFailsInsteadOfKillingTheRank) {
  if (world().size() < 2 || on_mpi(world())) return;  // no Gloo sockets here
  int pair[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, pair), 0);
  ::close(pair[1]);
  const char byte = 1;
  errno = 0;
  EXPECT_EQ(::write(pair[0], &byte, 1), -1);
  EXPECT_EQ(errno, EPIPE);
  ::close(pair[0]);
}

// A peer that is alive but never joins the collective: the op fails with a
// TimeoutError naming the op, its sequence number, the group and both ranks,
// within the op's timeout; the group is unusable afterwards.
TEST(Faults, PeerThatNeverJoinsTimesOut) {
  if (world().size() < 2) GTEST_SKIP() << "needs two ranks";
  auto pair = world().new_group({0, 1});
  if (world().rank() == 0) {
    auto t = at::ones({1000});
    const auto start = std::chrono::steady_clock::now();
    try {
      pair->all_reduce(t, AllReduceOptions().timeout(std::chrono::milliseconds(1500)));
      ADD_FAILURE() << "all_reduce without its peer returned";
    } catch (const TimeoutError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("all_reduce #0"), std::string::npos) << msg;
      EXPECT_NE(msg.find("[0,1]'"), std::string::npos) << msg;
      EXPECT_NE(msg.find("on rank 0"), std::string::npos) << msg;
      // MPI does not tell which rank a collective waits for.
      if (!on_mpi(world())) EXPECT_NE(msg.find("peer rank 1"), std::string::npos) << msg;
    }
    // Within the op's 1.5 s, not the communicator's (SHARDTRAIN_TIMEOUT_S, 60
    // s or more under ctest); the margin is for a loaded machine.
    const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_LT(took, 30.0);
    EXPECT_THROW(pair->all_reduce(t), CommError);  // broken for good
  }
  world().barrier();
  // MPI cannot cancel rank 0's collective: rank 1 joins it late, so that no
  // operation is left pending when MPI shuts down.
  if (on_mpi(world()) && world().rank() == 1) pair->all_reduce(at::ones({1000}));
  world().barrier();
}

// A peer that leaves (its side of the connections closes): the op fails with
// a CommError soon, not at the end of a long timeout.
TEST(Faults, PeerThatLeavesFailsFast) {
  if (world().size() < 2) GTEST_SKIP() << "needs two ranks";
  auto pair = world().new_group({0, 1});
  if (world().rank() == 1) {
    pair.reset();  // closes rank 1's connections in this group
  } else if (world().rank() == 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    auto t = at::ones({1 << 16});
    const auto start = std::chrono::steady_clock::now();
    EXPECT_THROW(pair->all_reduce(t, AllReduceOptions().timeout(std::chrono::seconds(60))), CommError);
    // Well before the op's 60 s timeout; the margin is for a loaded machine.
    const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_LT(took, 40.0);
  }
  world().barrier();
}
