// Hierarchical collectives across hosts, run by every rank of a job spread over
// two network-namespace hosts with k ranks on each (hierarchical.sh): parity
// with the exact reduction and with the flat rings (SHARDTRAIN_HIERARCHICAL=0),
// and the bytes that leave a host, read from its veth counters.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "shardtrain/comm/communicator.h"
#include "shardtrain/core/error.h"
#include "world.h"

using namespace shardtrain;
using namespace shardtrain::comm;

namespace {

Communicator& world() { return *::shardtrain::testing::world_ptr(); }

bool hierarchical(const Communicator& c) {
  return c.endpoint().find("hierarchical across hosts") != std::string::npos;
}

// A group of every rank, made with SHARDTRAIN_HIERARCHICAL set to `value`.
std::shared_ptr<Communicator> all_ranks_with(const char* value) {
  std::vector<int> all;
  for (int r = 0; r < world().size(); ++r) all.push_back(r);
  setenv("SHARDTRAIN_HIERARCHICAL", value, 1);
  auto group = world().new_group(all);
  unsetenv("SHARDTRAIN_HIERARCHICAL");
  return group;
}

// Rank r's contribution: small integers, exact in bfloat16 and in its sums.
at::Tensor contribution(int64_t numel, int rank, at::ScalarType dtype) {
  auto idx = at::arange(numel, at::kLong);
  return ((idx * 7 + rank * 3) % 13 + rank + 1).to(dtype);
}

// Rank r's contribution: reals, so every combination rounds.
at::Tensor reals(int64_t numel, int rank, at::ScalarType dtype) {
  auto idx = at::arange(numel, at::kDouble);
  return at::sin(idx * 0.37 + rank * 1.91) * (rank + 1.5);
}

at::Tensor exact(int64_t numel, ReduceOp op, at::Tensor (*make)(int64_t, int, at::ScalarType)) {
  auto acc = make(numel, 0, at::kDouble).to(at::kDouble);
  for (int r = 1; r < world().size(); ++r) {
    auto c = make(numel, r, at::kDouble).to(at::kDouble);
    acc = op == ReduceOp::Max ? at::maximum(acc, c) : acc + c;
  }
  return op == ReduceOp::Avg ? acc / world().size() : acc;
}

// This host's bytes sent over its link to the other host: the counter of
// the interface this rank's connections use (the first word of endpoint()).
int64_t link_tx_bytes() {
  const std::string ep = world().endpoint();
  std::ifstream in("/sys/class/net/" + ep.substr(0, ep.find(' ')) + "/statistics/tx_bytes");
  int64_t bytes = -1;
  in >> bytes;
  return bytes;
}

}  // namespace

// Two hosts with k > 1 ranks each: the world goes hierarchical, a group made
// with SHARDTRAIN_HIERARCHICAL=0 runs flat rings, and the setting must be
// the same on every rank.
TEST(Hierarchical, OnAcrossHostsUnlessTurnedOff) {
  EXPECT_TRUE(hierarchical(world())) << world().endpoint();
  EXPECT_FALSE(hierarchical(*all_ranks_with("0")));
  EXPECT_TRUE(hierarchical(*all_ranks_with("1")));
  EXPECT_THROW(all_ranks_with("yes"), ConfigError);
  EXPECT_THROW(all_ranks_with(world().rank() == 0 ? "0" : "1"), ConfigError);
}

// Sizes 0, 1, not divisible by the world size, and several segments.
TEST(Hierarchical, AllReduceMatchesTheExactReductionAndTheFlatRings) {
  auto flat = all_ranks_with("0");
  const int64_t n = world().size();
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    for (int64_t numel : {int64_t{0}, int64_t{1}, 5 * n + 1, int64_t{40009}}) {
      for (auto op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max}) {
        const std::string what = std::string(c10::toString(dtype)) + " n=" +
                                 std::to_string(numel) + " " + to_string(op);
        auto h = contribution(numel, world().rank(), dtype);
        auto f = h.clone();
        world().all_reduce(h, AllReduceOptions().op(op));
        flat->all_reduce(f, AllReduceOptions().op(op));
        // Sums and maxima of the small integers are exact; Avg divides once.
        EXPECT_TRUE(at::equal(h, f)) << what;
        if (numel == 0) continue;
        const double err = (h.to(at::kDouble) - exact(numel, op, contribution)).abs().max().item<double>();
        EXPECT_LE(err, (dtype == at::kBFloat16 ? 1e-2 : 1e-6) * 64) << what;
      }
    }
  }
}

// reduce_scatter and all_gather keep the world's shard_range split.
TEST(Hierarchical, ReduceScatterAndAllGatherMatchTheExactResultAndTheFlatRings) {
  auto flat = all_ranks_with("0");
  const int64_t n = world().size();
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    for (int64_t numel : {int64_t{0}, int64_t{1}, 5 * n + 1, int64_t{40009}}) {
      const ShardRange mine = shard_range(numel, world().size(), world().rank());
      for (auto op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max}) {
        const std::string what = std::string(c10::toString(dtype)) + " n=" +
                                 std::to_string(numel) + " " + to_string(op);
        auto in = contribution(numel, world().rank(), dtype);
        auto h = at::full({mine.count}, -1, dtype);
        auto f = h.clone();
        world().reduce_scatter(in, h, ReduceScatterOptions().op(op));
        flat->reduce_scatter(in, f, ReduceScatterOptions().op(op));
        EXPECT_TRUE(at::equal(h, f)) << "reduce_scatter " << what;
        EXPECT_TRUE(at::equal(in, contribution(numel, world().rank(), dtype))) << what;
        auto want = exact(numel, op, contribution).narrow(0, mine.offset, mine.count);
        if (mine.count > 0) {
          const double err = (h.to(at::kDouble) - want).abs().max().item<double>();
          EXPECT_LE(err, (dtype == at::kBFloat16 ? 1e-2 : 1e-6) * 64) << "reduce_scatter " << what;
        }
      }
      // Every rank's shard, from its own input (which may alias the output).
      auto whole = contribution(numel, 0, dtype);
      for (int r = 1; r < world().size(); ++r) {
        const ShardRange s = shard_range(numel, world().size(), r);
        whole.narrow(0, s.offset, s.count).copy_(contribution(numel, r, dtype).narrow(0, s.offset, s.count));
      }
      auto mine_in = contribution(numel, world().rank(), dtype).narrow(0, mine.offset, mine.count).clone();
      auto h = at::full({numel}, -1, dtype);
      world().all_gather(mine_in, h);
      EXPECT_TRUE(at::equal(h, whole)) << "all_gather " << c10::toString(dtype) << " n=" << numel;
      auto aliased = at::full({numel}, -1, dtype);
      aliased.narrow(0, mine.offset, mine.count).copy_(mine_in);
      world().all_gather(aliased.narrow(0, mine.offset, mine.count), aliased);
      EXPECT_TRUE(at::equal(aliased, whole)) << "all_gather in place " << c10::toString(dtype) << " n=" << numel;
    }
  }
}

// all_to_all across hosts (it takes the pairwise TCP path there): uneven
// counts with empty parts, the last rank sending nothing, rows of 2, and a
// sub-group of one rank per host; every element says which rank sent it to
// which, and where in the part it was.
TEST(Hierarchical, AllToAllAcrossHostsGivesEveryPartToItsRank) {
  const auto rows = [](int i, int j, int n) -> int64_t { return i == n - 1 ? 0 : (3 * i + j) % 4 + 1000 * (j % 2); };
  const auto part = [](int src, int dst, int64_t numel) {
    return at::arange(numel, at::kLong) + (int64_t{1000000} * src + int64_t{10000} * dst);
  };
  const int k = world().size() / 2;
  std::vector<int> one_per_host{0, k};
  auto pair = world().new_group(one_per_host);
  for (Communicator* c : {&world(), pair.get()}) {
    if (c == nullptr) continue;
    const int n = c->size(), me = c->rank();
    for (auto dtype : {at::kFloat, at::kLong}) {
      std::vector<int64_t> in_splits, out_splits;
      std::vector<at::Tensor> ins, wants;
      for (int p = 0; p < n; ++p) {
        in_splits.push_back(rows(me, p, n));
        out_splits.push_back(rows(p, me, n));
        ins.push_back(part(me, p, 2 * in_splits.back()));
        wants.push_back(part(p, me, 2 * out_splits.back()));
      }
      // Rows given, not -1: a rank that sends (or gets) nothing has an empty tensor.
      auto in = at::cat(ins).to(dtype).view({at::cat(ins).numel() / 2, 2});
      auto want = at::cat(wants).to(dtype).view({at::cat(wants).numel() / 2, 2});
      auto out = at::full_like(want, -1);
      c->all_to_all(in, in_splits, out, out_splits);
      EXPECT_TRUE(at::equal(out, want)) << c->name() << " " << c10::toString(dtype);
    }
  }
  world().barrier();
}

// Reals round at every combination: both paths stay within the documented
// bound of W-1 roundings of the running sum (|error| <= (W-1) * eps * sum|x|).
TEST(Hierarchical, RoundingStaysWithinTheFlatRingsBound) {
  auto flat = all_ranks_with("0");
  const int W = world().size();
  const int64_t numel = 4099;
  auto bound = at::zeros({numel}, at::kDouble);
  for (int r = 0; r < W; ++r) bound += reals(numel, r, at::kDouble).abs();
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    const double eps = dtype == at::kBFloat16 ? 1.0 / 256 : 1.0 / (1 << 23);
    for (auto op : {ReduceOp::Sum, ReduceOp::Avg}) {
      auto want = exact(numel, op, reals);
      auto scale = op == ReduceOp::Avg ? bound / W : bound;
      // Each rank's input is itself rounded to the dtype once.
      auto limit = scale * (W * eps);
      for (auto* group : {&world(), flat.get()}) {
        auto t = reals(numel, world().rank(), dtype).to(dtype);
        group->all_reduce(t, AllReduceOptions().op(op));
        auto excess = (t.to(at::kDouble) - want).abs() - limit;
        EXPECT_LE(excess.max().item<double>(), 0.0)
            << c10::toString(dtype) << " " << to_string(op) << " on " << group->name();
      }
    }
  }
}

// The bytes a host sends over its link in one all_reduce of B bytes: a flat
// ring over W ranks crosses each way once and sends 2(W-1)/W B; the
// hierarchical one sends 2(H-1)/H B (k rings of B/k). Headers and
// acknowledgements add a few per cent.
TEST(Hierarchical, FewerBytesLeaveTheHost) {
  auto flat = all_ranks_with("0");
  const int W = world().size();
  const int hosts = 2;
  const int64_t numel = int64_t{1} << 21;  // 8 MB of float32
  const double B = static_cast<double>(numel) * 4;
  const auto sent = [&](Communicator& group) {
    auto t = contribution(numel, world().rank(), at::kFloat);
    // Read before the barrier: after it, another rank of this host may
    // already be sending its part over the shared link.
    const int64_t before = link_tx_bytes();
    world().barrier();
    group.all_reduce(t);
    world().barrier();
    return static_cast<double>(link_tx_bytes() - before);
  };
  const double flat_bytes = sent(*flat);
  const double hier_bytes = sent(world());
  const double flat_model = 2.0 * (W - 1) / W * B;
  const double hier_model = 2.0 * (hosts - 1) / hosts * B;
  std::printf("rank %d: bytes out of this host per all_reduce of %.0f: flat %.0f (model %.0f), "
              "hierarchical %.0f (model %.0f): %.2fx fewer\n",
              world().rank(), B, flat_bytes, flat_model, hier_bytes, hier_model,
              flat_bytes / hier_bytes);
  EXPECT_GT(flat_bytes, 0.98 * flat_model);
  EXPECT_LT(flat_bytes, 1.15 * flat_model);
  EXPECT_GT(hier_bytes, 0.98 * hier_model);
  EXPECT_LT(hier_bytes, 1.15 * hier_model);
}
