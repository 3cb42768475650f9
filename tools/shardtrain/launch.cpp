// `shardtrain launch [OPTIONS] -- PROGRAM ARGS...`: parses the flags into
// LaunchOptions and hands over to dist::launch(). Bad flags are ConfigErrors,
// which main() turns into exit code 2.
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "commands.h"
#include "shardtrain/core/error.h"
#include "shardtrain/dist/launcher.h"

namespace shardtrain::cli {
namespace {

const char kUsage[] =
    "usage: shardtrain launch [OPTIONS] -- PROGRAM [ARGS...]\n"
    "\n"
    "Starts the ranks of one node with the torchrun variables set (RANK, LOCAL_RANK,\n"
    "WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT,\n"
    "SHARDTRAIN_RESTART_COUNT), prefixes their output with \"[rank k] \", forwards\n"
    "SIGINT/SIGTERM to them and stops them all when one fails.\n"
    "\n"
    "options (also as --option=value):\n"
    "  --nproc-per-node N|auto  ranks on this node; auto = online CPUs (default 1)\n"
    "  --nnodes M               nodes in the job (default 1)\n"
    "  --node-rank R            this node's index, 0..M-1 (default 0)\n"
    "  --master-addr A          host of rank 0 (default 127.0.0.1; required if M > 1)\n"
    "  --master-port P          port of rank 0 (default: a free one; required if M > 1)\n"
    "  --max-restarts K         restart all ranks up to K times after a failure (default 0)\n"
    "  --stop-grace S           seconds between SIGTERM and SIGKILL when stopping (default 3)\n"
    "  --tail-lines N           lines of a failed rank's output shown again (default 20)\n"
    "  -h, --help               show this help\n"
    "\n"
    "exit code: 0 when every rank succeeded; otherwise the failed rank's code (128+N\n"
    "if it was killed by signal N, 127 if PROGRAM was not found); 128+N when the\n"
    "launcher itself got SIGINT/SIGTERM; 2 for bad options.\n";

const char kAllowed[] =
    "--nproc-per-node, --nnodes, --node-rank, --master-addr, --master-port, "
    "--max-restarts, --stop-grace, --tail-lines, --help";

// A whole decimal number within [lo, hi], or a ConfigError naming the flag.
int parse_int(const std::string& flag, const std::string& value, long lo, long hi,
              const char* allowed) {
  errno = 0;
  char* end = nullptr;
  const long v = std::strtol(value.c_str(), &end, 10);
  const bool ok = !value.empty() && end && *end == '\0' && errno == 0 && v >= lo && v <= hi &&
                  value.find_first_of(" \t+") == std::string::npos;
  ST_CHECK(ok, ConfigError, "invalid value '", value, "' for ", flag, "; expected ", allowed);
  return static_cast<int>(v);
}

double parse_seconds(const std::string& flag, const std::string& value) {
  errno = 0;
  char* end = nullptr;
  const double v = std::strtod(value.c_str(), &end);
  ST_CHECK(!value.empty() && end && *end == '\0' && errno == 0 && v >= 0 && v <= 3600,
           ConfigError, "invalid value '", value, "' for ", flag,
           "; expected seconds between 0 and 3600, e.g. 3 or 0.5");
  return v;
}

int online_cpus() {
  const long n = ::sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? static_cast<int>(n) : 1;
}

}  // namespace

int launch_main(int argc, char** argv) {
  dist::LaunchOptions options;
  int i = 1;
  for (; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--") {
      ++i;
      break;
    }
    if (arg == "-h" || arg == "--help") {
      std::fputs(kUsage, stdout);
      return 0;
    }
    // The first word that is not an option starts the program, as in torchrun.
    if (arg.size() < 2 || arg[0] != '-') break;

    std::string flag = arg, value;
    bool has_value = false;
    const size_t eq = arg.find('=');
    if (arg.compare(0, 2, "--") == 0 && eq != std::string::npos) {
      flag = arg.substr(0, eq);
      value = arg.substr(eq + 1);
      has_value = true;
    }
    auto take_value = [&]() {
      if (has_value) return;
      ST_CHECK(i + 1 < argc, ConfigError, flag, " needs a value; see 'shardtrain launch --help'");
      value = argv[++i];
    };
    if (flag == "--nproc-per-node" || flag == "--nproc_per_node") {
      take_value();
      options.nproc_per_node() =
          value == "auto" ? online_cpus()
                          : parse_int(flag, value, 1, 65536, "a count >= 1 or 'auto'");
    } else if (flag == "--nnodes") {
      take_value();
      options.nnodes(parse_int(flag, value, 1, 65536, "a count >= 1"));
    } else if (flag == "--node-rank" || flag == "--node_rank") {
      take_value();
      options.node_rank(parse_int(flag, value, 0, 65535, "a node index >= 0"));
    } else if (flag == "--master-addr" || flag == "--master_addr") {
      take_value();
      ST_CHECK(!value.empty(), ConfigError, "invalid value '' for ", flag,
               "; expected a host name or address");
      options.master_addr(value);
    } else if (flag == "--master-port" || flag == "--master_port") {
      take_value();
      options.master_port(parse_int(flag, value, 1, 65535, "a TCP port 1..65535"));
    } else if (flag == "--max-restarts" || flag == "--max_restarts") {
      take_value();
      options.max_restarts(parse_int(flag, value, 0, 1000000, "a count >= 0"));
    } else if (flag == "--stop-grace") {
      take_value();
      options.stop_grace_s(parse_seconds(flag, value));
    } else if (flag == "--tail-lines") {
      take_value();
      options.tail_lines(parse_int(flag, value, 0, 100000, "a count >= 0"));
    } else {
      ST_CHECK(false, ConfigError, "unknown option '", arg, "'; allowed: ", kAllowed,
               ", then '--' and the program");
    }
  }
  for (; i < argc; ++i) options.command().emplace_back(argv[i]);
  ST_CHECK(!options.command().empty(), ConfigError,
           "no program given; usage: shardtrain launch --nproc-per-node N -- PROGRAM [ARGS...]");
  ST_CHECK(options.node_rank() < options.nnodes(), ConfigError, "invalid value '",
           options.node_rank(), "' for --node-rank; expected 0..", options.nnodes() - 1,
           " (--nnodes ", options.nnodes(), ")");
  ST_CHECK(options.nnodes() == 1 || options.master_port() != 0, ConfigError,
           "--master-port is required with --nnodes ", options.nnodes(),
           " (every node must use the same port)");
  ST_CHECK(options.nnodes() == 1 || !options.master_addr().empty(), ConfigError,
           "--master-addr is required with --nnodes ", options.nnodes(),
           " (the host of node 0)");
  ST_CHECK(options.nnodes() == 1 || options.max_restarts() == 0, ConfigError,
           "--max-restarts ", options.max_restarts(), " is not supported with --nnodes ",
           options.nnodes(), ": restarts cannot be coordinated across nodes yet; use 0 and let "
           "the scheduler restart the job");
  std::fflush(stdout);  // the ranks' output goes straight to fd 1 after this
  return dist::launch(options);
}

}  // namespace shardtrain::cli
