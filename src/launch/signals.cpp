#include "launch/signals.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "shardtrain/core/error.h"

namespace shardtrain::dist::detail {
namespace {

constexpr int kHandled[] = {SIGINT, SIGTERM, SIGHUP, SIGCHLD};

int g_signal_pipe[2] = {-1, -1};
int g_first_stop = 0;

void on_signal(int sig) {
  const int saved = errno;
  const unsigned char byte = static_cast<unsigned char>(sig);
  // A full pipe only drops a wake-up that is already pending.
  ssize_t ignored = ::write(g_signal_pipe[1], &byte, 1);
  (void)ignored;
  errno = saved;
}

bool is_stop_signal(int sig) { return sig == SIGINT || sig == SIGTERM || sig == SIGHUP; }

}  // namespace

SignalGuard::SignalGuard() {
  static_assert(sizeof kHandled / sizeof kHandled[0] == kCount);
  ST_ASSERT(g_signal_pipe[0] < 0, "launch() is already running in this process");
  ST_CHECK(::pipe2(g_signal_pipe, O_CLOEXEC | O_NONBLOCK) == 0, Error,
           "cannot create a pipe: ", std::strerror(errno));
  g_first_stop = 0;
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_NOCLDSTOP;
  for (int i = 0; i < kCount; ++i) {
    ::sigaction(kHandled[i], nullptr, &old_[i]);
    if (kHandled[i] == SIGHUP && old_[i].sa_handler == SIG_IGN) continue;
    ::sigaction(kHandled[i], &sa, nullptr);
  }
  // A closed stdout must not kill the launcher and orphan the ranks.
  struct sigaction ign {};
  ign.sa_handler = SIG_IGN;
  ::sigaction(SIGPIPE, &ign, &old_[kCount]);
}

SignalGuard::~SignalGuard() {
  for (int i = 0; i < kCount; ++i) ::sigaction(kHandled[i], &old_[i], nullptr);
  ::sigaction(SIGPIPE, &old_[kCount], nullptr);
  ::close(g_signal_pipe[0]);
  ::close(g_signal_pipe[1]);
  g_signal_pipe[0] = g_signal_pipe[1] = -1;
}

int signal_fd() { return g_signal_pipe[0]; }

std::vector<int> drain_stop_signals() {
  std::vector<int> stops;
  unsigned char sigs[64];
  ssize_t n;
  while ((n = ::read(g_signal_pipe[0], sigs, sizeof sigs)) > 0) {
    for (ssize_t i = 0; i < n; ++i) {
      if (is_stop_signal(sigs[i])) stops.push_back(sigs[i]);
    }
  }
  if (!stops.empty() && g_first_stop == 0) g_first_stop = stops.front();
  return stops;
}

int first_stop_signal() { return g_first_stop; }

struct sigaction hup_for_children() {
  struct sigaction hup {};
  ::sigaction(SIGHUP, nullptr, &hup);
  if (hup.sa_handler != SIG_IGN) {
    hup = {};
    hup.sa_handler = SIG_DFL;
  }
  return hup;
}

void reset_signals_in_child(const struct sigaction& hup) {
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  for (int sig : {SIGINT, SIGTERM, SIGCHLD, SIGPIPE}) ::sigaction(sig, &dfl, nullptr);
  ::sigaction(SIGHUP, &hup, nullptr);
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
}

}  // namespace shardtrain::dist::detail
