#include "launch_flags.h"

#include <unistd.h>

#include <functional>
#include <string>

#include "shardtrain/core/error.h"

namespace shardtrain::cli {

const char kLaunchFlagsUsage[] =
    "  --nproc-per-node N|auto  ranks on this node; auto = online CPUs\n"
    "  --nnodes M               nodes in the job (default 1)\n"
    "  --node-rank R            this node's index, 0..M-1 (default 0)\n"
    "  --master-addr A          address of node 0, whose launcher hosts the job's store\n"
    "                           (default 127.0.0.1; required if M > 1)\n"
    "  --master-port P          port of the store (default: a free one; required if M > 1)\n"
    "  --max-restarts K         restart the whole job, on every node, up to K times\n"
    "                           after a failure (default 0)\n"
    "  --stop-grace S           seconds between SIGTERM and SIGKILL when stopping\n"
    "  --tail-lines N           lines of a failed rank's output shown again (default 20)\n"
    "With M > 1, set SHARDTRAIN_JOB_TOKEN to one secret on every node.\n";

namespace {

int online_cpus() {
  const long n = ::sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? static_cast<int>(n) : 1;
}

const char* const kNames[] = {"--nproc-per-node", "--nnodes",       "--node-rank",
                              "--master-addr",    "--master-port",  "--max-restarts",
                              "--stop-grace",     "--tail-lines"};

// "--nnodes" and torchrun's "--nnodes" spelled with underscores.
std::string spellings(const std::string& name) {
  std::string underscored = name.substr(2);
  for (char& c : underscored) {
    if (c == '-') c = '_';
  }
  return underscored == name.substr(2) ? name : name + ",--" + underscored;
}

}  // namespace

std::string launch_flag_names() {
  std::string names;
  for (const char* f : kNames) names += (names.empty() ? "" : ", ") + std::string(f);
  return names;
}

void add_launch_flags(CLI::App& app, dist::LaunchOptions& o, int* nproc) {
  using Value = const std::string&;
  const auto add = [&app](const char* name, std::function<void(Value)> apply) {
    app.add_option_function<std::string>(spellings(name), std::move(apply));
  };
  add("--nproc-per-node", [&o, nproc](Value v) {
    o.nproc_per_node(v == "auto" ? online_cpus()
                                 : static_cast<int>(parse_int("--nproc-per-node", v, 1, 65536,
                                                              "a count >= 1 or 'auto'")));
    if (nproc != nullptr) *nproc = o.nproc_per_node();
  });
  add("--nnodes", [&o](Value v) {
    o.nnodes(static_cast<int>(parse_int("--nnodes", v, 1, 65536, "a count >= 1")));
  });
  add("--node-rank", [&o](Value v) {
    o.node_rank(static_cast<int>(parse_int("--node-rank", v, 0, 65535, "a node index >= 0")));
  });
  add("--master-addr", [&o](Value v) {
    ST_CHECK(!v.empty(), ConfigError, "invalid value '' for --master-addr",
             "; expected a host name or address");
    o.master_addr(v);
  });
  add("--master-port", [&o](Value v) {
    o.master_port(static_cast<int>(parse_int("--master-port", v, 1, 65535, "a TCP port 1..65535")));
  });
  add("--max-restarts", [&o](Value v) {
    o.max_restarts(static_cast<int>(parse_int("--max-restarts", v, 0, 1000000, "a count >= 0")));
  });
  add("--stop-grace", [&o](Value v) { o.stop_grace_s(parse_seconds("--stop-grace", v)); });
  add("--tail-lines", [&o](Value v) {
    o.tail_lines(static_cast<int>(parse_int("--tail-lines", v, 0, 100000, "a count >= 0")));
  });
}

void check_launch_flags(const dist::LaunchOptions& options) {
  ST_CHECK(options.node_rank() < options.nnodes(), ConfigError, "invalid value '",
           options.node_rank(), "' for --node-rank; expected 0..", options.nnodes() - 1,
           " (--nnodes ", options.nnodes(), ")");
  ST_CHECK(options.nnodes() == 1 || options.master_port() != 0, ConfigError,
           "--master-port is required with --nnodes ", options.nnodes(),
           " (every node must use the same port)");
  ST_CHECK(options.nnodes() == 1 || !options.master_addr().empty(), ConfigError,
           "--master-addr is required with --nnodes ", options.nnodes(),
           " (the host of node 0)");
}

}  // namespace shardtrain::cli
