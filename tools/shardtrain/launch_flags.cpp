#include "launch_flags.h"

#include <unistd.h>

#include <cerrno>
#include <cstdlib>
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

// A whole decimal number within [lo, hi], or a ConfigError naming the flag.
int parse_int(const std::string& flag, const std::string& value, long lo, long hi,
              const char* allowed) {
  errno = 0;
  char* end = nullptr;
  const long v = std::strtol(value.c_str(), &end, 10);
  const bool ok = !value.empty() && end && *end == '\0' && errno == 0 && v >= lo && v <= hi &&
                  value.find_first_of(" \t+") == std::string::npos;
  ST_CHECK(ok, ConfigError, "invalid value '", value, "' for ", flag, "; expected ", allowed, " (",
           lo, "..", hi, ")");
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

namespace {

using Apply = void (*)(const std::string& flag, const std::string& value, dist::LaunchOptions& o);

struct Flag {
  const char* name;
  Apply apply;
};

const Flag kFlags[] = {
    {"--nproc-per-node",
     [](const std::string& flag, const std::string& value, dist::LaunchOptions& o) {
       o.nproc_per_node(value == "auto" ? online_cpus()
                                        : parse_int(flag, value, 1, 65536, "a count >= 1 or 'auto'"));
     }},
    {"--nnodes",
     [](const std::string& flag, const std::string& value, dist::LaunchOptions& o) {
       o.nnodes(parse_int(flag, value, 1, 65536, "a count >= 1"));
     }},
    {"--node-rank",
     [](const std::string& flag, const std::string& value, dist::LaunchOptions& o) {
       o.node_rank(parse_int(flag, value, 0, 65535, "a node index >= 0"));
     }},
    {"--master-addr",
     [](const std::string& flag, const std::string& value, dist::LaunchOptions& o) {
       ST_CHECK(!value.empty(), ConfigError, "invalid value '' for ", flag,
                "; expected a host name or address");
       o.master_addr(value);
     }},
    {"--master-port",
     [](const std::string& flag, const std::string& value, dist::LaunchOptions& o) {
       o.master_port(parse_int(flag, value, 1, 65535, "a TCP port 1..65535"));
     }},
    {"--max-restarts",
     [](const std::string& flag, const std::string& value, dist::LaunchOptions& o) {
       o.max_restarts(parse_int(flag, value, 0, 1000000, "a count >= 0"));
     }},
    {"--stop-grace",
     [](const std::string& flag, const std::string& value, dist::LaunchOptions& o) {
       o.stop_grace_s(parse_seconds(flag, value));
     }},
    {"--tail-lines",
     [](const std::string& flag, const std::string& value, dist::LaunchOptions& o) {
       o.tail_lines(parse_int(flag, value, 0, 100000, "a count >= 0"));
     }},
};

}  // namespace

std::string launch_flag_names() {
  std::string names;
  for (const Flag& f : kFlags) names += (names.empty() ? "" : ", ") + std::string(f.name);
  return names;
}

const char* launch_flag(int argc, char** argv, int& i, dist::LaunchOptions& options) {
  const std::string arg = argv[i];
  std::string flag = arg, value;
  bool has_value = false;
  const size_t eq = arg.find('=');
  if (arg.compare(0, 2, "--") == 0 && eq != std::string::npos) {
    flag = arg.substr(0, eq);
    value = arg.substr(eq + 1);
    has_value = true;
  }
  for (char& c : flag) {
    if (c == '_') c = '-';  // torchrun's spellings
  }
  for (const Flag& f : kFlags) {
    if (flag != f.name) continue;
    if (!has_value) {
      ST_CHECK(i + 1 < argc, ConfigError, flag, " needs a value; see --help");
      value = argv[++i];
    }
    f.apply(flag, value, options);
    return f.name;
  }
  return nullptr;
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
