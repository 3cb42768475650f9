// Many ranks of one host in one shared-memory group (65 and 130, more than
// the 64 that once fitted the mapping's header): each rank runs a few
// all_reduce, reduce_scatter and all_gather calls whose results it can
// compute itself, and exits 1 on a wrong value or an error.
//
//   shardtrain launch --nproc-per-node 1 -- shm_many_ranks N
//
// The launched process loads LibTorch once and forks N ranks of a world of
// its own, which meet in the launcher's store like any ranks (RANK,
// WORLD_SIZE, ... set per child): starting N processes that each load
// LibTorch would take minutes on a 2-core machine. Run with small staging
// areas (SHARDTRAIN_SHM_STAGE_BYTES) so transfers go through them in pieces.
#include <ATen/ATen.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <csignal>
#include <string>
#include <vector>

#include "shardtrain/comm/communicator.h"

using namespace shardtrain::comm;

namespace {

// Rank r's element i: r + 1 + i (exact in float32 for these sizes).
at::Tensor contribution(int64_t numel, int rank) {
  return at::arange(numel, at::kFloat) + static_cast<float>(rank + 1);
}

int check(const char* what, const at::Tensor& got, const at::Tensor& want, int rank) {
  if (at::equal(got, want)) return 0;
  const int64_t at_index = (got != want).nonzero()[0][0].item<int64_t>();
  std::fprintf(stderr, "rank %d: %s: element %lld is %g, expected %g\n", rank, what,
               static_cast<long long>(at_index), got[at_index].item<double>(),
               want[at_index].item<double>());
  return 1;
}

int run() {
  const auto start = std::chrono::steady_clock::now();
  const auto seconds = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  auto world = Communicator::create(CommOptions::from_env());
  const int n = world->size(), r = world->rank();
  if (r == 0) std::printf("%d ranks joined in %.1f s\n", n, seconds()), std::fflush(stdout);
  if (world->endpoint().find("through shared memory") == std::string::npos) {
    std::fprintf(stderr, "rank %d: not sharing memory: %s\n", r, world->endpoint().c_str());
    return 1;
  }
  int bad = 0;
  for (int64_t numel : {int64_t{1}, int64_t{3} * n + 1, int64_t{40} * n + 7}) {
    // The sum over ranks of r + 1 + i.
    const at::Tensor sum = at::arange(numel, at::kFloat) * n + static_cast<float>(n * (n + 1) / 2);
    at::Tensor t = contribution(numel, r);
    world->all_reduce(t);
    bad += check("all_reduce", t, sum, r);

    const ShardRange mine = shard_range(numel, n, r);
    at::Tensor out = at::zeros({mine.count}, at::kFloat);
    world->reduce_scatter(contribution(numel, r), out);
    bad += check("reduce_scatter", out, sum.narrow(0, mine.offset, mine.count), r);

    // Every rank's shard of the buffer whose element i is i * 3 + 1.
    const at::Tensor whole = at::arange(numel, at::kFloat) * 3 + 1;
    at::Tensor gathered = at::zeros({numel}, at::kFloat);
    world->all_gather(whole.narrow(0, mine.offset, mine.count).clone(), gathered);
    bad += check("all_gather", gathered, whole, r);
  }
  world->barrier();
  if (r == 0) std::printf("collectives done at %.1f s\n", seconds()), std::fflush(stdout);
  return bad == 0 ? 0 : 1;
}

// One rank: the checks, then an exit that runs no destructor of the parent's.
[[noreturn]] void rank_main(int rank, int n) {
  const std::string r = std::to_string(rank), size = std::to_string(n);
  setenv("RANK", r.c_str(), 1);
  setenv("LOCAL_RANK", r.c_str(), 1);
  setenv("WORLD_SIZE", size.c_str(), 1);
  setenv("LOCAL_WORLD_SIZE", size.c_str(), 1);
  int rc = 1;
  try {
    rc = run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
  }
  std::fflush(stdout);
  std::fflush(stderr);
  _exit(rc);
}

}  // namespace

int main(int argc, char** argv) {
  const int n = argc == 2 ? std::atoi(argv[1]) : 0;
  if (n < 2) {
    std::fprintf(stderr, "usage: shm_many_ranks RANKS (at least 2), under shardtrain launch\n");
    return 2;
  }
  std::fflush(stdout);
  std::vector<pid_t> pids;
  for (int rank = 0; rank < n; ++rank) {
    const pid_t pid = fork();
    if (pid == 0) rank_main(rank, n);
    if (pid < 0) {
      std::perror("fork");
      for (pid_t p : pids) kill(p, SIGKILL);
      return 1;
    }
    pids.push_back(pid);
  }
  int failed = 0;
  for (pid_t p : pids) {
    int status = 0;
    waitpid(p, &status, 0);
    failed += WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 1;
  }
  if (failed > 0) {
    std::fprintf(stderr, "%d of %d ranks failed\n", failed, n);
    return 1;
  }
  std::printf("shared-memory collectives OK on %d ranks\n", n);
  return 0;
}
