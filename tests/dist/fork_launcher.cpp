// `fork_launcher NPROC MAX_RESTARTS MODE ARGS...`: dist::launch() with
// launch_probe's modes as the ranks, forked by the launcher's fork server
// (LaunchOptions::rank_main) instead of exec'ed. Should the launcher exec
// instead, the ranks run this main with MODE as NPROC and fail, so a test
// that passes used the fork server.
#include <fcntl.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "shardtrain/launch/launcher.h"

int probe_main(int argc, char** argv);  // tests/dist/launch_probe.cpp

int main(int argc, char** argv) {
  if (argc < 4 || std::atoi(argv[1]) < 1) {
    std::fprintf(stderr, "usage: fork_launcher NPROC MAX_RESTARTS MODE ARGS...\n");
    return 2;
  }
  // Held across the launch as a run directory's lock is: a forked rank must
  // not inherit it (an exec'ed one would not).
  const int held = ::open("/dev/zero", O_RDONLY | O_CLOEXEC);
  if (held < 0) return 1;
  std::vector<std::string> command = {argv[0]};
  for (int i = 3; i < argc; ++i) command.emplace_back(argv[i]);
  return shardtrain::dist::launch(shardtrain::dist::LaunchOptions()
                                      .nproc_per_node(std::atoi(argv[1]))
                                      .max_restarts(std::atoi(argv[2]))
                                      .stop_grace_s(2.0)
                                      .command(command)
                                      .rank_main(probe_main));
}
