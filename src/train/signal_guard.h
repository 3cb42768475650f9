// The signal handling behind checkpoint.save_on_signal: SIGTERM and SIGINT
// only set a flag while fit() runs; the loop finishes its step, every rank
// agrees, a checkpoint is written and fit returns.
#pragma once

#include <signal.h>

namespace shardtrain::train::detail {

/// Installs SIGTERM/SIGINT handlers that only record the signal (when
/// enabled) and restores the previous handlers when destroyed.
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
};

}  // namespace shardtrain::train::detail
