#include "shardtrain/launch/env.h"

#include <cctype>
#include <cstring>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "shardtrain/core/error.h"

extern char** environ;

namespace shardtrain::dist {

const char* to_string(EnvSource source) {
  switch (source) {
    case EnvSource::Standalone: return "standalone";
    case EnvSource::Torchrun: return "torchrun";
    case EnvSource::Slurm: return "slurm";
    case EnvSource::OpenMPI: return "openmpi";
    case EnvSource::PMI: return "pmi";
  }
  return "unknown";
}

namespace {

using VarMap = std::map<std::string, std::string>;

const std::string* find_var(const VarMap& vars, const std::string& name) {
  auto it = vars.find(name);
  return it == vars.end() ? nullptr : &it->second;
}

bool has_any(const VarMap& vars, std::initializer_list<const char*> names) {
  for (const char* n : names) {
    if (find_var(vars, n)) return true;
  }
  return false;
}

// "NAME=value" or "NAME unset" for each name: the context every error shows,
// so the user sees the whole picture rather than one variable.
std::string show_vars(const VarMap& vars, std::initializer_list<const char*> names) {
  std::string out;
  for (const char* n : names) {
    if (!out.empty()) out += ", ";
    const std::string* v = find_var(vars, n);
    out += v ? std::string(n) + "=" + *v : std::string(n) + " unset";
  }
  return out;
}

// A strict whole, non-negative decimal number; anything else names the variable.
int parse_count(const std::string& name, const std::string& value) {
  bool digits = !value.empty() && value.size() <= 9;
  for (char c : value) digits = digits && std::isdigit(static_cast<unsigned char>(c));
  if (!digits) {
    bool negative = value.size() > 1 && value[0] == '-';
    for (size_t i = 1; negative && i < value.size(); ++i) {
      negative = std::isdigit(static_cast<unsigned char>(value[i]));
    }
    ST_CHECK(!negative, ConfigError, name, "=", value,
             " is negative; it must be a whole number >= 0");
    bool long_digits = !value.empty();
    for (char c : value) long_digits = long_digits && std::isdigit(static_cast<unsigned char>(c));
    ST_CHECK(!long_digits, ConfigError, name, "=", value, " is too large");
    ST_CHECK(false, ConfigError, name, "='", value,
             "' is not a whole number; set it to a decimal count such as 0, 1 or 8");
  }
  return std::atoi(value.c_str());
}

std::optional<int> get_count(const VarMap& vars, const std::string& name) {
  const std::string* v = find_var(vars, name);
  if (!v) return std::nullopt;
  return parse_count(name, *v);
}

// One launcher's rank variable names; `node` is nullptr for launchers that
// have no node index (it is then derived as rank / local world size).
struct Names {
  const char* rank;
  const char* world;
  const char* local_rank;
  const char* local_world;
  const char* node;  // may be nullptr
};

struct Placement {
  int rank, world, local_rank, local_world, node;
};

// Checks one source's numbers and fills the derived ones with the torchrun
// defaults. `local_world_opt` is the resolved local world size (nullopt: one
// node); `local_world_from` names where it came from, for messages.
Placement place(const VarMap& vars, const Names& n, const std::string& context,
                std::optional<int> local_world_opt, const std::string& local_world_from,
                bool check_block_order) {
  auto rank = get_count(vars, n.rank);
  auto world = get_count(vars, n.world);
  ST_CHECK(rank && world, ConfigError, "incomplete environment: ", n.rank, " and ", n.world,
           " must be set together (", context, "); set both, or neither to run standalone");
  ST_CHECK(*world >= 1, ConfigError, n.world, "=", *world, " must be >= 1 (", context, ")");
  ST_CHECK(*rank < *world, ConfigError, "contradictory environment: ", n.rank, "=", *rank,
           " must be < ", n.world, "=", *world, " (", context, ")");

  auto local_rank = get_count(vars, n.local_rank);
  auto node = n.node ? get_count(vars, n.node) : std::nullopt;
  int local_world;
  std::string assumed;
  if (local_world_opt) {
    local_world = *local_world_opt;
  } else {
    // No local size given: the job is on one node, which a node index > 0 contradicts.
    ST_CHECK(!node || *node == 0, ConfigError, "incomplete environment: ", n.node, "=",
             *node, " says there are several nodes but ", local_world_from,
             " is unset, so the ranks per node are unknown (", context, "); set ",
             local_world_from);
    local_world = *world;
    assumed = std::string(" (") + local_world_from + " unset: assumed " +
              std::to_string(local_world) + ", one node)";
  }
  ST_CHECK(local_world >= 1, ConfigError, local_world_from, "=", local_world,
           " must be >= 1 (", context, ")");
  ST_CHECK(*world % local_world == 0, ConfigError, "contradictory environment: ", n.world,
           "=", *world, " is not divisible by ", local_world_from, "=", local_world,
           " (", context, "); every node must run the same number of ranks, or ", kNodeSizesVar,
           " must list each node's (as shardtrain launch sets it)");
  Placement p{*rank, *world, local_rank ? *local_rank : *rank % local_world, local_world,
              node ? *node : *rank / local_world};
  ST_CHECK(p.local_rank < local_world, ConfigError, "contradictory environment: ",
           n.local_rank, "=", p.local_rank, " must be < ", local_world_from, "=",
           local_world, assumed, " (", context, ")");
  const int nodes = *world / local_world;
  if (n.node) {
    ST_CHECK(p.node < nodes, ConfigError, "contradictory environment: ", n.node, "=",
             p.node, " must be < the number of nodes ", n.world, "/", local_world_from,
             "=", nodes, " (", context, ")");
  }
  if (check_block_order) {
    ST_CHECK(p.rank == p.node * local_world + p.local_rank, ConfigError,
             "contradictory environment: ", n.rank, "=", p.rank, " must equal ", n.node,
             " * ", local_world_from, " + ", n.local_rank, " = ", p.node, " * ", local_world,
             assumed, " + ", p.local_rank, " (", context, ")");
  }
  return p;
}

// "2(x3)" -> 2, "4,4" -> 4, "2(x2),2" -> 2; uneven counts are not supported.
int parse_tasks_per_node(const std::string& value, const std::string& context) {
  std::optional<int> common;
  size_t i = 0;
  while (i <= value.size()) {
    size_t end = value.find(',', i);
    if (end == std::string::npos) end = value.size();
    std::string item = value.substr(i, end - i);
    std::string count = item.substr(0, item.find('('));
    if (item.find('(') != std::string::npos) {
      ST_CHECK(item.size() > count.size() + 3 && item.compare(count.size(), 2, "(x") == 0 &&
                   item.back() == ')',
               ConfigError, "SLURM_TASKS_PER_NODE='", value,
               "' is not in SLURM's form such as '2(x3)' or '4,4' (", context, ")");
      parse_count("SLURM_TASKS_PER_NODE", item.substr(count.size() + 2,
                                                      item.size() - count.size() - 3));
    }
    int n = parse_count("SLURM_TASKS_PER_NODE", count);
    ST_CHECK(!common || *common == n, ConfigError, "SLURM_TASKS_PER_NODE='", value,
             "' gives nodes different numbers of tasks; shardtrain needs the same number on "
             "every node (use srun --ntasks-per-node)");
    common = n;
    i = end + 1;
  }
  return *common;
}

// MASTER_ADDR / MASTER_PORT win for every source; otherwise one node uses
// loopback and several nodes use `first_node` (empty: unknown, an error).
void resolve_master(const VarMap& vars, ClusterEnv& env, const std::string& first_node,
                    const char* hint) {
  if (const std::string* addr = find_var(vars, "MASTER_ADDR")) {
    ST_CHECK(!addr->empty(), ConfigError,
             "MASTER_ADDR is set but empty; set it to the host name or address of rank 0");
    env.master_addr = *addr;
  } else if (env.num_nodes() > 1) {
    ST_CHECK(!first_node.empty(), ConfigError, "MASTER_ADDR is unset and the job spans ",
             env.num_nodes(), " nodes (", to_string(env.source), "), so rank 0's host is unknown; ",
             hint);
    env.master_addr = first_node;
  } else {
    env.master_addr = "127.0.0.1";
  }
  if (auto port = get_count(vars, "MASTER_PORT")) {
    ST_CHECK(*port >= 1 && *port <= 65535, ConfigError, "MASTER_PORT=", *port,
             " is not a TCP port; use 1..65535");
    env.master_port = *port;
  } else {
    env.master_port = kDefaultMasterPort;
  }
}

void set_placement(ClusterEnv& env, const Placement& p) {
  env.rank = p.rank;
  env.world_size = p.world;
  env.local_rank = p.local_rank;
  env.local_world_size = p.local_world;
  env.node_rank = p.node;
}

bool sizes_differ(const std::vector<int>& sizes) {
  for (int n : sizes) {
    if (n != sizes.front()) return true;
  }
  return false;
}

// Nodes that run different numbers of ranks (SHARDTRAIN_NODE_SIZES): node
// i's ranks follow those of the nodes before it, as shardtrain launch
// numbers them, and the torchrun variables must say the same.
Placement place_uneven(const VarMap& vars, const std::vector<int>& sizes) {
  const std::string context = show_vars(vars, {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                               "GROUP_RANK", kNodeSizesVar});
  auto rank = get_count(vars, "RANK");
  auto world = get_count(vars, "WORLD_SIZE");
  ST_CHECK(rank && world, ConfigError, "incomplete environment: RANK and WORLD_SIZE must be set together (",
           context, "); set both, or neither to run standalone");
  int64_t total = 0;
  for (int n : sizes) total += n;
  ST_CHECK(total == *world, ConfigError, "contradictory environment: WORLD_SIZE=", *world,
           " must be the sum ", total, " of ", kNodeSizesVar, " (", context, ")");
  ST_CHECK(*rank < *world, ConfigError, "contradictory environment: RANK=", *rank, " must be < WORLD_SIZE=",
           *world, " (", context, ")");
  // The node: GROUP_RANK, or the one whose ranks hold RANK.
  auto node = get_count(vars, "GROUP_RANK");
  int first = 0;
  if (node) {
    ST_CHECK(*node < static_cast<int>(sizes.size()), ConfigError, "contradictory environment: GROUP_RANK=",
             *node, " must be < the ", sizes.size(), " nodes of ", kNodeSizesVar, " (", context, ")");
    for (int n = 0; n < *node; ++n) first += sizes[n];
  } else {
    node = 0;
    while (first + sizes[*node] <= *rank) first += sizes[(*node)++];
  }
  const int local_world = sizes[*node];
  auto given_local_world = get_count(vars, "LOCAL_WORLD_SIZE");
  ST_CHECK(!given_local_world || *given_local_world == local_world, ConfigError,
           "contradictory environment: LOCAL_WORLD_SIZE=", given_local_world.value_or(0),
           " must be node ", *node, "'s entry ", local_world, " of ", kNodeSizesVar, " (", context, ")");
  auto local_rank = get_count(vars, "LOCAL_RANK");
  const int local = local_rank ? *local_rank : *rank - first;
  ST_CHECK(local >= 0 && local < local_world && first + local == *rank, ConfigError,
           "contradictory environment: RANK=", *rank, " must equal node ", *node, "'s first rank ", first,
           " + LOCAL_RANK (0..", local_world - 1, ") (", context, ")");
  return Placement{*rank, *world, local, local_world, *node};
}

void from_torchrun(const VarMap& vars, ClusterEnv& env) {
  std::vector<int> sizes;
  if (const std::string* text = find_var(vars, kNodeSizesVar)) sizes = parse_node_sizes(*text);
  if (sizes_differ(sizes)) {
    set_placement(env, place_uneven(vars, sizes));
    env.node_sizes = sizes;
    resolve_master(vars, env, "", "set MASTER_ADDR to the host of rank 0");
    return;
  }
  const std::string context = show_vars(
      vars, {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"});
  auto local_world = get_count(vars, "LOCAL_WORLD_SIZE");
  set_placement(env, place(vars, {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                  "GROUP_RANK"},
                           context, local_world, "LOCAL_WORLD_SIZE", true));
  // Equal entries are the usual layout, which they must then describe.
  ST_CHECK(sizes.empty() || (static_cast<int>(sizes.size()) == env.num_nodes() &&
                             sizes.front() == env.local_world_size),
           ConfigError, "contradictory environment: ", kNodeSizesVar, "=", node_sizes_text(sizes), " but ",
           context, " give ", env.num_nodes(), " node(s) of ", env.local_world_size,
           " rank(s); unset ", kNodeSizesVar, " or make it agree");
  resolve_master(vars, env, "", "set MASTER_ADDR to the host of rank 0");
}

// Cross-checks another launcher's rank variables against SLURM's: mpirun
// inside an allocation leaves the step's SLURM_PROCID in every rank.
void check_agrees(const VarMap& vars, const char* name, int value, const char* slurm_name) {
  auto other = get_count(vars, name);
  ST_CHECK(!other || *other == value, ConfigError, "contradictory environment: ", slurm_name,
           "=", value, " but ", name, "=", *other,
           "; if the job was started with mpirun inside a SLURM allocation, unset the SLURM_* "
           "rank variables or start it with srun");
}

void from_slurm(const VarMap& vars, ClusterEnv& env) {
  const std::string context =
      show_vars(vars, {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID",
                       "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NNODES"});
  std::optional<int> local_world;
  std::string local_from = "SLURM_NTASKS_PER_NODE";
  if (auto per_node = get_count(vars, "SLURM_NTASKS_PER_NODE")) {
    local_world = per_node;
  } else if (const std::string* tpn = find_var(vars, "SLURM_TASKS_PER_NODE")) {
    local_world = parse_tasks_per_node(*tpn, context);
    local_from = "SLURM_TASKS_PER_NODE";
  } else if (auto nnodes = get_count(vars, "SLURM_NNODES")) {
    auto ntasks = get_count(vars, "SLURM_NTASKS");
    ST_CHECK(*nnodes >= 1, ConfigError, "SLURM_NNODES=", *nnodes, " must be >= 1");
    ST_CHECK(!ntasks || *ntasks % *nnodes == 0, ConfigError, "contradictory environment: ",
             "SLURM_NTASKS=", ntasks.value_or(0), " is not divisible by SLURM_NNODES=", *nnodes,
             "; shardtrain needs the same number of tasks on every node");
    if (ntasks) local_world = *ntasks / *nnodes;
    local_from = "SLURM_NTASKS/SLURM_NNODES";
  }
  Placement p = place(vars, {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
                             "SLURM_NTASKS_PER_NODE", "SLURM_NODEID"},
                      context, local_world, local_from, false);
  check_agrees(vars, "OMPI_COMM_WORLD_RANK", p.rank, "SLURM_PROCID");
  check_agrees(vars, "OMPI_COMM_WORLD_SIZE", p.world, "SLURM_NTASKS");
  check_agrees(vars, "PMI_RANK", p.rank, "SLURM_PROCID");
  check_agrees(vars, "PMI_SIZE", p.world, "SLURM_NTASKS");
  set_placement(env, p);
  std::string first;
  const std::string* list = find_var(vars, "SLURM_NODELIST");
  if (!list) list = find_var(vars, "SLURM_JOB_NODELIST");
  if (list && env.num_nodes() > 1 && !find_var(vars, "MASTER_ADDR")) {
    first = first_slurm_host(*list);
  }
  resolve_master(vars, env, first, "set SLURM_NODELIST or MASTER_ADDR");
}

void from_mpi(const VarMap& vars, ClusterEnv& env, const Names& n) {
  const std::string context = show_vars(vars, {n.rank, n.world, n.local_rank, n.local_world});
  auto local_world = get_count(vars, n.local_world);
  set_placement(env, place(vars, n, context, local_world, n.local_world, false));
  // A job a real MPI launcher started (PMIx) may run on the mpi backend,
  // which needs no master: the gloo backend says so if it is left unknown.
  if (env.num_nodes() > 1 && find_var(vars, "PMIX_RANK") && !find_var(vars, "MASTER_ADDR")) {
    resolve_master(vars, env, "-", "");
    env.master_addr.clear();
    return;
  }
  resolve_master(vars, env, "", "start it with mpirun -x MASTER_ADDR=<host of rank 0>");
}

}  // namespace

ClusterEnv ClusterEnv::from_variables(const std::map<std::string, std::string>& vars) {
  ClusterEnv env;
  if (has_any(vars, {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"})) {
    env.source = EnvSource::Torchrun;
    from_torchrun(vars, env);
  } else if (has_any(vars, {"SLURM_PROCID"})) {
    env.source = EnvSource::Slurm;
    from_slurm(vars, env);
  } else if (has_any(vars, {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                            "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"})) {
    env.source = EnvSource::OpenMPI;
    from_mpi(vars, env,
             {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
              "OMPI_COMM_WORLD_LOCAL_SIZE", nullptr});
  } else if (has_any(vars, {"PMI_RANK", "PMI_SIZE"})) {
    env.source = EnvSource::PMI;
    from_mpi(vars, env, {"PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", nullptr});
  } else {
    env.source = EnvSource::Standalone;
    resolve_master(vars, env, "", "");
  }
  if (auto restarts = get_count(vars, "SHARDTRAIN_RESTART_COUNT")) env.restart_count = *restarts;
  return env;
}

ClusterEnv ClusterEnv::detect() {
  std::map<std::string, std::string> vars;
  for (char** e = environ; e && *e; ++e) {
    const char* eq = std::strchr(*e, '=');
    if (eq) vars.emplace(std::string(*e, static_cast<size_t>(eq - *e)), std::string(eq + 1));
  }
  return from_variables(vars);
}

std::string ClusterEnv::describe() const {
  std::string s = ::shardtrain::detail::str_cat("rank ", rank, "/", world_size, " (local ", local_rank, "/",
                                  local_world_size, ", node ", node_rank, ") master ",
                                  master_addr, ":", master_port, " via ", to_string(source));
  if (!node_sizes.empty()) s += ", nodes of " + node_sizes_text(node_sizes) + " ranks";
  if (restart_count > 0) s += ::shardtrain::detail::str_cat(", restart ", restart_count);
  return s;
}

std::vector<int> parse_node_sizes(const std::string& text) {
  std::vector<int> sizes;
  size_t i = 0;
  for (;;) {
    const size_t comma = text.find(',', i);
    const std::string item = text.substr(i, comma == std::string::npos ? std::string::npos : comma - i);
    bool digits = !item.empty() && item.size() <= 9;
    for (char c : item) digits = digits && std::isdigit(static_cast<unsigned char>(c));
    const int n = digits ? std::atoi(item.c_str()) : 0;
    ST_CHECK(n >= 1, ConfigError, kNodeSizesVar, "='", text,
             "' is not a list of rank counts >= 1 such as '2,1' (the ranks of every node in node order, "
             "which shardtrain launch sets); unset it or correct it");
    sizes.push_back(n);
    if (comma == std::string::npos) return sizes;
    i = comma + 1;
  }
}

std::string node_sizes_text(const std::vector<int>& sizes) {
  std::string text;
  for (int n : sizes) text += (text.empty() ? "" : ",") + std::to_string(n);
  return text;
}

std::vector<int> node_sizes_from_env() {
  const char* text = std::getenv(kNodeSizesVar);
  if (text == nullptr) return {};
  std::vector<int> sizes = parse_node_sizes(text);
  return sizes_differ(sizes) ? sizes : std::vector<int>{};
}

void require_even_nodes(const std::vector<int>& sizes, const std::string& what,
                        const std::string& instead) {
  ST_CHECK(sizes.empty(), ConfigError, what,
           " needs the same number of ranks on every node, but the nodes run ", node_sizes_text(sizes), " ranks (", kNodeSizesVar, "); ", instead);
}

std::string first_slurm_host(const std::string& nodelist) {
  auto bad = [&](const char* why) {
    return ::shardtrain::detail::str_cat("SLURM node list '", nodelist, "' cannot be parsed: ", why,
                           "; expected a form such as 'node[03-05,7],gpu1'; set MASTER_ADDR "
                           "to bypass it");
  };
  std::string host;
  size_t i = 0;
  while (i < nodelist.size() && nodelist[i] != ',') {
    const char c = nodelist[i];
    ST_CHECK(!std::isspace(static_cast<unsigned char>(c)), ConfigError, bad("it has a space"));
    ST_CHECK(c != ']', ConfigError, bad("']' without '['"));
    if (c != '[') {
      host += c;
      ++i;
      continue;
    }
    const size_t close = nodelist.find(']', i);
    ST_CHECK(close != std::string::npos, ConfigError, bad("'[' without ']'"));
    const std::string inner = nodelist.substr(i + 1, close - i - 1);
    // Every item must be N or N-M; only the first one's low end is used.
    std::string first;
    size_t j = 0;
    while (j <= inner.size()) {
      size_t end = inner.find(',', j);
      if (end == std::string::npos) end = inner.size();
      const std::string item = inner.substr(j, end - j);
      const size_t dash = item.find('-');
      const std::string lo = item.substr(0, dash);
      const std::string hi = dash == std::string::npos ? "0" : item.substr(dash + 1);
      auto numeric = [](const std::string& s) {
        if (s.empty()) return false;
        for (char d : s) {
          if (!std::isdigit(static_cast<unsigned char>(d))) return false;
        }
        return true;
      };
      ST_CHECK(numeric(lo) && numeric(hi), ConfigError,
               bad("a bracket holds something other than numbers and ranges"));
      if (first.empty()) first = lo;
      j = end + 1;
    }
    host += first;
    i = close + 1;
  }
  ST_CHECK(!host.empty(), ConfigError, bad("the first host name is empty"));
  return host;
}

}  // namespace shardtrain::dist
