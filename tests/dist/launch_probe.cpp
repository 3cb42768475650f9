// A rank program for the launcher tests; what it does is chosen by argv:
//   lines N                 N lines to stdout ("out R.i"), one to stderr, and an
//                           unterminated "partial R" on stdout; exit 0
//   print-env               the launcher's variables as NAME=value (or <unset>),
//                           then PARENT=<parent pid>
//   fail-rank R CODE        rank R prints three lines and exits CODE after 0.2 s;
//                           the others print "sleeping" and sleep 60 s
//   fail-rank R CODE stubborn   the same, but the others ignore SIGTERM
//   wait-signal             prints "ready pid P"; on SIGINT/SIGTERM prints "rank K
//                           got signal S" and exits 0; exits 1 after 30 s
//   print-fds               "fd N -> TARGET" per descriptor above stderr, then
//                           "fds listed"
//   fail-until-restart K    prints the restart count; exits 3 while it is < K
//   exit-codes C0 C1 ...    rank K waits K x 0.3 s, prints "rank K exits CK" and
//                           exits CK (ranks past the list exit 0)
//   kill-self SIG           raises SIG
// No shardtrain or torch dependencies on purpose: it must start fast.
#include <dirent.h>
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace {

volatile sig_atomic_t g_signal = 0;

void on_signal(int sig) { g_signal = sig; }

int env_int(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::atoi(v) : -1;
}

int usage() {
  std::fprintf(stderr, "launch_probe: unknown mode; see tests/dist/launch_probe.cpp\n");
  return 2;
}

}  // namespace

// The probe's whole behaviour; main() below, or, in fork_launcher, the
// rank_main of ranks forked by the launcher's fork server.
int probe_main(int argc, char** argv) {
  if (argc < 2) return usage();
  const std::string mode = argv[1];
  const int rank = env_int("RANK");

  if (mode == "lines" && argc == 3) {
    const int n = std::atoi(argv[2]);
    for (int i = 0; i < n; ++i) std::printf("out %d.%d\n", rank, i);
    std::fflush(stdout);
    std::fprintf(stderr, "err %d\n", rank);
    std::printf("partial %d", rank);
    return 0;
  }
  if (mode == "print-env") {
    for (const char* name : {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                             "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                             "SHARDTRAIN_RESTART_COUNT", "SHARDTRAIN_STORE", "SHARDTRAIN_NODE_SIZES",
                             "SLURM_PROCID", "PROBE_KEEP"}) {
      const char* v = std::getenv(name);
      std::printf("%s=%s\n", name, v ? v : "<unset>");
    }
    std::printf("PARENT=%d\n", static_cast<int>(getppid()));
    return 0;
  }
  if (mode == "fail-rank" && (argc == 4 || argc == 5)) {
    if (argc == 5 && std::strcmp(argv[4], "stubborn") == 0) signal(SIGTERM, SIG_IGN);
    if (rank == std::atoi(argv[2])) {
      std::printf("rank %d starting\n", rank);
      std::printf("rank %d working\n", rank);
      std::fflush(stdout);
      usleep(200 * 1000);
      std::fprintf(stderr, "rank %d failing\n", rank);
      return std::atoi(argv[3]);
    }
    std::printf("sleeping\n");
    std::fflush(stdout);
    sleep(60);
    return 0;
  }
  if (mode == "wait-signal") {
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, nullptr);
    sigaction(SIGTERM, &sa, nullptr);
    std::printf("ready pid %d\n", static_cast<int>(getpid()));
    std::fflush(stdout);
    for (int i = 0; i < 300 && !g_signal; ++i) usleep(100 * 1000);
    if (!g_signal) {
      std::printf("rank %d timed out waiting for a signal\n", rank);
      return 1;
    }
    std::printf("rank %d got signal %d\n", rank, static_cast<int>(g_signal));
    return 0;
  }
  if (mode == "print-fds") {
    // What each descriptor above stderr refers to (the directory's own aside).
    if (DIR* d = opendir("/proc/self/fd")) {
      while (const dirent* e = readdir(d)) {
        const int fd = std::atoi(e->d_name);
        if (fd <= 2 || fd == dirfd(d)) continue;
        char target[512] = {};
        const std::string link = std::string("/proc/self/fd/") + e->d_name;
        if (readlink(link.c_str(), target, sizeof target - 1) < 0) continue;
        std::printf("fd %d -> %s\n", fd, target);
      }
      closedir(d);
    }
    std::printf("fds listed\n");
    return 0;
  }
  if (mode == "fail-until-restart" && argc == 3) {
    const int count = env_int("SHARDTRAIN_RESTART_COUNT");
    std::printf("restart count %d\n", count);
    return count < std::atoi(argv[2]) ? 3 : 0;
  }
  if (mode == "exit-codes") {
    usleep(static_cast<useconds_t>(rank) * 300 * 1000);
    const int code = rank + 2 < argc ? std::atoi(argv[rank + 2]) : 0;
    std::printf("rank %d exits %d\n", rank, code);
    return code;
  }
  if (mode == "kill-self" && argc == 3) {
    std::fflush(stdout);
    signal(std::atoi(argv[2]), SIG_DFL);
    raise(std::atoi(argv[2]));
    return 0;
  }
  return usage();
}

#ifndef LAUNCH_PROBE_NO_MAIN
int main(int argc, char** argv) { return probe_main(argc, argv); }
#endif
