// The launcher's signals. Handlers only write the signal's number into a
// self-pipe; the launcher polls its read end and empties it in one place,
// drain_stop_signals(), whatever it is doing (waiting for other nodes or
// watching its ranks).
#pragma once

#include <signal.h>

#include <vector>

namespace shardtrain::dist::detail {

/// Installs the handlers (SIGINT, SIGTERM, SIGHUP, SIGCHLD; SIGPIPE
/// ignored) for its lifetime and restores the old ones after. SIGHUP (the
/// terminal closed, the SSH session dropped) stops the job as SIGTERM does,
/// unless it was ignored when we started (nohup): then it stays ignored.
/// One at a time per process.
class SignalGuard {
 public:
  SignalGuard();
  ~SignalGuard();
  SignalGuard(const SignalGuard&) = delete;
  SignalGuard& operator=(const SignalGuard&) = delete;

 private:
  static constexpr int kCount = 4;
  struct sigaction old_[kCount + 1];
};

/// The self-pipe's read end, readable when a signal arrived.
int signal_fd();

/// Empties the self-pipe; returns the stop signals (SIGINT, SIGTERM, SIGHUP)
/// that arrived, in order. SIGCHLD only wakes the poller.
std::vector<int> drain_stop_signals();

/// The first stop signal any drain has returned since the guard was
/// installed, or 0.
int first_stop_signal();

/// SIGHUP's disposition for a rank, from this process's: ignored when it is
/// ignored here (nohup), else the default (never the launcher's handler).
struct sigaction hup_for_children();

/// In a child, before it runs the rank's program (async-signal-safe):
/// default dispositions for SIGINT, SIGTERM, SIGCHLD and SIGPIPE, `hup`
/// (from hup_for_children()) for SIGHUP, and an empty signal mask.
void reset_signals_in_child(const struct sigaction& hup);

}  // namespace shardtrain::dist::detail
