#include <gtest/gtest.h>

#include <sstream>
#include <string>
#include <vector>

#include "shardtrain/core/error.h"
#include "shardtrain/models/gpt.h"
#include "shardtrain/strategy/estimate.h"
#include "strategy/detail.h"

using shardtrain::ConfigError;
using shardtrain::InvalidArgument;
using shardtrain::strategy::choose_strategy;
using shardtrain::strategy::default_memory_budget_bytes;
using shardtrain::strategy::estimate_all;
using shardtrain::strategy::EstimateInput;
using shardtrain::strategy::StrategyEstimate;
using shardtrain::strategy::detail::memory_budget_bytes;

namespace {

const StrategyEstimate& find(const std::vector<StrategyEstimate>& all, const std::string& name) {
  for (const auto& e : all) {
    if (e.strategy == name) return e;
  }
  ADD_FAILURE() << "no estimate for " << name;
  static const StrategyEstimate none;
  return none;
}

#undef EXPECT_HAS  // each test file defines its own (the unit tests build as one unity target)
#define EXPECT_HAS(msg, part) \
  EXPECT_NE((msg).find(part), std::string::npos) << "missing \"" << (part) << "\" in: " << (msg)

}  // namespace

TEST(Estimate, StrategiesInOrder) {
  std::vector<std::string> names;
  for (const auto& e : estimate_all({})) names.push_back(e.strategy);
  EXPECT_EQ(names, (std::vector<std::string>{"ddp", "zero1", "fsdp/shard_grad_op",
                                             "fsdp/full_shard", "fsdp/hybrid_shard",
                                             "fsdp/no_shard"}));
}

// The ZeRO paper's example (Figure 1): Ψ = 7.5B, N = 64, mixed precision Adam:
// 120 GB, 31.4 GB, 16.6 GB, 1.9 GB.
TEST(Estimate, ZeroPaperExampleMixedPrecision) {
  EstimateInput in;
  in.num_params = 7'500'000'000;
  in.world_size = 64;
  in.local_world_size = 8;
  in.mixed_precision = true;
  const auto all = estimate_all(in);
  EXPECT_DOUBLE_EQ(find(all, "ddp").model_state_bytes, 120e9);
  EXPECT_DOUBLE_EQ(find(all, "zero1").model_state_bytes, 31.40625e9);
  EXPECT_DOUBLE_EQ(find(all, "fsdp/shard_grad_op").model_state_bytes, 16.640625e9);
  EXPECT_DOUBLE_EQ(find(all, "fsdp/full_shard").model_state_bytes, 1.875e9);
  EXPECT_DOUBLE_EQ(find(all, "fsdp/no_shard").model_state_bytes, 120e9);
  // hybrid: full_shard within a node of 8.
  EXPECT_DOUBLE_EQ(find(all, "fsdp/hybrid_shard").model_state_bytes, 15e9);
  for (const auto& e : all) {
    EXPECT_EQ(e.total_bytes, e.model_state_bytes) << e.strategy;  // no units, no activations
  }
}

TEST(Estimate, ZeroPaperExampleFp32) {
  EstimateInput in;
  in.num_params = 7'500'000'000;
  in.world_size = 64;
  const auto all = estimate_all(in);
  EXPECT_DOUBLE_EQ(find(all, "ddp").model_state_bytes, 120e9);
  EXPECT_DOUBLE_EQ(find(all, "zero1").model_state_bytes, 60e9 + 8 * 117'187'500.0);
  EXPECT_DOUBLE_EQ(find(all, "fsdp/shard_grad_op").model_state_bytes, 30e9 + 12 * 117'187'500.0);
  EXPECT_DOUBLE_EQ(find(all, "fsdp/full_shard").model_state_bytes, 1.875e9);
  // local_world_size 1: hybrid shards over nothing, so it holds everything.
  EXPECT_DOUBLE_EQ(find(all, "fsdp/hybrid_shard").model_state_bytes, 120e9);
}

// 1000 parameters over 3 ranks: the largest shard holds ceil(1000/3) = 334.
TEST(Estimate, NonDivisibleWorldSizeUsesTheLargestShard) {
  EstimateInput in;
  in.num_params = 1000;
  in.largest_unit_params = 100;
  in.second_unit_params = 50;
  in.world_size = 3;
  in.local_world_size = 3;
  in.activation_bytes = 7;
  in.mixed_precision = true;
  auto all = estimate_all(in);
  EXPECT_EQ(find(all, "ddp").model_state_bytes, 16000);
  EXPECT_EQ(find(all, "zero1").model_state_bytes, 4000 + 12 * 334);
  EXPECT_EQ(find(all, "fsdp/shard_grad_op").model_state_bytes, 2000 + 14 * 334);
  EXPECT_EQ(find(all, "fsdp/full_shard").model_state_bytes, 16 * 334);
  EXPECT_EQ(find(all, "fsdp/hybrid_shard").model_state_bytes, 16 * 334);
  EXPECT_EQ(find(all, "fsdp/no_shard").model_state_bytes, 16000);
  // Gathered: (100 + 50) elements × 2 bytes × (params + grads), full/hybrid only.
  EXPECT_EQ(find(all, "fsdp/full_shard").gathered_bytes, 600);
  EXPECT_EQ(find(all, "fsdp/hybrid_shard").gathered_bytes, 600);
  EXPECT_EQ(find(all, "fsdp/shard_grad_op").gathered_bytes, 0);
  EXPECT_EQ(find(all, "ddp").gathered_bytes, 0);
  EXPECT_EQ(find(all, "fsdp/full_shard").total_bytes, 16 * 334 + 600 + 7);
  EXPECT_EQ(find(all, "zero1").activation_bytes, 7);

  in.mixed_precision = false;
  all = estimate_all(in);
  EXPECT_EQ(find(all, "ddp").model_state_bytes, 16000);
  EXPECT_EQ(find(all, "zero1").model_state_bytes, 8000 + 8 * 334);
  EXPECT_EQ(find(all, "fsdp/shard_grad_op").model_state_bytes, 4000 + 12 * 334);
  EXPECT_EQ(find(all, "fsdp/full_shard").model_state_bytes, 16 * 334);
  EXPECT_EQ(find(all, "fsdp/full_shard").gathered_bytes, 1200);  // 4-byte compute copy
}

TEST(Estimate, CommunicationVolumes) {
  EstimateInput in;
  in.num_params = 10;
  in.world_size = 8;
  in.local_world_size = 4;
  const auto all = estimate_all(in);
  EXPECT_EQ(find(all, "ddp").comm_volume, 2.0);
  EXPECT_EQ(find(all, "fsdp/no_shard").comm_volume, 2.0);
  EXPECT_EQ(find(all, "fsdp/shard_grad_op").comm_volume, 2.0);
  EXPECT_EQ(find(all, "zero1").comm_volume, 3.0);
  EXPECT_EQ(find(all, "fsdp/full_shard").comm_volume, 3.0);
  EXPECT_EQ(find(all, "fsdp/hybrid_shard").comm_volume, 3.5);  // 3 + 2/4
  // One node: nothing crosses nodes, hybrid_shard is full_shard.
  in.local_world_size = 8;
  EXPECT_EQ(find(estimate_all(in), "fsdp/hybrid_shard").comm_volume, 3.0);
}

TEST(Estimate, BadInputsAreErrors) {
  EstimateInput in;
  in.num_params = -1;
  EXPECT_THROW(estimate_all(in), InvalidArgument);
  in = {};
  in.world_size = 0;
  EXPECT_THROW(estimate_all(in), InvalidArgument);
  in = {};
  in.world_size = 6;
  in.local_world_size = 4;
  EXPECT_THROW(estimate_all(in), InvalidArgument);
  EXPECT_THROW(default_memory_budget_bytes(0), InvalidArgument);
}

// Ψ = 1e6 on 4 ranks, mixed precision, two units of 1e5, 1 MB of activations:
//   ddp 17e6 (comm 2), zero1 8e6 (3), shard_grad_op 6.5e6 (2),
//   full_shard 5.8e6 (3; 0.8e6 of it two gathered units), hybrid 5.8e6 (3),
//   no_shard 17e6 (2).
class ChooseStrategy : public ::testing::Test {
 protected:
  ChooseStrategy() {
    in.num_params = 1'000'000;
    in.largest_unit_params = 100'000;
    in.second_unit_params = 100'000;
    in.world_size = 4;
    in.local_world_size = 4;
    in.mixed_precision = true;
    in.activation_bytes = 1'000'000;
  }
  EstimateInput in;
};

TEST_F(ChooseStrategy, TotalsAreAsComputedByHand) {
  const auto all = estimate_all(in);
  EXPECT_EQ(find(all, "ddp").total_bytes, 17e6);
  EXPECT_EQ(find(all, "zero1").total_bytes, 8e6);
  EXPECT_EQ(find(all, "fsdp/shard_grad_op").total_bytes, 6.5e6);
  EXPECT_EQ(find(all, "fsdp/full_shard").gathered_bytes, 0.8e6);
  EXPECT_EQ(find(all, "fsdp/full_shard").total_bytes, 5.8e6);
  EXPECT_EQ(find(all, "fsdp/hybrid_shard").total_bytes, 5.8e6);
}

TEST_F(ChooseStrategy, BigBudgetPicksDdp) {
  // ddp, no_shard and shard_grad_op all move 2Ψ; ddp needs one collective.
  EXPECT_EQ(choose_strategy(in, 1e12).strategy, "ddp");
  EXPECT_EQ(choose_strategy(in, 17e6).strategy, "ddp");  // exactly the budget fits
}

TEST_F(ChooseStrategy, MiddleBudgetPicksShardGradOp) {
  EXPECT_EQ(choose_strategy(in, 17e6 - 1).strategy, "fsdp/shard_grad_op");
  EXPECT_EQ(choose_strategy(in, 6.5e6).strategy, "fsdp/shard_grad_op");
}

TEST_F(ChooseStrategy, SmallBudgetPicksFullShard) {
  // On one node hybrid_shard is full_shard; the first listed wins the tie.
  EXPECT_EQ(choose_strategy(in, 6e6).strategy, "fsdp/full_shard");
  EXPECT_EQ(choose_strategy(in, 5.8e6).strategy, "fsdp/full_shard");
}

TEST_F(ChooseStrategy, TinyBudgetIsAnErrorNamingTheSmallestTotal) {
  try {
    choose_strategy(in, 5e6);
    FAIL() << "no ConfigError";
  } catch (const ConfigError& e) {
    const std::string msg = e.what();
    EXPECT_HAS(msg, "memory budget of 4.77 MiB per rank");
    EXPECT_HAS(msg, "the smallest, fsdp/full_shard, needs 5.53 MiB");
    EXPECT_HAS(msg, "distributed.memory_budget_mb");
  }
}

// Checked on fixed meminfo text: this machine's MemAvailable moves between
// two reads (other processes allocate), so two reads cannot be compared.
TEST(Estimate, DefaultBudgetIsAvailableMemoryPerLocalRank) {
  const std::string meminfo =
      "MemTotal:       16000000 kB\n"
      "MemFree:         1000000 kB\n"
      "MemAvailable:    8000000 kB\n"
      "Buffers:          100000 kB\n";
  for (int ranks : {1, 3, 4}) {
    std::istringstream in(meminfo);
    EXPECT_DOUBLE_EQ(memory_budget_bytes(in, ranks), 8000000.0 * 1024 / ranks) << ranks;
  }
  std::istringstream no_line("MemTotal:       16000000 kB\nMemFree:         1000000 kB\n");
  try {
    memory_budget_bytes(no_line, 1);
    ADD_FAILURE() << "no ConfigError without a MemAvailable line";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("distributed.memory_budget_mb"), std::string::npos)
        << e.what();
  }
  std::istringstream in(meminfo);
  EXPECT_THROW(memory_budget_bytes(in, 0), InvalidArgument);
  // This machine's own.
  EXPECT_GT(default_memory_budget_bytes(1), 0.0);
}

// B=2, T=32, C=64, a=4, V=100, 2 bytes: a layer holds 2·32·64·(34 + 5·4·32/64) = 180224
// bytes, the logits 2·32·100·2·2 = 25600.
TEST(Estimate, GptActivationBytes) {
  shardtrain::models::GPTConfig g;
  g.n_layer = 2;
  g.n_head = 4;
  g.n_embd = 64;
  g.block_size = 32;
  g.vocab_size = 100;
  using shardtrain::strategy::gpt_activation_bytes;
  EXPECT_EQ(gpt_activation_bytes(g, 2, 2), 2 * 180224 + 25600);
  EXPECT_EQ(gpt_activation_bytes(g, 2, 4), 2 * (2 * 180224 + 25600));
  EXPECT_EQ(gpt_activation_bytes(g, 0, 2), 0);
  // Checkpointed: each layer keeps 2·B·T·C·bytes, and one layer is recomputed in full.
  g.activation_checkpointing = true;
  EXPECT_EQ(gpt_activation_bytes(g, 2, 2), 2 * (2 * 2 * 32 * 64 * 2) + 180224 + 25600);
  EXPECT_THROW(gpt_activation_bytes(g, 2, 0), InvalidArgument);
}

TEST(Estimate, MlpActivationBytes) {
  using shardtrain::strategy::mlp_activation_bytes;
  // [64, 128, 64], B=8, 4 bytes: inputs 64 + 128, GELU 128, output and grad 2·64.
  EXPECT_EQ(mlp_activation_bytes({64, 128, 64}, 8, 4), 8 * 4 * (64 + 128 + 128 + 128));
  EXPECT_EQ(mlp_activation_bytes({3, 5}, 2, 2), 2 * 2 * (3 + 2 * 5));
}

// A LoRA run: Ψ is the adapters; the frozen base has no gradient or optimizer
// state and is held whole where parameters are replicated, sharded where
// they are sharded.
TEST(Estimate, FrozenBaseIsHeldLikeTheParametersWithoutState) {
  EstimateInput in;
  in.num_params = 1000;
  in.frozen_bytes = 8'000'000;
  in.world_size = 4;
  in.local_world_size = 2;
  const auto all = estimate_all(in);
  EXPECT_EQ(find(all, "ddp").model_state_bytes, 16'000 + 8e6);
  EXPECT_EQ(find(all, "zero1").model_state_bytes, 8'000 + 2'000 + 8e6);
  EXPECT_EQ(find(all, "fsdp/shard_grad_op").model_state_bytes, 4'000 + 3'000 + 8e6);
  EXPECT_EQ(find(all, "fsdp/full_shard").model_state_bytes, 4'000 + 2e6);
  EXPECT_EQ(find(all, "fsdp/hybrid_shard").model_state_bytes, 8'000 + 4e6);
  EXPECT_EQ(find(all, "fsdp/no_shard").model_state_bytes, 16'000 + 8e6);
  in.frozen_bytes = -1;
  EXPECT_THROW(estimate_all(in), InvalidArgument);
}
