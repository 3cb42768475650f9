// Hierarchical all-reduce for a group spread over H hosts with k ranks on each.
//
// A flat ring over such a group sends 2(W-1)/W of the buffer out of every
// host, and all of it through one rank's connection to the next host. Here:
//   1. reduce-scatter inside the host (shared memory): local rank i ends with
//      the host's sum of piece i = shard_range(N, k, i);
//   2. ring all-reduce of piece i among the ranks with local index i on every
//      host: k rings of N/k, one per local index, so every rank's connection
//      carries an equal share and each host sends 2(H-1)/H of the buffer;
//   3. all-gather inside the host (shared memory).
// Rounding: bfloat16/float16 are combined in float32 and rounded once per
// combination, k-1 times inside the host and H-1 times across hosts, so at
// most W-1 times as on the flat ring. Avg sums throughout and divides by W
// on the last hop across hosts, before that hop's rounding, as the flat ring
// divides on its last hop.
#include <cstdlib>
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
  for (const auto& m : members) {
    if (m.size() != k) return std::nullopt;
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
  if (host.shm != nullptr) {
    host.shm->reduce_scatter(host, all, mine, numel, dtype, inner);
  } else {
    ring_reduce_scatter(host, all, mine, numel, dtype, inner);
  }

  // 2. Piece i across hosts: a ring all-reduce among the ranks with local index i.
  const ShardRange part = shard_range(piece.count, cross.size, cross.rank);
  ring_reduce_scatter(cross, mine, mine + part.offset * es, piece.count, dtype, op,
                      op == ReduceOp::Avg ? oc.size : 0);
  OpContext cross_gather = cross;
  cross_gather.phase = 1;
  ring_all_gather(cross_gather, mine, piece.count, dtype);

  // 3. Every piece to every rank of the host.
  OpContext host_gather = host;
  host_gather.phase = 2;
  if (host.shm != nullptr) {
    host.shm->all_gather(host_gather, all, numel, dtype);
  } else {
    ring_all_gather(host_gather, all, numel, dtype);
  }
}

}  // namespace shardtrain::comm::detail
