// SignalGuard: the first SIGTERM/SIGINT/SIGHUP is remembered for the training loop.
#include "train/signal_guard.h"

#include <atomic>
#include <csignal>

namespace shardtrain::train::detail {

namespace {

std::atomic<int> g_signal{0};

// The first SIGTERM/SIGINT/SIGHUP is remembered (training saves and stops);
// a second SIGTERM or SIGINT gets the default action, so a stuck job can
// still be stopped. A hangup often comes twice (from the kernel and from the
// shell) and never means "now": a repeated one changes nothing.
extern "C" void remember_signal(int sig) {
  if (g_signal.exchange(sig) != 0 && sig != SIGHUP) {
    std::signal(sig, SIG_DFL);
    std::raise(sig);
  }
}

}  // namespace

SignalGuard::SignalGuard(bool enabled) : enabled_(enabled) {
  if (!enabled_) return;
  g_signal.store(0);
  struct sigaction action {};
  action.sa_handler = remember_signal;
  action.sa_flags = SA_RESTART;  // system calls in progress resume
  sigemptyset(&action.sa_mask);
  sigaction(SIGTERM, &action, &previous_term_);
  sigaction(SIGINT, &action, &previous_int_);
  // A hangup (the terminal or SSH session closed) saves and stops as SIGTERM
  // does, unless it was ignored when we started (nohup): then it stays so.
  sigaction(SIGHUP, nullptr, &previous_hup_);
  if (previous_hup_.sa_handler != SIG_IGN) sigaction(SIGHUP, &action, nullptr);
}

SignalGuard::~SignalGuard() {
  if (!enabled_) return;
  sigaction(SIGTERM, &previous_term_, nullptr);
  sigaction(SIGINT, &previous_int_, nullptr);
  sigaction(SIGHUP, &previous_hup_, nullptr);
}

int SignalGuard::received() { return g_signal.load(); }

}  // namespace shardtrain::train::detail
