// Hierarchical collectives for a group spread over H hosts with k ranks on each.
//
// A flat ring over such a group sends 2(W-1)/W of the buffer out of every
// host, and all of it through one rank's connection to the next host. Here:
//   1. reduce-scatter inside the host (shared memory): local rank i ends with
//      the host's sum of piece i = shard_range(N, k, i);
//   2. ring all-reduce of piece i among the ranks with local index i on every
//      host: k rings of N/k, one per local index, so every rank's connection
//      carries an equal share and each host sends 2(H-1)/H of the buffer
//      (a small piece goes in one round instead: one_round_all_reduce);
//   3. all-gather inside the host (shared memory).
// Rounding: bfloat16/float16 are combined in float32 and rounded once per
// combination, k-1 times inside the host and H-1 times across hosts, so at
// most W-1 times as on the flat ring. Avg sums throughout and divides by W
// on the last hop across hosts, before that hop's rounding, as the flat ring
// divides on its last hop.
//
// reduce_scatter and all_gather keep the world's shard_range(N, W, r): the
// buffer is first packed so that local rank i's piece holds its shards on
// every host (repack), then steps 1-2 (3 and 2 for all_gather) run on it.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

#include "comm/detail.h"
#include "comm/shm.h"
#include "shardtrain/core/error.h"

namespace shardtrain::comm::detail {

std::optional<Levels> plan_levels(const std::vector<int>& global_ranks, int rank,
                                  int ranks_per_node) {
  if (ranks_per_node <= 0) return std::nullopt;
  // Group ranks by host, hosts in order of their first rank.
  std::vector<int> nodes;
  std::vector<std::vector<int>> members;
  for (int r = 0; r < static_cast<int>(global_ranks.size()); ++r) {
    const int node = global_ranks[r] / ranks_per_node;
    size_t h = 0;
    while (h < nodes.size() && nodes[h] != node) ++h;
    if (h == nodes.size()) {
      nodes.push_back(node);
      members.emplace_back();
    }
    members[h].push_back(r);
  }
  const size_t k = members[0].size();
  if (nodes.size() < 2 || k < 2) return std::nullopt;
  // Host h holds group ranks h*k .. h*k+k-1 (ranks sorted, nodes numbered
  // in rank order make it so; the shard packing below relies on it).
  for (size_t h = 0; h < members.size(); ++h) {
    if (members[h].size() != k) return std::nullopt;
    for (size_t i = 0; i < k; ++i) {
      if (members[h][i] != static_cast<int>(h * k + i)) return std::nullopt;
    }
  }
  Levels levels;
  for (size_t h = 0; h < members.size(); ++h) {
    for (size_t i = 0; i < k; ++i) {
      if (members[h][i] != rank) continue;
      levels.host_index = static_cast<int>(h);
      levels.local_index = static_cast<int>(i);
    }
  }
  levels.host = members[levels.host_index];
  for (const auto& m : members) levels.cross.push_back(m[levels.local_index]);
  return levels;
}

bool hierarchical_from_env() {
  const char* v = std::getenv("SHARDTRAIN_HIERARCHICAL");
  if (v == nullptr || *v == '\0') return true;
  const std::string s = v;
  ST_CHECK(s == "0" || s == "1", ConfigError, "SHARDTRAIN_HIERARCHICAL='", s,
           "' must be 1 (hierarchical collectives across hosts, the default) or 0 (flat rings)");
  return s == "1";
}

namespace {

// Between the world's shard order (shard_range(N, W, r), r = h*k + i) and
// the packed order: block i = the shards of local rank i on every host, h
// ascending. Block i then has exactly shard_range(N, k, i)'s place and
// size, and the shard of host h is shard_range(block, H, h) within it, so
// the shared-memory and ring algorithms run on it unchanged.
void repack(const char* from, char* to, int64_t numel, int hosts, int k, size_t es, bool pack) {
  const int world = hosts * k;
  int64_t packed = 0;
  for (int i = 0; i < k; ++i) {
    for (int h = 0; h < hosts; ++h) {
      const ShardRange s = shard_range(numel, world, h * k + i);
      const int64_t a = pack ? s.offset : packed;
      const int64_t b = pack ? packed : s.offset;
      if (s.count > 0) std::memcpy(to + b * es, from + a * es, s.count * es);
      packed += s.count;
    }
  }
}

// The two steps inside a host: through shared memory when the host level
// has it, else its ring. `phase` tells an all-gather's messages apart from
// those of the op's earlier steps.
void host_reduce_scatter(const OpContext& host, const void* in, void* out, int64_t numel,
                         DType dtype, ReduceOp op) {
  if (host.shm != nullptr) {
    host.shm->reduce_scatter(host, in, out, numel, dtype, op);
  } else {
    ring_reduce_scatter(host, in, out, numel, dtype, op);
  }
}

void host_all_gather(const OpContext& host, void* buf, int64_t numel, DType dtype, int phase) {
  OpContext gather = host;
  gather.phase = phase;
  if (host.shm != nullptr) {
    host.shm->all_gather(gather, buf, numel, dtype);
  } else {
    ring_all_gather(gather, buf, numel, dtype);
  }
}

}  // namespace

void hierarchical_all_reduce(const OpContext& oc, void* buf, int64_t numel, DType dtype,
                             ReduceOp op) {
  const OpContext& host = *oc.host;
  const OpContext& cross = *oc.cross;
  const size_t es = element_size(dtype);
  char* all = static_cast<char*>(buf);
  const ReduceOp inner = op == ReduceOp::Avg ? ReduceOp::Sum : op;

  // 1. This host's sum of piece i lands in place, in piece i of `buf`.
  const ShardRange piece = shard_range(numel, host.size, host.rank);
  char* mine = all + piece.offset * es;
  host_reduce_scatter(host, all, mine, numel, dtype, inner);

  // 2. Piece i across hosts: an all-reduce among the ranks with local index
  //    i, in one round when it is small, else as a ring.
  const int avg_divisor = op == ReduceOp::Avg ? oc.size : 0;
  tcp_all_reduce(cross, mine, piece.count, dtype, op, avg_divisor);

  // 3. Every piece to every rank of the host.
  host_all_gather(host, all, numel, dtype, 2);
}

void hierarchical_reduce_scatter(const OpContext& oc, const void* in, void* out, int64_t numel,
                                 DType dtype, ReduceOp op) {
  const OpContext& host = *oc.host;
  const OpContext& cross = *oc.cross;
  const size_t es = element_size(dtype);
  const ReduceOp inner = op == ReduceOp::Avg ? ReduceOp::Sum : op;
  char* packed = oc.scratch->get(0, std::max<size_t>(1, numel * es));
  repack(static_cast<const char*>(in), packed, numel, cross.size, host.size, es, true);

  // 1. Local rank i gets its host's sum of block i: its shards on every host.
  const ShardRange block = shard_range(numel, host.size, host.rank);
  char* sum = oc.scratch->get(1, std::max<size_t>(1, block.count * es));
  host_reduce_scatter(host, packed, sum, numel, dtype, inner);
  // 2. Across hosts: host h's part of block i is world shard h*k + i.
  ring_reduce_scatter(cross, sum, out, block.count, dtype, op, op == ReduceOp::Avg ? oc.size : 0);
}

void hierarchical_all_gather(const OpContext& oc, const void* in, void* out, int64_t numel,
                             DType dtype) {
  const OpContext& host = *oc.host;
  const OpContext& cross = *oc.cross;
  const size_t es = element_size(dtype);
  char* packed = oc.scratch->get(0, std::max<size_t>(1, numel * es));
  const ShardRange block = shard_range(numel, host.size, host.rank);
  char* mine = packed + block.offset * es;

  // 1. Across hosts: block i from world shards h*k + i of every host.
  const ShardRange part = shard_range(block.count, cross.size, cross.rank);
  if (part.count > 0) std::memcpy(mine + part.offset * es, in, part.count * es);
  ring_all_gather(cross, mine, block.count, dtype);
  // 2. Every block to every rank of the host, then back to the world order.
  host_all_gather(host, packed, numel, dtype, 1);
  repack(packed, static_cast<char*>(out), numel, cross.size, host.size, es, false);
}

}  // namespace shardtrain::comm::detail
