// Where this process sits in the job: rank, world size, node, master address.
//
// Sources are read in a fixed order and the first one present wins:
//   1. torchrun / shardtrain launch: RANK, WORLD_SIZE, LOCAL_RANK,
//      LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT
//   2. SLURM (srun): SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID,
//      SLURM_NODELIST (master = its first host)
//   3. OpenMPI (mpirun): OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE;
//      or PMI: PMI_RANK, PMI_SIZE
//   4. none of these: one standalone process.
// A source that is only partly set, or whose values contradict each other, is a
// ConfigError naming the variables. Under SLURM and OpenMPI/PMI, MASTER_ADDR
// and MASTER_PORT still win when set; otherwise the master is the first node
// (127.0.0.1 on a single node) and the port 29500.
//
// Details of the rules:
//   - torchrun is chosen when any of its rank variables is set; RANK and
//     WORLD_SIZE are then required. LOCAL_WORLD_SIZE unset means one node
//     (local = global) unless GROUP_RANK > 0 says otherwise (an error);
//     LOCAL_RANK unset means RANK % LOCAL_WORLD_SIZE; GROUP_RANK unset means
//     RANK / LOCAL_WORLD_SIZE. RANK must equal GROUP_RANK * LOCAL_WORLD_SIZE +
//     LOCAL_RANK, as torchrun assigns it.
//   - SLURM is chosen when SLURM_PROCID is set; SLURM_NTASKS is then required.
//     Tasks per node come from SLURM_NTASKS_PER_NODE, else SLURM_TASKS_PER_NODE
//     ("2(x3)", "2,2"; must be equal on every node), else SLURM_NNODES, else one
//     node. SLURM_LOCALID / SLURM_NODEID unset are derived as for torchrun.
//     When OMPI_* or PMI_* rank variables are set too and disagree with SLURM's
//     (mpirun started inside an allocation), that is a contradiction.
//   - OpenMPI (OMPI_COMM_WORLD_*) and PMI (PMI_RANK, PMI_SIZE, and hydra's
//     MPI_LOCALRANKID / MPI_LOCALNRANKS) follow the torchrun defaults for the
//     local values; node_rank is rank / local_world_size (by-slot mapping).
//     Their variables do not name the first node, so on several nodes
//     MASTER_ADDR must be set (mpirun -x MASTER_ADDR=host), except when a
//     real MPI launcher started the job (PMIX_RANK is set): master_addr is
//     then left empty, since the mpi backend needs no master (the gloo
//     backend refuses to start without one).
//   - Nodes that run different numbers of ranks: shardtrain launch then sets
//     SHARDTRAIN_NODE_SIZES ("2,1": node 0 runs 2 ranks, node 1 one), node
//     i's ranks following those of the nodes before it. The torchrun
//     variables must agree with it (WORLD_SIZE its sum, LOCAL_WORLD_SIZE
//     this node's entry, RANK this node's first rank + LOCAL_RANK), and
//     WORLD_SIZE need not divide by LOCAL_WORLD_SIZE. A list whose entries
//     are all equal changes nothing. Other sources need equal nodes.
//   - MASTER_PORT must be 1..65535; SHARDTRAIN_RESTART_COUNT a count >= 0.
//   - All counts are whole decimal numbers; negative or non-numeric values
//     are a ConfigError.
#pragma once

#include <map>
#include <string>
#include <vector>

namespace shardtrain::dist {

/// Which launcher's variables described this process.
enum class EnvSource { Standalone, Torchrun, Slurm, OpenMPI, PMI };

/// "standalone", "torchrun", "slurm", "openmpi" or "pmi".
const char* to_string(EnvSource source);

/// The default rendezvous port when none is given (the same as torchrun's).
constexpr int kDefaultMasterPort = 29500;

/// This process's place in the job. Plain data; see detect() for the rules.
struct ClusterEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = kDefaultMasterPort;
  /// Times the launcher restarted the job so far (SHARDTRAIN_RESTART_COUNT).
  int restart_count = 0;
  EnvSource source = EnvSource::Standalone;
  /// The ranks of every node in node order when nodes run different numbers
  /// of them (SHARDTRAIN_NODE_SIZES); empty when every node runs
  /// local_world_size ranks.
  std::vector<int> node_sizes;

  /// Number of nodes: world_size / local_world_size, or node_sizes' length.
  int num_nodes() const {
    return node_sizes.empty() ? world_size / local_world_size : static_cast<int>(node_sizes.size());
  }
  /// Whether nodes run different numbers of ranks (see node_sizes).
  bool uneven_nodes() const { return !node_sizes.empty(); }

  /// Reads the current process environment. Throws ConfigError on partial or
  /// contradictory variables.
  static ClusterEnv detect();

  /// The same rules applied to an explicit variable map (for tests and tools).
  static ClusterEnv from_variables(const std::map<std::string, std::string>& vars);

  /// One line for logs, e.g. "rank 1/4 (local 1/2, node 0) master 127.0.0.1:29500 via torchrun".
  std::string describe() const;
};

/// The variable in which shardtrain launch gives the ranks every node runs,
/// in node order ("2,1"), when they differ.
constexpr const char* kNodeSizesVar = "SHARDTRAIN_NODE_SIZES";

/// "2,1" -> {2, 1}. ConfigError, naming SHARDTRAIN_NODE_SIZES, for anything
/// but a comma-separated list of whole counts >= 1.
std::vector<int> parse_node_sizes(const std::string& text);

/// {2, 1} -> "2,1".
std::string node_sizes_text(const std::vector<int>& sizes);

/// This process's SHARDTRAIN_NODE_SIZES when its entries differ; empty when
/// it is unset or every node runs the same number of ranks. ConfigError when
/// it cannot be parsed.
std::vector<int> node_sizes_from_env();

/// ConfigError when `sizes` (as node_sizes_from_env() gives them) is not
/// empty: "<what> needs the same number of ranks on every node, but the
/// nodes run 2,1 ranks (SHARDTRAIN_NODE_SIZES); <instead>".
void require_even_nodes(const std::vector<int>& sizes, const std::string& what,
                        const std::string& instead);

/// The first host of a SLURM node list: "node[03-05,7],gpu1" -> "node03".
/// Throws ConfigError on a list it cannot parse.
std::string first_slurm_host(const std::string& nodelist);

}  // namespace shardtrain::dist
