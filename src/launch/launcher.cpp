// launch(): the job's rounds. The pieces are in this directory: the
// launchers' rendezvous (rendezvous.h), one round of this node's ranks
// (rank_group.h), the signal self-pipe (signals.h) and the launcher's own
// output (console.h).
#include "shardtrain/launch/launcher.h"

#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <string>

#include "comm/kv_store.h"
#include "launch/console.h"
#include "launch/fork_server.h"
#include "launch/rank_group.h"
#include "launch/rendezvous.h"
#include "launch/signals.h"
#include "shardtrain/core/error.h"

namespace shardtrain::dist {
namespace {

using ::shardtrain::detail::str_cat;
using namespace detail;

void validate(const LaunchOptions& o) {
  ST_CHECK(o.nproc_per_node() >= 1, ConfigError, "nproc_per_node=", o.nproc_per_node(),
           " must be >= 1");
  ST_CHECK(o.nnodes() >= 1, ConfigError, "nnodes=", o.nnodes(), " must be >= 1");
  ST_CHECK(o.nproc_per_node() <= 1'000'000 / o.nnodes(), ConfigError,
           "nnodes * nproc_per_node is too large (", o.nnodes(), " * ", o.nproc_per_node(), ")");
  ST_CHECK(o.node_rank() >= 0 && o.node_rank() < o.nnodes(), ConfigError,
           "node_rank=", o.node_rank(), " must be in 0..", o.nnodes() - 1, " (nnodes=", o.nnodes(),
           ")");
  ST_CHECK(o.master_port() >= 0 && o.master_port() <= 65535, ConfigError,
           "master_port=", o.master_port(), " must be 1..65535, or 0 to pick a free port");
  ST_CHECK(o.nnodes() == 1 || o.master_port() != 0, ConfigError, "with nnodes=", o.nnodes(),
           " the master port must be given (every node must use the same one); "
           "pass --master-port, e.g. 29500");
  ST_CHECK(o.nnodes() == 1 || !o.master_addr().empty(), ConfigError, "with nnodes=", o.nnodes(),
           " the master address must be given (the host of node 0); pass --master-addr");
  ST_CHECK(o.max_restarts() >= 0, ConfigError, "max_restarts=", o.max_restarts(), " must be >= 0");
  ST_CHECK(std::isfinite(o.stop_grace_s()) && o.stop_grace_s() >= 0, ConfigError,
           "stop_grace_s=", o.stop_grace_s(), " must be a number of seconds >= 0");
  ST_CHECK(o.tail_lines() >= 0, ConfigError, "tail_lines=", o.tail_lines(), " must be >= 0");
  ST_CHECK(!o.command().empty() && !o.command()[0].empty(), ConfigError,
           "no program to launch; give it after '--', e.g. shardtrain launch "
           "--nproc-per-node 2 -- ./train");
}

}  // namespace

int find_free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ST_CHECK(fd >= 0, Error, "cannot create a socket to find a free port: ", std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = 0;  // the kernel picks a free one
  socklen_t len = sizeof addr;
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  const int e = errno;
  ::close(fd);
  ST_CHECK(ok, Error, "cannot find a free TCP port: ", std::strerror(e),
           "; pass a master port explicitly");
  return ntohs(addr.sin_port);
}

int launch(const LaunchOptions& options) {
  validate(options);
  std::string token = comm::detail::job_token_from_env();
  ST_CHECK(!token.empty() || options.nnodes() == 1, ConfigError, "with nnodes=", options.nnodes(),
           " every node's launcher must know the job's secret: set SHARDTRAIN_JOB_TOKEN to the "
           "same value on every node, e.g. export SHARDTRAIN_JOB_TOKEN=$(head -c 32 /dev/urandom "
           "| od -An -tx1 | tr -d ' \\n')");
  if (token.empty()) token = comm::detail::new_job_token();
  const std::string master = options.master_addr().empty() ? "127.0.0.1" : options.master_addr();
  // Before any thread (the store's) and before our signal handlers: the
  // helper is a copy of this process as it is now.
  const std::unique_ptr<ForkServer> fork_server = ForkServer::start_if_possible(options);
  SignalGuard signals;
  // Node 0 hosts the store for every round: a restarted group meets where
  // the first did.
  Rendezvous rdzv(options, master, token);
  const int first = rdzv.first_round();
  for (int round = first; round >= 0; ++round) {
    if (!rdzv.join(round)) break;
    if (round == first && first > 0) {
      say(str_cat("node ", options.node_rank(), " joined the job at round ", round, " (restart ",
                  round, " of ", options.max_restarts(), ")"));
    }
    RankGroup group(options, rdzv, token, round, fork_server.get());
    int code = group.run();
    if (group.interrupted()) return code;
    const bool local = group.failed_rank() >= 0;
    if (!local && !group.remote_failure()) {  // every rank of this node succeeded
      const auto late = rdzv.finish(round);
      if (!late) return code;
      say("this node's ranks finished, but " + late->what);
      rdzv.restart_after(round, false, late->what);  // the others wait for a decision
      return late->code;
    }
    if (!local) code = group.remote_failure()->code;
    bool restart = round < options.max_restarts();
    // Why the job stops, if it does, for the other nodes to print.
    std::string why = local ? str_cat("node ", options.node_rank(), ": rank ", group.failed_rank(),
                                      " failed with ", describe_code(code))
                            : group.remote_failure()->what;
    if (code == kBadInputExitCode && options.max_restarts() > 0) {
      // Bad input fails the same way every time: restarting cannot help.
      say(str_cat(
          "not restarting: ",
          local ? "rank " + std::to_string(group.failed_rank()) : group.remote_failure()->what,
          " exited with ", code, " (bad input, e.g. a configuration error)"));
      restart = false;
      why += " (bad input, e.g. a configuration error: not restarted)";
    } else if (!restart) {
      why += str_cat(" (no restart left: --max-restarts ", options.max_restarts(), ")");
    }
    if (!rdzv.restart_after(round, restart, why)) {
      if (options.max_restarts() > 0 && round >= options.max_restarts()) {
        say(str_cat("giving up after ", options.max_restarts(), " restart",
                    options.max_restarts() == 1 ? "" : "s"));
      }
      return code;
    }
    say(str_cat("restarting all ", rdzv.layout().world(), " ranks (restart ",
                round + 1, " of ", options.max_restarts(), ")"));
  }
  // A stop signal while waiting for other nodes.
  return 128 + (first_stop_signal() != 0 ? first_stop_signal() : SIGTERM);
}

}  // namespace shardtrain::dist
