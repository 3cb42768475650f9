// The signal handling behind checkpoint.save_on_signal: SIGTERM, SIGINT and
// SIGHUP only set a flag while fit() runs; the loop finishes its step, every rank
// agrees, a checkpoint is written and fit returns.
#pragma once

#include <signal.h>

namespace shardtrain::train::detail {

/// Installs SIGTERM/SIGINT/SIGHUP handlers that only record the signal (when
/// enabled; SIGHUP stays ignored if it was, as under nohup) and restores the
/// previous handlers when destroyed.
class SignalGuard {
 public:
  explicit SignalGuard(bool enabled);
  ~SignalGuard();
  SignalGuard(const SignalGuard&) = delete;
  SignalGuard& operator=(const SignalGuard&) = delete;
  /// The signal received since construction, or 0.
  static int received();

 private:
  bool enabled_;
  struct sigaction previous_term_ {};
  struct sigaction previous_int_ {};
  struct sigaction previous_hup_ {};
};

}  // namespace shardtrain::train::detail
