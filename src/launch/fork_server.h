// The launcher's fork server: ranks started by fork() from a helper process
// that already holds the program (LibTorch included) in memory, instead of
// exec'ing a fresh copy that loads and initialises it again. At 64 ranks on
// 2 cores that load was the whole start-up (BENCHMARKS.md, 64 ranks).
//
// How a rank comes to be:
//   - the launcher forks the helper once, before it starts any thread, so
//     the helper is a single-threaded copy of the program as it was then;
//   - for each rank the launcher sends the helper the rank's environment,
//     arguments and two pipe ends (its stdout and stderr) over a socket;
//   - the helper forks an intermediate process, which forks the rank, puts
//     it in its own process group, reports its pid and exits; the orphaned
//     rank is re-parented to the launcher (a child subreaper), so that the
//     launcher waits for it, signals it and outlives it exactly as for a
//     rank it had exec'ed;
//   - the rank, once the launcher is its parent, dies with it
//     (PR_SET_PDEATHSIG), restores the signal dispositions the launcher
//     started with, takes stdin from /dev/null and the pipes as stdout and
//     stderr, replaces its environment and calls the program's main with the
//     arguments; its return value is the exit code.
// What differs from an exec'ed rank: /proc/PID/cmdline and /proc/PID/environ
// show the launcher's (the rank's own environment is what getenv() sees),
// and the launcher has one more child, the helper, named kHelperName.
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "shardtrain/launch/launcher.h"

namespace shardtrain::dist::detail {

/// The helper's process name (/proc/PID/comm): among the launcher's
/// children, the one that is not a rank.
inline constexpr char kHelperName[] = "st-fork-server";

class ForkServer {
 public:
  /// The helper, when it can serve `options`: rank_main is set, the process
  /// has one thread, and SHARDTRAIN_FORK_SERVER is not 0. Otherwise null
  /// (the launcher exec's each rank). Call before starting any thread.
  static std::unique_ptr<ForkServer> start_if_possible(const LaunchOptions& options);

  ~ForkServer();
  ForkServer(const ForkServer&) = delete;
  ForkServer& operator=(const ForkServer&) = delete;

  /// Starts a rank running the program's main with `argv` in environment
  /// `env`, stdout and stderr on `out_fd` and `err_fd` (which the caller
  /// still owns). Returns its pid, a child of this process once the call
  /// returns or shortly after (waitpid(pid) may report ECHILD until then).
  /// Error when the helper cannot fork or is gone.
  pid_t spawn(const std::vector<std::string>& argv, const std::vector<std::string>& env,
              int out_fd, int err_fd);

 private:
  ForkServer(pid_t helper, int socket) : helper_(helper), socket_(socket) {}
  pid_t helper_;
  int socket_;
};

}  // namespace shardtrain::dist::detail
