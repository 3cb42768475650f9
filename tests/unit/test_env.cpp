// ClusterEnv::from_variables and first_slurm_host: every source, the order
// between them, the master defaults and the errors for bad input; nodes of
// different sizes (SHARDTRAIN_NODE_SIZES) and what refuses them.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <string>
#include <vector>

#include "shardtrain/comm/mesh.h"
#include "shardtrain/core/error.h"
#include "shardtrain/launch/env.h"
#include "shardtrain/strategy/estimate.h"

namespace {

using shardtrain::ConfigError;
using shardtrain::dist::ClusterEnv;
using shardtrain::dist::EnvSource;
using shardtrain::dist::first_slurm_host;
using Vars = std::map<std::string, std::string>;

// The ConfigError's message, or a failure when none was thrown.
std::string config_error(const Vars& vars) {
  try {
    ClusterEnv::from_variables(vars);
  } catch (const ConfigError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no ConfigError was thrown";
  return "";
}

#define EXPECT_ERROR_NAMES(vars, ...)                                  \
  do {                                                                 \
    const std::string msg = config_error(vars);                        \
    for (const char* part : {__VA_ARGS__}) {                           \
      EXPECT_NE(msg.find(part), std::string::npos) << part << " in: " << msg; \
    }                                                                  \
  } while (0)

TEST(ClusterEnv, StandaloneWhenNothingIsSet) {
  const ClusterEnv env = ClusterEnv::from_variables({});
  EXPECT_EQ(env.source, EnvSource::Standalone);
  EXPECT_EQ(env.rank, 0);
  EXPECT_EQ(env.world_size, 1);
  EXPECT_EQ(env.local_world_size, 1);
  EXPECT_EQ(env.master_addr, "127.0.0.1");
  EXPECT_EQ(env.master_port, 29500);
  EXPECT_EQ(env.restart_count, 0);
  EXPECT_EQ(env.num_nodes(), 1);
}

TEST(ClusterEnv, StandaloneTakesMasterAndRestartCount) {
  const ClusterEnv env = ClusterEnv::from_variables(
      {{"MASTER_ADDR", "h0"}, {"MASTER_PORT", "1234"}, {"SHARDTRAIN_RESTART_COUNT", "2"}});
  EXPECT_EQ(env.master_addr, "h0");
  EXPECT_EQ(env.master_port, 1234);
  EXPECT_EQ(env.restart_count, 2);
}

TEST(ClusterEnv, TorchrunFull) {
  const ClusterEnv env = ClusterEnv::from_variables(
      {{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "4"},
       {"GROUP_RANK", "1"}, {"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "29400"}});
  EXPECT_EQ(env.source, EnvSource::Torchrun);
  EXPECT_EQ(env.rank, 5);
  EXPECT_EQ(env.world_size, 8);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.local_world_size, 4);
  EXPECT_EQ(env.node_rank, 1);
  EXPECT_EQ(env.num_nodes(), 2);
  EXPECT_EQ(env.master_addr, "10.0.0.1");
  EXPECT_EQ(env.master_port, 29400);
  EXPECT_EQ(env.describe(),
            "rank 5/8 (local 1/4, node 1) master 10.0.0.1:29400 via torchrun");
}

TEST(ClusterEnv, TorchrunWithoutLocalVariablesIsOneNode) {
  const ClusterEnv env = ClusterEnv::from_variables({{"RANK", "2"}, {"WORLD_SIZE", "3"}});
  EXPECT_EQ(env.local_rank, 2);
  EXPECT_EQ(env.local_world_size, 3);
  EXPECT_EQ(env.node_rank, 0);
  EXPECT_EQ(env.master_addr, "127.0.0.1");
  EXPECT_EQ(env.master_port, 29500);
}

TEST(ClusterEnv, TorchrunDerivesLocalRankAndNodeFromLocalWorldSize) {
  const ClusterEnv env = ClusterEnv::from_variables(
      {{"RANK", "7"}, {"WORLD_SIZE", "8"}, {"LOCAL_WORLD_SIZE", "2"}, {"MASTER_ADDR", "m"}});
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.node_rank, 3);
}

TEST(ClusterEnv, TorchrunBadInput) {
  EXPECT_ERROR_NAMES((Vars{{"RANK", "0"}}), "WORLD_SIZE");
  EXPECT_ERROR_NAMES((Vars{{"LOCAL_RANK", "0"}}), "RANK", "WORLD_SIZE");
  EXPECT_ERROR_NAMES((Vars{{"RANK", "4"}, {"WORLD_SIZE", "4"}}), "RANK=4", "WORLD_SIZE=4");
  EXPECT_ERROR_NAMES((Vars{{"RANK", "x1"}, {"WORLD_SIZE", "4"}}), "RANK", "x1");
  EXPECT_ERROR_NAMES((Vars{{"RANK", "1"}, {"WORLD_SIZE", "4 "}}), "WORLD_SIZE");
  EXPECT_ERROR_NAMES((Vars{{"RANK", "-1"}, {"WORLD_SIZE", "4"}}), "RANK=-1", "negative");
  EXPECT_ERROR_NAMES((Vars{{"RANK", "0"}, {"WORLD_SIZE", "0"}}), "WORLD_SIZE=0");
  EXPECT_ERROR_NAMES((Vars{{"RANK", "0"}, {"WORLD_SIZE", "99999999999"}}), "WORLD_SIZE");
  EXPECT_ERROR_NAMES(
      (Vars{{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "2"}, {"LOCAL_WORLD_SIZE", "2"}}),
      "LOCAL_RANK=2", "LOCAL_WORLD_SIZE=2");
  EXPECT_ERROR_NAMES((Vars{{"RANK", "0"}, {"WORLD_SIZE", "5"}, {"LOCAL_WORLD_SIZE", "2"}}),
                     "WORLD_SIZE=5", "LOCAL_WORLD_SIZE=2", "divisible");
  // RANK must be GROUP_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK.
  EXPECT_ERROR_NAMES((Vars{{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "0"},
                           {"LOCAL_WORLD_SIZE", "2"}, {"MASTER_ADDR", "m"}}),
                     "RANK=1", "LOCAL_RANK");
  EXPECT_ERROR_NAMES((Vars{{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"GROUP_RANK", "1"}}),
                     "GROUP_RANK=1", "LOCAL_WORLD_SIZE");
  EXPECT_ERROR_NAMES((Vars{{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_WORLD_SIZE", "2"}}),
                     "MASTER_ADDR");
  EXPECT_ERROR_NAMES((Vars{{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"MASTER_PORT", "70000"}}),
                     "MASTER_PORT=70000");
  EXPECT_ERROR_NAMES((Vars{{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"MASTER_PORT", "0"}}),
                     "MASTER_PORT=0");
  EXPECT_ERROR_NAMES((Vars{{"SHARDTRAIN_RESTART_COUNT", "one"}}), "SHARDTRAIN_RESTART_COUNT");
}

// Nodes of 2, 1 and 3 ranks (SHARDTRAIN_NODE_SIZES, as shardtrain launch
// sets it): node 0 holds ranks 0-1, node 1 rank 2, node 2 ranks 3-5.
TEST(ClusterEnv, TorchrunNodesOfDifferentSizes) {
  const Vars node2 = {{"RANK", "4"},           {"WORLD_SIZE", "6"}, {"LOCAL_RANK", "1"},
                      {"LOCAL_WORLD_SIZE", "3"}, {"GROUP_RANK", "2"}, {"MASTER_ADDR", "m"},
                      {"SHARDTRAIN_NODE_SIZES", "2,1,3"}};
  ClusterEnv env = ClusterEnv::from_variables(node2);
  EXPECT_EQ(env.rank, 4);
  EXPECT_EQ(env.world_size, 6);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.local_world_size, 3);
  EXPECT_EQ(env.node_rank, 2);
  EXPECT_EQ(env.num_nodes(), 3);
  EXPECT_TRUE(env.uneven_nodes());
  EXPECT_EQ(env.node_sizes, (std::vector<int>{2, 1, 3}));
  EXPECT_EQ(env.describe(), "rank 4/6 (local 1/3, node 2) master m:29500 via torchrun, nodes of 2,1,3 ranks");
  // Node 1's only rank; LOCAL_RANK and GROUP_RANK derived from the list.
  env = ClusterEnv::from_variables({{"RANK", "2"}, {"WORLD_SIZE", "6"}, {"LOCAL_WORLD_SIZE", "1"},
                                    {"MASTER_ADDR", "m"}, {"SHARDTRAIN_NODE_SIZES", "2,1,3"}});
  EXPECT_EQ(env.local_rank, 0);
  EXPECT_EQ(env.node_rank, 1);
  // Equal entries are the usual layout: nothing is recorded.
  env = ClusterEnv::from_variables({{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_WORLD_SIZE", "2"},
                                    {"MASTER_ADDR", "m"}, {"SHARDTRAIN_NODE_SIZES", "2,2"}});
  EXPECT_FALSE(env.uneven_nodes());
  EXPECT_EQ(env.num_nodes(), 2);
  EXPECT_EQ(env.node_rank, 1);
}

TEST(ClusterEnv, TorchrunNodesOfDifferentSizesBadInput) {
  const Vars good = {{"RANK", "2"},           {"WORLD_SIZE", "3"}, {"LOCAL_RANK", "0"},
                     {"LOCAL_WORLD_SIZE", "1"}, {"GROUP_RANK", "1"}, {"MASTER_ADDR", "m"},
                     {"SHARDTRAIN_NODE_SIZES", "2,1"}};
  EXPECT_EQ(ClusterEnv::from_variables(good).rank, 2);
  auto with = [&](const char* name, const char* value) {
    Vars v = good;
    v[name] = value;
    return v;
  };
  EXPECT_ERROR_NAMES(with("WORLD_SIZE", "4"), "WORLD_SIZE=4", "sum 3", "SHARDTRAIN_NODE_SIZES");
  EXPECT_ERROR_NAMES(with("LOCAL_WORLD_SIZE", "2"), "LOCAL_WORLD_SIZE=2", "node 1's entry 1");
  EXPECT_ERROR_NAMES(with("RANK", "1"), "RANK=1", "first rank 2");
  EXPECT_ERROR_NAMES(with("GROUP_RANK", "2"), "GROUP_RANK=2", "2 nodes");
  EXPECT_ERROR_NAMES(with("SHARDTRAIN_NODE_SIZES", "2,,1"), "SHARDTRAIN_NODE_SIZES='2,,1'");
  EXPECT_ERROR_NAMES(with("SHARDTRAIN_NODE_SIZES", "2,0"), "SHARDTRAIN_NODE_SIZES='2,0'");
  // Equal entries that disagree with the torchrun variables.
  EXPECT_ERROR_NAMES((Vars{{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"LOCAL_WORLD_SIZE", "2"},
                           {"MASTER_ADDR", "m"}, {"SHARDTRAIN_NODE_SIZES", "1,1"}}),
                     "SHARDTRAIN_NODE_SIZES=1,1", "2 node(s) of 2");
}

TEST(NodeSizes, ParseAndText) {
  using shardtrain::dist::node_sizes_text;
  using shardtrain::dist::parse_node_sizes;
  EXPECT_EQ(parse_node_sizes("2,1"), (std::vector<int>{2, 1}));
  EXPECT_EQ(parse_node_sizes("7"), (std::vector<int>{7}));
  EXPECT_EQ(parse_node_sizes("4,4,16"), (std::vector<int>{4, 4, 16}));
  EXPECT_EQ(node_sizes_text({2, 1}), "2,1");
  EXPECT_EQ(node_sizes_text({}), "");
  for (const char* bad : {"", ",", "2,", ",2", "2;1", "2, 1", "-1,2", "0", "1x", "9999999999"}) {
    EXPECT_THROW(parse_node_sizes(bad), ConfigError) << "'" << bad << "'";
  }
}

TEST(NodeSizes, RequireEvenNodesNamesTheSizesAndWhatToDo) {
  using shardtrain::dist::require_even_nodes;
  EXPECT_NO_THROW(require_even_nodes({}, "hybrid_shard", "use full_shard"));
  try {
    require_even_nodes({2, 1}, "distributed.sharding=hybrid_shard", "use full_shard");
    ADD_FAILURE() << "no ConfigError";
  } catch (const ConfigError& e) {
    const std::string msg = e.what();
    for (const char* part : {"distributed.sharding=hybrid_shard needs the same number of ranks on every node",
                             "the nodes run 2,1 ranks (SHARDTRAIN_NODE_SIZES); use full_shard"}) {
      EXPECT_NE(msg.find(part), std::string::npos) << part << " in: " << msg;
    }
  }
}

// SHARDTRAIN_NODE_SIZES set for the length of a test, as the launcher sets it.
class NodeSizesVar {
 public:
  explicit NodeSizesVar(const char* value) { ::setenv("SHARDTRAIN_NODE_SIZES", value, 1); }
  ~NodeSizesVar() { ::unsetenv("SHARDTRAIN_NODE_SIZES"); }
};

TEST(NodeSizes, FromEnvIsEmptyUnlessTheNodesDiffer) {
  using shardtrain::dist::node_sizes_from_env;
  EXPECT_TRUE(node_sizes_from_env().empty());
  {
    NodeSizesVar even("2,2");
    EXPECT_TRUE(node_sizes_from_env().empty());
  }
  NodeSizesVar uneven("2,1");
  EXPECT_EQ(node_sizes_from_env(), (std::vector<int>{2, 1}));
}

// Over nodes of 2 and 1 ranks: the plain data-parallel mesh is the world,
// hybrid_shard and tensor parallelism are refused naming the sizes, and the
// estimates leave hybrid_shard out instead of failing on 3 % 2.
TEST(NodeSizes, WhatNeedsEqualNodesRefusesTheRestAdapts) {
  using shardtrain::comm::mesh_shape_for;
  using shardtrain::strategy::estimate_all;
  shardtrain::strategy::EstimateInput in;
  in.num_params = 1000;
  in.world_size = 3;
  in.local_world_size = 2;
  EXPECT_THROW(estimate_all(in), shardtrain::InvalidArgument);  // equal nodes assumed
  NodeSizesVar uneven("2,1");
  EXPECT_EQ(mesh_shape_for(3, 2, 1, 1, false).dp_shard(), 3);
  EXPECT_EQ(mesh_shape_for(3, 1, 1, 1, false).dp_shard(), 3);
  for (const bool hybrid : {false, true}) {
    try {
      mesh_shape_for(3, 2, hybrid ? 1 : 2, 1, hybrid);
      ADD_FAILURE() << "no ConfigError, hybrid " << hybrid;
    } catch (const ConfigError& e) {
      const std::string msg = e.what();
      const char* what = hybrid ? "distributed.sharding=hybrid_shard" : "distributed.tensor_parallel=2";
      for (const char* part : {what, "the nodes run 2,1 ranks", "--nproc-per-node"}) {
        EXPECT_NE(msg.find(part), std::string::npos) << part << " in: " << msg;
      }
    }
  }
  const auto all = estimate_all(in);
  EXPECT_EQ(all.size(), 5u);
  for (const auto& e : all) EXPECT_NE(e.strategy, "fsdp/hybrid_shard");
}

TEST(ClusterEnv, SlurmWithTasksPerNode) {
  const ClusterEnv env = ClusterEnv::from_variables(
      {{"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "6"}, {"SLURM_LOCALID", "1"},
       {"SLURM_NODEID", "1"}, {"SLURM_NODELIST", "node[03-05,7]"},
       {"SLURM_TASKS_PER_NODE", "2(x3)"}});
  EXPECT_EQ(env.source, EnvSource::Slurm);
  EXPECT_EQ(env.rank, 3);
  EXPECT_EQ(env.world_size, 6);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.local_world_size, 2);
  EXPECT_EQ(env.node_rank, 1);
  EXPECT_EQ(env.master_addr, "node03");
  EXPECT_EQ(env.master_port, 29500);
}

TEST(ClusterEnv, SlurmLocalWorldSizeSources) {
  Vars base{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "0"},
            {"SLURM_NODEID", "0"}, {"SLURM_NODELIST", "a,b"}};
  Vars v = base;
  v["SLURM_NTASKS_PER_NODE"] = "2";
  v["SLURM_TASKS_PER_NODE"] = "4";  // the explicit per-node count wins
  EXPECT_EQ(ClusterEnv::from_variables(v).local_world_size, 2);
  EXPECT_EQ(ClusterEnv::from_variables(v).master_addr, "a");
  v = base;
  v["SLURM_TASKS_PER_NODE"] = "2,2";
  EXPECT_EQ(ClusterEnv::from_variables(v).local_world_size, 2);
  v = base;
  v["SLURM_NNODES"] = "4";
  EXPECT_EQ(ClusterEnv::from_variables(v).local_world_size, 1);
  // Nothing about nodes: one node, and then loopback.
  const ClusterEnv one = ClusterEnv::from_variables(base);
  EXPECT_EQ(one.local_world_size, 4);
  EXPECT_EQ(one.master_addr, "127.0.0.1");
}

TEST(ClusterEnv, SlurmMasterVariablesWin) {
  const ClusterEnv env = ClusterEnv::from_variables(
      {{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "0"},
       {"SLURM_NODEID", "0"}, {"SLURM_NODELIST", "a,b"}, {"SLURM_NTASKS_PER_NODE", "2"},
       {"MASTER_ADDR", "head"}, {"MASTER_PORT", "4000"}});
  EXPECT_EQ(env.master_addr, "head");
  EXPECT_EQ(env.master_port, 4000);
}

TEST(ClusterEnv, SlurmBadInput) {
  EXPECT_ERROR_NAMES((Vars{{"SLURM_PROCID", "0"}}), "SLURM_NTASKS");
  EXPECT_ERROR_NAMES((Vars{{"SLURM_PROCID", "2"}, {"SLURM_NTASKS", "2"}}), "SLURM_PROCID=2",
                     "SLURM_NTASKS=2");
  EXPECT_ERROR_NAMES((Vars{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "5"},
                           {"SLURM_TASKS_PER_NODE", "3,2"}}),
                     "SLURM_TASKS_PER_NODE", "3,2");
  EXPECT_ERROR_NAMES((Vars{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"},
                           {"SLURM_TASKS_PER_NODE", "2(3)"}}),
                     "SLURM_TASKS_PER_NODE");
  EXPECT_ERROR_NAMES((Vars{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}, {"SLURM_NODEID", "2"},
                           {"SLURM_NTASKS_PER_NODE", "2"}, {"SLURM_NODELIST", "a,b"}}),
                     "SLURM_NODEID=2");
  EXPECT_ERROR_NAMES((Vars{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"},
                           {"SLURM_NTASKS_PER_NODE", "2"}}),
                     "MASTER_ADDR", "SLURM_NODELIST");
  EXPECT_ERROR_NAMES((Vars{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"},
                           {"SLURM_NTASKS_PER_NODE", "2"}, {"SLURM_NODELIST", "a[1-"}}),
                     "a[1-");
  // mpirun inside an allocation: the step's SLURM_PROCID disagrees with OpenMPI's rank.
  EXPECT_ERROR_NAMES((Vars{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"},
                           {"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "4"}}),
                     "SLURM_PROCID=0", "OMPI_COMM_WORLD_RANK=3");
}

TEST(ClusterEnv, OpenMpi) {
  const ClusterEnv env = ClusterEnv::from_variables(
      {{"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "4"},
       {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
       {"MASTER_ADDR", "n0"}});
  EXPECT_EQ(env.source, EnvSource::OpenMPI);
  EXPECT_EQ(env.rank, 3);
  EXPECT_EQ(env.world_size, 4);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.local_world_size, 2);
  EXPECT_EQ(env.node_rank, 1);
  EXPECT_EQ(env.master_addr, "n0");
  EXPECT_EQ(env.master_port, 29500);
}

TEST(ClusterEnv, OpenMpiOneNodeDefaultsToLoopback) {
  const ClusterEnv env = ClusterEnv::from_variables(
      {{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"},
       {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}});
  EXPECT_EQ(env.master_addr, "127.0.0.1");
  EXPECT_EQ(env.master_port, 29500);
}

// Started by a real mpirun (PMIx) on several nodes: no master is needed by
// the mpi backend, so none is made up; without PMIx it stays an error.
TEST(ClusterEnv, OpenMpiUnderPmixOnSeveralNodesNeedsNoMaster) {
  Vars vars{{"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "4"},
            {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}};
  EXPECT_ERROR_NAMES(vars, "MASTER_ADDR");
  vars["PMIX_RANK"] = "3";
  const ClusterEnv env = ClusterEnv::from_variables(vars);
  EXPECT_EQ(env.master_addr, "");
  EXPECT_EQ(env.num_nodes(), 2);
}

TEST(ClusterEnv, OpenMpiBadInput) {
  EXPECT_ERROR_NAMES((Vars{{"OMPI_COMM_WORLD_RANK", "1"}}), "OMPI_COMM_WORLD_SIZE");
  EXPECT_ERROR_NAMES((Vars{{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "two"}}),
                     "OMPI_COMM_WORLD_SIZE", "two");
  EXPECT_ERROR_NAMES((Vars{{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "4"},
                           {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}}),
                     "MASTER_ADDR");
}

TEST(ClusterEnv, Pmi) {
  const ClusterEnv env =
      ClusterEnv::from_variables({{"PMI_RANK", "2"}, {"PMI_SIZE", "3"}, {"MASTER_PORT", "5000"}});
  EXPECT_EQ(env.source, EnvSource::PMI);
  EXPECT_EQ(env.rank, 2);
  EXPECT_EQ(env.world_size, 3);
  EXPECT_EQ(env.local_rank, 2);
  EXPECT_EQ(env.local_world_size, 3);
  EXPECT_EQ(env.master_addr, "127.0.0.1");
  EXPECT_EQ(env.master_port, 5000);
  EXPECT_ERROR_NAMES((Vars{{"PMI_SIZE", "2"}}), "PMI_RANK");
  EXPECT_ERROR_NAMES((Vars{{"PMI_RANK", "2"}, {"PMI_SIZE", "2"}}), "PMI_RANK=2");
}

TEST(ClusterEnv, Precedence) {
  const Vars slurm{{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "2"}};
  const Vars ompi{{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"}};
  const Vars pmi{{"PMI_RANK", "1"}, {"PMI_SIZE", "2"}};
  auto merged = [](std::initializer_list<Vars> parts) {
    Vars all;
    for (const auto& p : parts) all.insert(p.begin(), p.end());
    return all;
  };
  // torchrun first, even with other (disagreeing) launchers' variables around.
  EXPECT_EQ(ClusterEnv::from_variables(
                merged({{{"RANK", "0"}, {"WORLD_SIZE", "4"}}, slurm, ompi, pmi}))
                .source,
            EnvSource::Torchrun);
  EXPECT_EQ(ClusterEnv::from_variables(merged({slurm, ompi, pmi})).source, EnvSource::Slurm);
  EXPECT_EQ(ClusterEnv::from_variables(merged({ompi, pmi})).source, EnvSource::OpenMPI);
  EXPECT_EQ(ClusterEnv::from_variables(pmi).source, EnvSource::PMI);
}

TEST(FirstSlurmHost, Forms) {
  EXPECT_EQ(first_slurm_host("node1"), "node1");
  EXPECT_EQ(first_slurm_host("a,b"), "a");
  EXPECT_EQ(first_slurm_host("node[03-05,7]"), "node03");
  EXPECT_EQ(first_slurm_host("node[03-05,7],gpu1"), "node03");
  EXPECT_EQ(first_slurm_host("node[7,03-05]"), "node7");
  EXPECT_EQ(first_slurm_host("rack[2-3]-n[01-04]"), "rack2-n01");
  EXPECT_EQ(first_slurm_host("gpu-[10-11].cluster"), "gpu-10.cluster");
}

TEST(FirstSlurmHost, BadLists) {
  for (const char* bad : {"", "node[", "node[1-2", "node]1", "node[]", "node[a-b]", ",a",
                          "node[1-]", "a b"}) {
    EXPECT_THROW(first_slurm_host(bad), ConfigError) << "'" << bad << "'";
  }
}

}  // namespace
