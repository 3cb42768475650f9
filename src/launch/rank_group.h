// One round of one node's ranks: starts them, relays their output with a
// "[rank k] " prefix, forwards the launcher's stop signals, and stops them
// together when one fails here or on another node (through the rendezvous).
#pragma once

#include <signal.h>
#include <sys/types.h>

#include <chrono>
#include <deque>
#include <optional>
#include <string>
#include <vector>

#include "launch/rendezvous.h"
#include "shardtrain/launch/launcher.h"

namespace shardtrain::dist::detail {

class ForkServer;

class RankGroup {
 public:
  /// Ranks are forked from `fork_server` when given, else exec'ed.
  RankGroup(const LaunchOptions& options, Rendezvous& rdzv, const std::string& token, int round,
            ForkServer* fork_server);
  // Whatever happens (an exception included), no rank outlives the group.
  ~RankGroup();
  RankGroup(const RankGroup&) = delete;
  RankGroup& operator=(const RankGroup&) = delete;

  /// Runs the ranks to the end. Returns 0, the first failure's code,
  /// 128 + signal when the launcher was told to stop, or kSkippedExitCode
  /// when no rank failed and one skipped.
  int run();

  /// The rank whose failure decided run()'s result, -1 for none.
  int failed_rank() const { return failed_ < 0 ? -1 : ranks_[failed_].rank; }
  bool interrupted() const { return signal_ != 0; }
  /// Another node's failure that stopped this node's ranks.
  const std::optional<Failure>& remote_failure() const { return remote_; }

 private:
  using Clock = std::chrono::steady_clock;

  // Where the group is in stopping its ranks. It only moves forward.
  enum class Phase {
    kRunning,   // nothing asked the ranks to stop
    kStopping,  // they were signalled (SIGTERM or a forwarded signal); SIGKILL at kill_deadline_
    kKilled,    // SIGKILL was sent
  };

  // One of a rank's output pipes and the line it is in the middle of.
  struct Stream {
    int fd = -1;
    int target = 1;  // STDOUT_FILENO or STDERR_FILENO
    std::string partial;
  };

  struct Rank {
    int rank = 0;
    pid_t pid = -1;
    bool running = false;
    int code = 0;
    Stream out, err;
    std::deque<std::string> tail;
  };

  void start_all();
  void start(Rank& r, int local_rank);
  std::vector<std::string> child_env(int local_rank) const;
  void read_stream(Rank& r, Stream& s);
  void emit(Rank& r, Stream& s, const std::string& line);
  static void close_stream(Stream& s);
  void reap();
  void signal_all(int sig);
  // Sends `sig` to every rank and starts the grace period before SIGKILL.
  void begin_stopping(int sig = SIGTERM);
  void kill_all(const std::string& why);
  void on_stop_signal(int sig);
  void watch_other_nodes();
  void report_failure() const;

  const LaunchOptions& options_;
  Rendezvous& rdzv_;
  const std::string& token_;
  const int round_;
  ForkServer* const fork_server_;
  std::vector<Rank> ranks_;
  Phase phase_ = Phase::kRunning;
  Clock::time_point kill_deadline_;
  // What the result is made of.
  int failed_ = -1;       // index into ranks_ of the failure that decided it
  std::string suspects_;  // ranks whose heartbeat had stopped when it failed
  std::optional<Failure> remote_;
  bool skipped_ = false;  // a rank exited kSkippedExitCode
  int signal_ = 0;        // SIGINT / SIGTERM / SIGHUP received by the launcher
};

}  // namespace shardtrain::dist::detail
