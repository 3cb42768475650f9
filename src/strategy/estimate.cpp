// Memory and communication estimates per strategy (see estimate.h for the
// formulas and where they come from).
#include "shardtrain/strategy/estimate.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <sstream>
#include <string>

#include "core/file.h"
#include "shardtrain/core/error.h"
#include "shardtrain/launch/env.h"
#include "shardtrain/models/gpt.h"
#include "strategy/detail.h"

namespace shardtrain::strategy {
namespace {

// Elements of the largest of n shards of `numel` elements.
double shard(int64_t numel, int n) { return static_cast<double>((numel + n - 1) / n); }

// "12.34 MiB" below 1 GiB, "1.23 GiB" from there.
std::string size_text(double bytes) {
  const double m = bytes / (1024.0 * 1024.0);
  char buf[64];
  if (m < 1024.0) {
    std::snprintf(buf, sizeof(buf), "%.2f MiB", m);
  } else {
    std::snprintf(buf, sizeof(buf), "%.2f GiB", m / 1024.0);
  }
  return buf;
}

// Bytes as int64, at most INT64_MAX (converting a larger double is undefined).
int64_t saturate(double bytes) {
  constexpr double kMax = 9.2e18;  // just below 2^63
  return bytes >= kMax ? std::numeric_limits<int64_t>::max() : static_cast<int64_t>(bytes);
}

}  // namespace

std::vector<StrategyEstimate> estimate_all(const EstimateInput& in) {
  ST_CHECK(in.num_params >= 0 && in.largest_unit_params >= 0 && in.second_unit_params >= 0 &&
               in.activation_bytes >= 0 && in.frozen_bytes >= 0,
           InvalidArgument, "estimate: parameter counts and activation bytes must be >= 0, got Ψ=",
           in.num_params, ", units ", in.largest_unit_params, " and ", in.second_unit_params,
           ", activations ", in.activation_bytes);
  ST_CHECK(in.world_size >= 1, InvalidArgument, "estimate: world_size must be >= 1, got ",
           in.world_size);
  // Nodes that run different numbers of ranks (shardtrain launch says so in
  // SHARDTRAIN_NODE_SIZES) cannot run hybrid_shard, which shards within a
  // node: it is left out rather than estimated with this node's size, and
  // the ranks per node need not divide the world.
  const bool uneven_nodes = !dist::node_sizes_from_env().empty();
  ST_CHECK(in.local_world_size >= 1 && (uneven_nodes || in.world_size % in.local_world_size == 0),
           InvalidArgument, "estimate: local_world_size must be >= 1 and divide world_size=",
           in.world_size, ", got ", in.local_world_size, "; every node runs the same number of ranks");

  const double psi = static_cast<double>(in.num_params);
  const bool mixed = in.mixed_precision;
  // Bytes per parameter: [replicated, sharded] parts of each ZeRO stage.
  const double compute_bytes = mixed ? 2.0 : 4.0;
  const double frozen = static_cast<double>(in.frozen_bytes);
  // The trainable state, plus the frozen parameters whole (n = 0) or sharded.
  const auto stage = [&](double whole, double sharded, int n, int frozen_over = 1) {
    return whole * psi + sharded * shard(in.num_params, n) + std::ceil(frozen / frozen_over);
  };
  // Two units gathered at once (computing and prefetched), params + grads.
  const double gathered = static_cast<double>(in.largest_unit_params + in.second_unit_params) *
                          compute_bytes * 2.0;
  const double activations = static_cast<double>(in.activation_bytes);
  const int n = in.world_size;
  const int n_local = in.local_world_size;

  std::vector<StrategyEstimate> out;
  const auto add = [&](StrategyKind kind, Sharding sharding, double state, double gather,
                       double comm, int colls) {
    StrategyEstimate e;
    e.kind = kind;
    e.sharding = sharding;
    e.strategy = StrategyOptions().strategy(kind).sharding(sharding).display_name();
    e.model_state_bytes = state;
    e.gathered_bytes = gather;
    e.activation_bytes = activations;
    e.total_bytes = state + gather + activations;
    e.comm_volume = comm;
    e.collectives = colls;
    out.push_back(e);
  };
  add(StrategyKind::Ddp, Sharding::FullShard, stage(16, 0, n), 0.0, 2.0, 1);
  add(StrategyKind::Zero1, Sharding::FullShard, mixed ? stage(4, 12, n) : stage(8, 8, n), 0.0, 3.0, 2);
  add(StrategyKind::Fsdp, Sharding::ShardGradOp, mixed ? stage(2, 14, n) : stage(4, 12, n), 0.0, 2.0, 2);
  add(StrategyKind::Fsdp, Sharding::FullShard, stage(0, 16, n, n), gathered, 3.0, 3);
  // hybrid_shard: full_shard within a node, then an all-reduce of each
  // rank's shard (Ψ/N_local) across nodes; on one node there is no such step.
  const bool nodes = n > n_local;
  if (!uneven_nodes) {
    add(StrategyKind::Fsdp, Sharding::HybridShard, stage(0, 16, n_local, n_local), gathered,
        nodes ? 3.0 + 2.0 / n_local : 3.0, nodes ? 4 : 3);
  }
  add(StrategyKind::Fsdp, Sharding::NoShard, stage(16, 0, n), 0.0, 2.0, 1);
  return out;
}

StrategyEstimate choose_strategy(const EstimateInput& in, double budget_bytes) {
  const std::vector<StrategyEstimate> all = estimate_all(in);
  const StrategyEstimate* best = nullptr;
  const StrategyEstimate* smallest = &all.front();
  for (const StrategyEstimate& e : all) {
    if (e.total_bytes < smallest->total_bytes) smallest = &e;
    if (e.total_bytes > budget_bytes) continue;
    const bool better =
        best == nullptr || e.comm_volume < best->comm_volume ||
        (e.comm_volume == best->comm_volume &&
         (e.collectives < best->collectives ||
          (e.collectives == best->collectives && e.total_bytes < best->total_bytes)));
    if (better) best = &e;
  }
  ST_CHECK(best != nullptr, ConfigError, "no strategy fits the memory budget of ",
           size_text(budget_bytes), " per rank: the smallest, ", smallest->strategy, ", needs ",
           size_text(smallest->total_bytes), " (model state ",
           size_text(smallest->model_state_bytes),
           ", gathered units ", size_text(smallest->gathered_bytes), ", activations ",
           size_text(smallest->activation_bytes),
           "); raise distributed.memory_budget_mb, add ranks, lower batch.micro or turn on "
           "model.activation_checkpointing");
  return *best;
}

double default_memory_budget_bytes(int local_world_size) {
  // Unreadable: an empty text, which memory_budget_bytes refuses with a hint.
  std::string text, why;
  if (!::shardtrain::detail::read_regular_file("/proc/meminfo", int64_t{1} << 20, &text, &why)) text.clear();
  std::istringstream meminfo(text);
  return detail::memory_budget_bytes(meminfo, local_world_size);
}

double detail::memory_budget_bytes(std::istream& meminfo, int local_world_size) {
  ST_CHECK(local_world_size >= 1, InvalidArgument, "local_world_size must be >= 1, got ",
           local_world_size);
  std::string line;
  while (std::getline(meminfo, line)) {
    std::istringstream fields(line);
    std::string key, unit;
    double kib = 0.0;
    if (fields >> key >> kib >> unit && key == "MemAvailable:") {
      return kib * 1024.0 / local_world_size;
    }
  }
  throw ConfigError(
      "cannot read MemAvailable from /proc/meminfo to size the memory budget; set "
      "distributed.memory_budget_mb to the MiB one rank may use");
}

int64_t gpt_activation_bytes(const models::GPTConfig& config, int64_t micro_batch,
                             int bytes_per_element) {
  ST_CHECK(micro_batch >= 0 && bytes_per_element > 0, InvalidArgument,
           "gpt_activation_bytes: micro_batch must be >= 0 and bytes_per_element > 0, got ",
           micro_batch, " and ", bytes_per_element);
  const double b = static_cast<double>(micro_batch);
  const double t = static_cast<double>(config.block_size);
  const double c = static_cast<double>(config.n_embd);
  const double a = static_cast<double>(config.n_head);
  const double v = static_cast<double>(config.vocab_size);
  const double bytes = bytes_per_element;
  // Korthikanti et al.: s·b·h·(34 + 5·a·s/h) bytes per layer in 16-bit.
  const double full_layer = b * t * c * (34.0 + 5.0 * a * t / c) * bytes / 2.0;
  const double logits = b * t * v * bytes * 2.0;
  const double layers = static_cast<double>(config.n_layer);
  const double blocks = config.activation_checkpointing
                            ? layers * 2.0 * b * t * c * bytes + full_layer
                            : layers * full_layer;
  return saturate(blocks + logits);
}

int64_t mlp_activation_bytes(const std::vector<int64_t>& sizes, int64_t micro_batch,
                             int bytes_per_element) {
  ST_CHECK(sizes.size() >= 2 && micro_batch >= 0 && bytes_per_element > 0, InvalidArgument,
           "mlp_activation_bytes: needs at least two widths, micro_batch >= 0 and "
           "bytes_per_element > 0");
  // In doubles: widths from a config may be absurd and must not overflow.
  double elements = 2.0 * static_cast<double>(sizes.back());                        // output and its gradient
  for (size_t i = 0; i + 1 < sizes.size(); ++i) elements += static_cast<double>(sizes[i]);  // Linear inputs
  for (size_t i = 1; i + 1 < sizes.size(); ++i) elements += static_cast<double>(sizes[i]);  // GELU inputs
  return saturate(static_cast<double>(micro_batch) * elements * bytes_per_element);
}

}  // namespace shardtrain::strategy
