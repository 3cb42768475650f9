// Runs the real `shardtrain launch` as a subprocess with launch_probe as its
// rank program, and checks exit codes, prefixed output, restarts and signals.
#include <gtest/gtest.h>
#include "shardtrain/launch/launcher.h"
#include "launch/progress.h"
#include "launch/rendezvous.h"
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <functional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#ifndef SHARDTRAIN_CLI_PATH
#error "SHARDTRAIN_CLI_PATH must be the absolute path of the shardtrain binary"
#endif
#ifndef LAUNCH_PROBE_PATH
#error "LAUNCH_PROBE_PATH must be the absolute path of launch_probe"
#endif
#ifndef FORK_LAUNCHER_PATH
#error "FORK_LAUNCHER_PATH must be the absolute path of fork_launcher"
#endif

namespace {

using Clock = std::chrono::steady_clock;

struct Result {
  int code = -1;  // exit code, 128 + signal if killed, -1 if it had to be killed on timeout
  std::string out, err;
  double seconds = 0;
};

// `shardtrain ARGS...` with its stdout and stderr captured separately.
class Cli {
 public:
  explicit Cli(const std::vector<std::string>& args,
               const std::vector<std::string>& extra_env = {},
               const std::string& program = SHARDTRAIN_CLI_PATH) {
    int out[2], err[2];
    EXPECT_EQ(::pipe2(out, O_CLOEXEC), 0);
    EXPECT_EQ(::pipe2(err, O_CLOEXEC), 0);
    std::vector<std::string> argv_s = {program};
    argv_s.insert(argv_s.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (auto& a : argv_s) argv.push_back(a.data());
    argv.push_back(nullptr);
    start_ = Clock::now();
    pid_ = ::fork();
    if (pid_ == 0) {
      for (const auto& kv : extra_env) ::putenv(const_cast<char*>(kv.c_str()));
      ::dup2(out[1], 1);
      ::dup2(err[1], 2);
      ::execv(argv[0], argv.data());
      ::_exit(99);
    }
    ::close(out[1]);
    ::close(err[1]);
    fds_[0] = out[0];
    fds_[1] = err[0];
  }
  ~Cli() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    for (int fd : fds_) {
      if (fd >= 0) ::close(fd);
    }
  }

  /// Reads output until `done(stdout)` holds or `timeout_s` passes.
  bool wait_for(const std::function<bool(const std::string&)>& done, double timeout_s) {
    const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                             std::chrono::duration<double>(timeout_s));
    while (!done(result_.out)) {
      if (Clock::now() >= deadline || !pump(deadline)) return done(result_.out);
    }
    return true;
  }

  void signal(int sig) { ::kill(pid_, sig); }

  /// Reads to EOF and reaps the launcher; kills it after `timeout_s`, a
  /// guard against a hang, not a measure of speed (a loaded 2-core machine
  /// can take seconds to start a few processes).
  Result finish(double timeout_s = 60) {
    const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                             std::chrono::duration<double>(timeout_s));
    while (pump(deadline)) {
    }
    if (Clock::now() >= deadline) {
      ADD_FAILURE() << "launcher still running after " << timeout_s << " s";
      ::kill(pid_, SIGKILL);
    }
    int status = 0;
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
    result_.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    result_.seconds = std::chrono::duration<double>(Clock::now() - start_).count();
    return result_;
  }

  pid_t pid() const { return pid_; }

 private:
  // One poll round; false once both pipes hit EOF or the deadline passed.
  bool pump(Clock::time_point deadline) {
    pollfd p[2];
    int n = 0;
    std::string* sinks[2];
    for (int i = 0; i < 2; ++i) {
      if (fds_[i] < 0) continue;
      p[n] = pollfd{fds_[i], POLLIN, 0};
      sinks[n++] = i == 0 ? &result_.out : &result_.err;
    }
    if (n == 0) return false;
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                          deadline - Clock::now()).count();
    if (left <= 0) return false;
    if (::poll(p, n, static_cast<int>(left)) <= 0) return Clock::now() < deadline;
    for (int i = 0; i < n; ++i) {
      if (!p[i].revents) continue;
      char buf[4096];
      const ssize_t got = ::read(p[i].fd, buf, sizeof buf);
      if (got > 0) {
        sinks[i]->append(buf, static_cast<size_t>(got));
      } else {
        for (int& fd : fds_) {
          if (fd == p[i].fd) {
            ::close(fd);
            fd = -1;
          }
        }
      }
    }
    return true;
  }

  pid_t pid_ = -1;
  int fds_[2] = {-1, -1};
  Clock::time_point start_;
  Result result_;
};

Result run(const std::vector<std::string>& args, const std::vector<std::string>& env = {}) {
  Cli cli(args, env);
  return cli.finish();
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

int count_of(const std::string& haystack, const std::string& needle) {
  int n = 0;
  for (size_t at = haystack.find(needle); at != std::string::npos;
       at = haystack.find(needle, at + 1)) {
    ++n;
  }
  return n;
}

const std::string kProbe = LAUNCH_PROBE_PATH;

TEST(Launcher, AllRanksSucceedAndEveryLineIsPrefixed) {
  const Result r = run({"launch", "--nproc-per-node", "3", "--", kProbe, "lines", "2"});
  ASSERT_EQ(r.code, 0) << r.err;
  for (const auto& line : lines_of(r.out)) {
    EXPECT_EQ(line.rfind("[rank ", 0), 0u) << line;
  }
  for (int k = 0; k < 3; ++k) {
    const std::string p = "[rank " + std::to_string(k) + "] ";
    EXPECT_TRUE(contains(r.out, p + "out " + std::to_string(k) + ".0\n")) << r.out;
    EXPECT_TRUE(contains(r.out, p + "out " + std::to_string(k) + ".1\n")) << r.out;
    // The unterminated last line is flushed at EOF, as a line of its own.
    EXPECT_TRUE(contains(r.out, p + "partial " + std::to_string(k) + "\n")) << r.out;
    EXPECT_TRUE(contains(r.err, p + "err " + std::to_string(k) + "\n")) << r.err;
  }
  EXPECT_EQ(lines_of(r.out).size(), 9u) << r.out;
  EXPECT_FALSE(contains(r.out, "err ")) << "stderr lines must stay on stderr";
}

TEST(Launcher, RanksGetTheTorchrunVariables) {
  const Result r = run({"launch", "--nproc-per-node=2", "--", kProbe, "print-env"},
                       {"SLURM_PROCID=5", "PROBE_KEEP=yes", "RANK=9"});
  ASSERT_EQ(r.code, 0) << r.err;
  std::set<std::string> ports;
  for (int k = 0; k < 2; ++k) {
    const std::string p = "[rank " + std::to_string(k) + "] ";
    EXPECT_TRUE(contains(r.out, p + "RANK=" + std::to_string(k) + "\n")) << r.out;
    EXPECT_TRUE(contains(r.out, p + "LOCAL_RANK=" + std::to_string(k) + "\n"));
    EXPECT_TRUE(contains(r.out, p + "WORLD_SIZE=2\n"));
    EXPECT_TRUE(contains(r.out, p + "LOCAL_WORLD_SIZE=2\n"));
    EXPECT_TRUE(contains(r.out, p + "GROUP_RANK=0\n"));
    EXPECT_TRUE(contains(r.out, p + "MASTER_ADDR=127.0.0.1\n"));
    EXPECT_TRUE(contains(r.out, p + "SHARDTRAIN_RESTART_COUNT=0\n"));
    // Another launcher's rank variables describe the launcher, not the rank.
    EXPECT_TRUE(contains(r.out, p + "SLURM_PROCID=<unset>\n"));
    EXPECT_TRUE(contains(r.out, p + "PROBE_KEEP=yes\n"));
  }
  for (const auto& line : lines_of(r.out)) {
    const size_t at = line.find("MASTER_PORT=");
    if (at != std::string::npos) ports.insert(line.substr(at + 12));
  }
  ASSERT_EQ(ports.size(), 1u) << "every rank must see the same port:\n" << r.out;
  const int port = std::stoi(*ports.begin());
  EXPECT_GT(port, 0);
  EXPECT_LE(port, 65535);
}

// Two launchers on this machine as nodes 0 and 1 of one job.
TEST(Launcher, SecondNodeGetsGlobalRanks) {
  const std::string port = std::to_string(shardtrain::dist::find_free_port());
  const std::vector<std::string> env = {"SHARDTRAIN_JOB_TOKEN=two-node-test"};
  auto node = [&](const char* rank) {
    return std::vector<std::string>{"launch", "--nproc-per-node", "2", "--nnodes", "2",
                                    "--node-rank", rank, "--master-addr", "127.0.0.1",
                                    "--master-port", port, "--", kProbe, "print-env"};
  };
  Cli node0(node("0"), env), node1(node("1"), env);
  const Result r0 = node0.finish();
  const Result r = node1.finish();
  ASSERT_EQ(r0.code, 0) << r0.err;
  ASSERT_EQ(r.code, 0) << r.err;
  for (int k : {2, 3}) {
    const std::string p = "[rank " + std::to_string(k) + "] ";
    EXPECT_TRUE(contains(r.out, p + "RANK=" + std::to_string(k) + "\n")) << r.out;
    EXPECT_TRUE(contains(r.out, p + "LOCAL_RANK=" + std::to_string(k - 2) + "\n"));
    EXPECT_TRUE(contains(r.out, p + "WORLD_SIZE=4\n"));
    EXPECT_TRUE(contains(r.out, p + "GROUP_RANK=1\n"));
    EXPECT_TRUE(contains(r.out, p + "MASTER_ADDR=127.0.0.1\n"));
    // Set only when nodes differ: equal nodes see what they always saw.
    EXPECT_TRUE(contains(r.out, p + "SHARDTRAIN_NODE_SIZES=<unset>\n")) << r.out;
    // The store is at the rendezvous port; the ranks' own MASTER_PORT is
    // another one, the same on both nodes.
    EXPECT_TRUE(contains(r.out, p + "SHARDTRAIN_STORE=127.0.0.1:" + port + "\n")) << r.out;
    EXPECT_FALSE(contains(r.out, p + "MASTER_PORT=" + port + "\n"));
  }
  EXPECT_TRUE(contains(r0.out, "[rank 0] RANK=0\n")) << r0.out;
  const size_t at = r0.out.find("MASTER_PORT=");
  ASSERT_NE(at, std::string::npos);
  const std::string master_port = r0.out.substr(at, r0.out.find('\n', at) - at);
  EXPECT_EQ(count_of(r.out, master_port + "\n"), 2) << master_port << "\n" << r.out;
}

// Node i's first rank is the sum of the counts of the nodes before it.
TEST(NodeLayout, RanksFollowTheNodesBefore) {
  using shardtrain::dist::detail::NodeLayout;
  const NodeLayout uneven{{2, 1, 3}};
  EXPECT_EQ(uneven.world(), 6);
  EXPECT_EQ(uneven.first_rank(0), 0);
  EXPECT_EQ(uneven.first_rank(1), 2);
  EXPECT_EQ(uneven.first_rank(2), 3);
  EXPECT_TRUE(uneven.uneven());
  // Equal nodes: node * nproc_per_node, as before.
  const NodeLayout even{{4, 4, 4}};
  EXPECT_EQ(even.world(), 12);
  EXPECT_EQ(even.first_rank(2), 8);
  EXPECT_FALSE(even.uneven());
  const NodeLayout one{{3}};
  EXPECT_EQ(one.world(), 3);
  EXPECT_EQ(one.first_rank(0), 0);
  EXPECT_FALSE(one.uneven());
}

// Node 0 starts 2 ranks and node 1 one: a world of 3, node 1's rank is 2.
TEST(Launcher, NodesMayStartDifferentNumbersOfRanks) {
  const std::string port = std::to_string(shardtrain::dist::find_free_port());
  const std::vector<std::string> env = {"SHARDTRAIN_JOB_TOKEN=uneven-node-test"};
  auto node = [&](const char* rank, const char* nproc) {
    return std::vector<std::string>{"launch", "--nproc-per-node", nproc, "--nnodes", "2",
                                    "--node-rank", rank, "--master-addr", "127.0.0.1",
                                    "--master-port", port, "--", kProbe, "print-env"};
  };
  Cli node0(node("0", "2"), env), node1(node("1", "1"), env);
  const Result r0 = node0.finish();
  const Result r1 = node1.finish();
  ASSERT_EQ(r0.code, 0) << r0.err;
  ASSERT_EQ(r1.code, 0) << r1.err;
  for (int k : {0, 1}) {
    const std::string p = "[rank " + std::to_string(k) + "] ";
    EXPECT_TRUE(contains(r0.out, p + "RANK=" + std::to_string(k) + "\n")) << r0.out;
    EXPECT_TRUE(contains(r0.out, p + "LOCAL_RANK=" + std::to_string(k) + "\n"));
    EXPECT_TRUE(contains(r0.out, p + "WORLD_SIZE=3\n"));
    EXPECT_TRUE(contains(r0.out, p + "LOCAL_WORLD_SIZE=2\n"));
    EXPECT_TRUE(contains(r0.out, p + "GROUP_RANK=0\n"));
    EXPECT_TRUE(contains(r0.out, p + "SHARDTRAIN_NODE_SIZES=2,1\n"));
  }
  EXPECT_TRUE(contains(r1.out, "[rank 2] RANK=2\n")) << r1.out;
  EXPECT_TRUE(contains(r1.out, "[rank 2] LOCAL_RANK=0\n"));
  EXPECT_TRUE(contains(r1.out, "[rank 2] WORLD_SIZE=3\n"));
  EXPECT_TRUE(contains(r1.out, "[rank 2] LOCAL_WORLD_SIZE=1\n"));
  EXPECT_TRUE(contains(r1.out, "[rank 2] GROUP_RANK=1\n"));
  EXPECT_TRUE(contains(r1.out, "[rank 2] SHARDTRAIN_NODE_SIZES=2,1\n"));
  EXPECT_EQ(count_of(r1.out, "RANK=2\n"), 1) << r1.out;  // one rank on node 1
  EXPECT_TRUE(contains(r0.err, "nodes run 2,1 ranks: 3 in all")) << r0.err;
}

TEST(Launcher, SeveralNodesNeedAJobToken) {
  const Result r = run({"launch", "--nproc-per-node", "1", "--nnodes", "2", "--master-addr",
                        "127.0.0.1", "--master-port", "1234", "--", kProbe, "print-env"},
                       {"SHARDTRAIN_JOB_TOKEN="});
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "SHARDTRAIN_JOB_TOKEN")) << r.err;
}

TEST(Launcher, OneFailingRankStopsTheOthers) {
  const Result r = run({"launch", "--nproc-per-node", "3", "--", kProbe, "fail-rank", "1", "7"});
  EXPECT_EQ(r.code, 7) << r.err;
  // The others sleep 60 s: well under that, they were stopped, not waited
  // for (a wide margin, so a loaded 2-core machine cannot flake it).
  EXPECT_LT(r.seconds, 30.0) << "the sleeping ranks were not stopped promptly";
  EXPECT_TRUE(contains(r.err, "rank 1 failed with exit code 7")) << r.err;
  // The report repeats rank 1's last lines, from both of its streams.
  const size_t report = r.err.find("last 3 lines of rank 1, which failed with exit code 7:");
  ASSERT_NE(report, std::string::npos) << r.err;
  EXPECT_TRUE(contains(r.err.substr(report), "[rank 1] rank 1 working")) << r.err;
  EXPECT_TRUE(contains(r.err.substr(report), "[rank 1] rank 1 failing")) << r.err;
  EXPECT_FALSE(contains(r.err, "rank 0 failed")) << r.err;
  EXPECT_FALSE(contains(r.err, "rank 2 failed")) << r.err;
}

TEST(Launcher, RanksThatIgnoreSigtermAreKilledAfterTheGrace) {
  const Result r = run({"launch", "--nproc-per-node", "2", "--stop-grace", "0.5", "--", kProbe,
                        "fail-rank", "0", "5", "stubborn"});
  EXPECT_EQ(r.code, 5) << r.err;
  EXPECT_TRUE(contains(r.err, "sending SIGKILL")) << r.err;
  EXPECT_LT(r.seconds, 30.0) << "the stubborn ranks (sleeping 60 s) were waited for";
}

TEST(Launcher, RankKilledBySignalGives128PlusSignal) {
  const Result r = run({"launch", "--nproc-per-node", "2", "--", kProbe, "kill-self", "9"});
  EXPECT_EQ(r.code, 128 + 9) << r.err;
  EXPECT_TRUE(contains(r.err, "killed by signal 9")) << r.err;
}

TEST(Launcher, RestartsUntilTheGroupSucceeds) {
  const Result r = run({"launch", "--nproc-per-node", "2", "--max-restarts", "2", "--", kProbe,
                        "fail-until-restart", "2"});
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(count_of(r.err, "restarting all 2 ranks"), 2) << r.err;
  EXPECT_TRUE(contains(r.err, "(restart 2 of 2)")) << r.err;
  EXPECT_TRUE(contains(r.out, "[rank 0] restart count 2\n")) << r.out;
  EXPECT_TRUE(contains(r.out, "[rank 1] restart count 2\n")) << r.out;
}

TEST(Launcher, ExhaustedRestartsReturnTheFailure) {
  const Result r = run({"launch", "--nproc-per-node", "2", "--max-restarts=1", "--", kProbe,
                        "fail-until-restart", "5"});
  EXPECT_EQ(r.code, 3) << r.err;
  EXPECT_EQ(count_of(r.err, "restarting all 2 ranks"), 1) << r.err;
  EXPECT_TRUE(contains(r.err, "giving up after 1 restart")) << r.err;
  EXPECT_TRUE(contains(r.out, "restart count 1\n")) << r.out;
  EXPECT_FALSE(contains(r.out, "restart count 2\n")) << r.out;
}

TEST(Launcher, BadInputIsNotRestarted) {
  // Exit code 2 (a configuration error) fails the same way on every attempt.
  const Result r = run({"launch", "--nproc-per-node", "2", "--max-restarts", "3", "--", kProbe,
                        "fail-rank", "1", "2"});
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_EQ(count_of(r.err, "restarting all"), 0) << r.err;
  EXPECT_TRUE(contains(r.err, "not restarting: rank 1 exited with 2")) << r.err;
  // Any other failure is restarted.
  const Result other = run({"launch", "--nproc-per-node", "2", "--max-restarts", "1", "--", kProbe,
                            "fail-rank", "1", "3"});
  EXPECT_EQ(other.code, 3) << other.err;
  EXPECT_EQ(count_of(other.err, "restarting all 2 ranks"), 1) << other.err;
}

// A job of two launchers on this machine, nodes 0 and 1 of 2 ranks each
// (ranks 0-1 and 2-3), running launch_probe with `probe` and --max-restarts
// `restarts`; the results of node 0 and node 1.
// Node 0 runs 2 ranks, node 1 `node1_ranks`.
std::pair<Result, Result> two_nodes(const std::vector<std::string>& probe, int restarts,
                                    int node1_ranks = 2) {
  const std::string port = std::to_string(shardtrain::dist::find_free_port());
  const std::vector<std::string> env = {"SHARDTRAIN_JOB_TOKEN=two-node-failures"};
  auto node = [&](const char* rank) {
    const std::string nproc = rank[0] == '0' ? "2" : std::to_string(node1_ranks);
    std::vector<std::string> args = {"launch", "--nproc-per-node", nproc, "--nnodes", "2",
                                     "--node-rank", rank, "--master-addr", "127.0.0.1",
                                     "--master-port", port, "--max-restarts",
                                     std::to_string(restarts), "--", kProbe};
    args.insert(args.end(), probe.begin(), probe.end());
    return args;
  };
  Cli node0(node("0"), env), node1(node("1"), env);
  Result r0 = node0.finish(120);
  Result r1 = node1.finish(120);
  return {r0, r1};
}

// Bad input (exit 2) on one node is not restarted on any node, and every
// node exits 2: the node whose rank failed and the node that only heard of
// it, whichever of the two decides on restarts (node 0). Node 1 says why
// node 0 stopped the job, not merely that its store went away.
TEST(Launcher, BadInputOnOneNodeEndsEveryNodeWith2) {
  for (const int failing : {2, 0}) {  // a rank of node 1, then of node 0
    SCOPED_TRACE("rank " + std::to_string(failing) + " exits 2");
    const auto [r0, r1] = two_nodes({"fail-rank", std::to_string(failing), "2"}, 2);
    EXPECT_EQ(r0.code, 2) << r0.err;
    EXPECT_EQ(r1.code, 2) << r1.err;
    const std::string& failed_out = failing == 2 ? r1.out : r0.out;
    const std::string start = "[rank " + std::to_string(failing) + "] rank " +
                              std::to_string(failing) + " starting\n";
    EXPECT_EQ(count_of(failed_out, start), 1) << "the failing rank was started again\n" << failed_out;
    EXPECT_EQ(count_of(r0.err, "restarting all"), 0) << r0.err;
    EXPECT_EQ(count_of(r1.err, "restarting all"), 0) << r1.err;
    EXPECT_TRUE(contains(r0.err, "not restarting")) << r0.err;
    const std::string why = "node 0 stopped the job: node " + std::string(failing == 2 ? "1" : "0") +
                            ": rank " + std::to_string(failing) + " failed with exit code 2";
    EXPECT_TRUE(contains(r1.err, why)) << r1.err;
    EXPECT_TRUE(contains(r1.err, "bad input")) << r1.err;
    EXPECT_FALSE(contains(r1.err, "lost the job's store")) << r1.err;
  }
}

// A rank that fails every time on node 1: after the one restart allowed,
// both nodes give up and exit with its code, node 0 naming the node and rank.
TEST(Launcher, RestartsRunOutOnEveryNode) {
  const auto [r0, r1] = two_nodes({"fail-rank", "3", "5"}, 1);
  EXPECT_EQ(r0.code, 5) << r0.err;
  EXPECT_EQ(r1.code, 5) << r1.err;
  EXPECT_EQ(count_of(r0.err, "restarting all 4 ranks"), 1) << r0.err;
  EXPECT_EQ(count_of(r1.err, "restarting all 4 ranks"), 1) << r1.err;
  EXPECT_EQ(count_of(r1.out, "[rank 3] rank 3 starting\n"), 2) << r1.out;
  EXPECT_TRUE(contains(r0.err, "node 1: rank 3 failed with exit code 5")) << r0.err;
  EXPECT_TRUE(contains(r0.err, "giving up after 1 restart")) << r0.err;
  EXPECT_TRUE(contains(r1.err, "rank 3 failed with exit code 5")) << r1.err;
  EXPECT_TRUE(contains(r1.err, "node 0 stopped the job: node 1: rank 3 failed with exit code 5 "
                               "(no restart left: --max-restarts 1)"))
      << r1.err;
}

// Nodes of 2 and 1 ranks: node 1's rank is 2, a restart starts all 3 again,
// and the job ends on both nodes with that rank's code.
TEST(Launcher, UnevenNodesRestartAndReportGlobalRanks) {
  const auto [r0, r1] = two_nodes({"fail-rank", "2", "5"}, 1, /*node1_ranks=*/1);
  EXPECT_EQ(r0.code, 5) << r0.err;
  EXPECT_EQ(r1.code, 5) << r1.err;
  EXPECT_EQ(count_of(r1.out, "[rank 2] rank 2 starting\n"), 2) << r1.out;
  EXPECT_TRUE(contains(r1.err, "rank 2 failed with exit code 5")) << r1.err;
  EXPECT_TRUE(contains(r0.err, "restarting all 3 ranks (restart 1 of 1)")) << r0.err;
  EXPECT_TRUE(contains(r1.err, "restarting all 3 ranks (restart 1 of 1)")) << r1.err;
  EXPECT_TRUE(contains(r0.err, "node 1: rank 2 failed")) << r0.err;
}

// Exit 77 is a skip (a test whose precondition does not hold), which ctest's
// SKIP_RETURN_CODE maps to "skipped": not a failure that stops the others or
// restarts the job, and the launcher's result only when nothing failed.
TEST(Launcher, ASkippingRankIsNotAFailure) {
  const Result r = run({"launch", "--nproc-per-node", "3", "--max-restarts", "2", "--", kProbe,
                        "exit-codes", "77", "0", "77"});
  EXPECT_EQ(r.code, shardtrain::dist::kSkippedExitCode) << r.err;
  for (const char* line : {"[rank 0] rank 0 exits 77\n", "[rank 1] rank 1 exits 0\n",
                           "[rank 2] rank 2 exits 77\n"}) {
    EXPECT_TRUE(contains(r.out, line)) << "a rank was stopped before it finished:\n" << r.out;
  }
  EXPECT_FALSE(contains(r.err, "failed")) << r.err;
  EXPECT_FALSE(contains(r.err, "restarting")) << r.err;

  // A failure anywhere wins over a skip, whichever comes first.
  const Result failed = run({"launch", "--nproc-per-node", "2", "--", kProbe, "exit-codes", "77", "1"});
  EXPECT_EQ(failed.code, 1) << failed.err;
  EXPECT_TRUE(contains(failed.err, "rank 1 failed with exit code 1")) << failed.err;
  const Result first = run({"launch", "--nproc-per-node", "2", "--", kProbe, "exit-codes", "1", "77"});
  EXPECT_EQ(first.code, 1) << first.err;
}

class LauncherSignal : public ::testing::TestWithParam<int> {};

TEST_P(LauncherSignal, ReachesEveryRank) {
  const int sig = GetParam();
  Cli cli({"launch", "--nproc-per-node", "3", "--", kProbe, "wait-signal"});
  ASSERT_TRUE(cli.wait_for([](const std::string& out) { return count_of(out, "ready") == 3; },
                           30))
      << "the ranks never became ready";
  cli.signal(sig);
  const Result r = cli.finish();
  EXPECT_EQ(r.code, 128 + sig) << r.err;
  for (int k = 0; k < 3; ++k) {
    const std::string got = "[rank " + std::to_string(k) + "] rank " + std::to_string(k) +
                            " got signal " + std::to_string(sig) + "\n";
    // Printed only on the signal: a rank that waited for its own 30 s
    // timeout prints "timed out" instead, however fast or slow the machine.
    EXPECT_TRUE(contains(r.out, got)) << r.out << r.err;
  }
}

INSTANTIATE_TEST_SUITE_P(IntAndTerm, LauncherSignal, ::testing::Values(SIGINT, SIGTERM));

// A hangup (the terminal or SSH session closed) stops the job as SIGTERM
// does: the ranks get SIGTERM (save and stop), the launcher exits 129. It
// often arrives twice (kernel and shell), which must not escalate to SIGKILL.
TEST(Launcher, AHangupStopsTheRanksAsSigtermDoes) {
  Cli cli({"launch", "--nproc-per-node", "2", "--", kProbe, "wait-signal"});
  ASSERT_TRUE(cli.wait_for([](const std::string& out) { return count_of(out, "ready") == 2; },
                           30))
      << "the ranks never became ready";
  cli.signal(SIGHUP);
  cli.signal(SIGHUP);
  const Result r = cli.finish();
  EXPECT_EQ(r.code, 128 + SIGHUP) << r.err;
  for (int k = 0; k < 2; ++k) {
    const std::string got = "[rank " + std::to_string(k) + "] rank " + std::to_string(k) +
                            " got signal " + std::to_string(SIGTERM) + "\n";
    EXPECT_TRUE(contains(r.out, got)) << r.out << r.err;
  }
  EXPECT_TRUE(contains(r.err, "got SIGHUP")) << r.err;
  EXPECT_FALSE(contains(r.err, "SIGKILL")) << r.err;
}

// Under nohup (SIGHUP ignored when the launcher starts) a hangup changes
// nothing: the job goes on until something else stops it.
TEST(Launcher, AHangupIgnoredAtStartStaysIgnored) {
  struct sigaction ignore {}, old {};
  ignore.sa_handler = SIG_IGN;
  ::sigaction(SIGHUP, &ignore, &old);
  Cli cli({"launch", "--nproc-per-node", "2", "--", kProbe, "wait-signal"});
  ::sigaction(SIGHUP, &old, nullptr);
  ASSERT_TRUE(cli.wait_for([](const std::string& out) { return count_of(out, "ready") == 2; },
                           30))
      << "the ranks never became ready";
  cli.signal(SIGHUP);
  EXPECT_FALSE(cli.wait_for([](const std::string& out) { return contains(out, "got signal"); }, 1.0))
      << "a hangup under nohup stopped the ranks";
  cli.signal(SIGTERM);
  const Result r = cli.finish();
  EXPECT_EQ(r.code, 128 + SIGTERM) << r.err;
  EXPECT_TRUE(contains(r.out, "got signal " + std::to_string(SIGTERM))) << r.out << r.err;
}

// State of /proc/PID/stat, or 0 when the process is gone.
char process_state(int pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text;
  std::getline(stat, text);
  const size_t paren = text.rfind(')');
  return paren == std::string::npos || paren + 2 >= text.size() ? 0 : text[paren + 2];
}

// Waits for `cli`'s two wait-signal ranks, SIGKILLs the launcher, and
// expects both ranks gone (or zombies) within 30 s.
void expect_ranks_die_with_a_killed_launcher(Cli& cli) {
  std::string out;
  ASSERT_TRUE(cli.wait_for(
      [&](const std::string& o) {
        out = o;
        return count_of(o, "ready pid") == 2;
      },
      30));
  std::vector<int> pids;
  for (const auto& line : lines_of(out)) {
    const size_t at = line.find("ready pid ");
    if (at != std::string::npos) pids.push_back(std::stoi(line.substr(at + 10)));
  }
  ASSERT_EQ(pids.size(), 2u);
  cli.signal(SIGKILL);
  cli.finish();
  for (int pid : pids) {
    const auto deadline = Clock::now() + std::chrono::seconds(30);
    char state = process_state(pid);
    while (state != 0 && state != 'Z' && Clock::now() < deadline) {
      ::usleep(20 * 1000);
      state = process_state(pid);
    }
    EXPECT_TRUE(state == 0 || state == 'Z') << "rank pid " << pid << " outlived the launcher";
  }
}

TEST(Launcher, RanksDieWithAKilledLauncher) {
  Cli cli({"launch", "--nproc-per-node", "2", "--", kProbe, "wait-signal"});
  expect_ranks_die_with_a_killed_launcher(cli);
}

// ---- ranks forked by the fork server (tests/dist/fork_launcher.cpp) ---------------

// fork_launcher NPROC MAX_RESTARTS MODE ARGS...
Cli forked(const std::vector<std::string>& args) { return Cli(args, {}, FORK_LAUNCHER_PATH); }

TEST(ForkServer, RanksGetTheirVariablesAndTheLauncherAsParent) {
  Cli cli = forked({"2", "0", "print-env"});
  const pid_t launcher = cli.pid();
  const Result r = cli.finish();
  ASSERT_EQ(r.code, 0) << r.err;
  for (int k = 0; k < 2; ++k) {
    const std::string p = "[rank " + std::to_string(k) + "] ";
    EXPECT_TRUE(contains(r.out, p + "RANK=" + std::to_string(k) + "\n")) << r.out;
    EXPECT_TRUE(contains(r.out, p + "WORLD_SIZE=2\n")) << r.out;
    EXPECT_TRUE(contains(r.out, p + "SHARDTRAIN_RESTART_COUNT=0\n")) << r.out;
  }
  // Re-parented from the helper's intermediate process to the launcher,
  // which waits for them as for ranks it exec'ed.
  EXPECT_EQ(count_of(r.out, "PARENT=" + std::to_string(launcher) + "\n"), 2) << r.out;
}

TEST(ForkServer, RanksHoldNoDescriptorAnExecWouldHaveClosed) {
  // fork_launcher holds /dev/zero open, close-on-exec, while it launches.
  const Result r = forked({"2", "0", "print-fds"}).finish();
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(count_of(r.out, "] fds listed\n"), 2) << r.out;
  EXPECT_FALSE(contains(r.out, "/dev/zero")) << r.out;
}

TEST(ForkServer, OneFailingRankStopsTheOthers) {
  Cli cli = forked({"3", "0", "fail-rank", "1", "3"});
  const Result r = cli.finish();
  EXPECT_EQ(r.code, 3) << r.err;
  EXPECT_TRUE(contains(r.err, "rank 1 failed with exit code 3")) << r.err;
  EXPECT_TRUE(contains(r.err, "[rank 1] rank 1 failing")) << r.err;
  EXPECT_LT(r.seconds, 30) << "the sleeping ranks were not stopped";
}

TEST(ForkServer, ASignalReachesEveryRank) {
  Cli cli = forked({"2", "0", "wait-signal"});
  ASSERT_TRUE(cli.wait_for([](const std::string& out) { return count_of(out, "ready") == 2; },
                           30))
      << "the ranks never became ready";
  cli.signal(SIGTERM);
  const Result r = cli.finish();
  EXPECT_EQ(r.code, 128 + SIGTERM) << r.err;
  for (int k = 0; k < 2; ++k) {
    EXPECT_TRUE(contains(r.out, "[rank " + std::to_string(k) + "] rank " + std::to_string(k) +
                                    " got signal " + std::to_string(SIGTERM) + "\n"))
        << r.out << r.err;
  }
}

TEST(ForkServer, ARestartForksTheRanksAgain) {
  Cli cli = forked({"2", "2", "fail-until-restart", "2"});
  const Result r = cli.finish();
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(count_of(r.out, "restart count 2\n"), 2) << r.out;
  EXPECT_TRUE(contains(r.err, "restarting all 2 ranks (restart 2 of 2)")) << r.err;
}

TEST(ForkServer, ARankKilledBySignalGives128PlusSignal) {
  Cli cli = forked({"2", "0", "kill-self", "9"});
  const Result r = cli.finish();
  EXPECT_EQ(r.code, 128 + 9) << r.err;
}

TEST(ForkServer, RanksDieWithAKilledLauncher) {
  Cli cli = forked({"2", "0", "wait-signal"});
  expect_ranks_die_with_a_killed_launcher(cli);
}

TEST(Launcher, MissingProgramExits127) {
  const Result r = run({"launch", "--nproc-per-node", "2", "--", "/nonexistent/shardtrain-xyz"});
  EXPECT_EQ(r.code, 127) << r.err;
  EXPECT_TRUE(contains(r.err, "cannot run '/nonexistent/shardtrain-xyz'")) << r.err;
  EXPECT_TRUE(contains(r.err, "program not found")) << r.err;
  const Result path = run({"launch", "--", "shardtrain-no-such-program-xyz"});
  EXPECT_EQ(path.code, 127) << path.err;
}

TEST(Launcher, BadFlagsExit2WithAMessage) {
  struct Case {
    std::vector<std::string> args;
    const char* expected;
  };
  const std::vector<Case> cases = {
      {{"launch", "--nproc-per-node", "zero", "--", kProbe}, "--nproc-per-node"},
      {{"launch", "--nproc-per-node=0", "--", kProbe}, "'0'"},
      {{"launch", "--nproc-per-node"}, "needs a value"},
      {{"launch", "--bogus", "--", kProbe}, "unknown option '--bogus'"},
      {{"launch", "--nproc-per-node", "2"}, "no program"},
      {{"launch", "--nnodes", "2", "--master-addr", "h", "--", kProbe}, "--master-port"},
      {{"launch", "--nnodes", "2", "--node-rank", "2", "--master-port", "5", "--", kProbe},
       "--node-rank"},
      {{"launch", "--master-port", "70000", "--", kProbe}, "--master-port"},
      {{"launch", "--max-restarts", "-1", "--", kProbe}, "--max-restarts"},
      // `shardtrain train` takes the same flags with the same checks.
      {{"train", "--nnodes", "2", "--master-addr", "h"}, "--master-port"},
      {{"train", "--nnodes", "2", "--node-rank", "2", "--master-port", "5"}, "--node-rank"},
      {{"train", "--max-restarts", "-1"}, "--max-restarts"},
      {{"train", "--master_port=0"}, "--master-port"},
      {{"train", "--bogus"}, "unexpected argument '--bogus'"},
  };
  for (const auto& c : cases) {
    const Result r = run(c.args);
    EXPECT_EQ(r.code, 2) << c.expected << "\n" << r.err;
    EXPECT_TRUE(contains(r.err, c.expected)) << r.err;
  }
}

TEST(Launcher, HelpAndAuto) {
  const Result help = run({"launch", "--help"});
  EXPECT_EQ(help.code, 0);
  EXPECT_TRUE(contains(help.out, "usage: shardtrain launch")) << help.out;
  const Result a = run({"launch", "--nproc-per-node", "auto", kProbe, "lines", "0"});
  ASSERT_EQ(a.code, 0) << a.err;
  const long cpus = ::sysconf(_SC_NPROCESSORS_ONLN);
  EXPECT_EQ(count_of(a.out, "partial"), cpus) << a.out;
}

}  // namespace

// ---- the progress bar's protocol and text ------------------------------------------

namespace {

using shardtrain::dist::ProgressReport;

TEST(Progress, LinesRoundTripAndOtherLinesAreNotProgress) {
  ProgressReport r;
  r.step = 17;
  r.max_steps = 60;
  r.has_loss = true;
  r.loss = 2.5;
  r.tokens_per_s = 812.5;
  r.eta_s = 41;
  ProgressReport got;
  ASSERT_TRUE(shardtrain::dist::parse_progress_line(shardtrain::dist::format_progress_line(r), &got));
  EXPECT_EQ(got.step, 17);
  EXPECT_EQ(got.max_steps, 60);
  EXPECT_TRUE(got.has_loss);
  EXPECT_DOUBLE_EQ(got.loss, 2.5);
  EXPECT_DOUBLE_EQ(got.tokens_per_s, 812.5);
  EXPECT_DOUBLE_EQ(got.eta_s, 41);
  ProgressReport step_only;
  step_only.step = 3;
  step_only.max_steps = 9;
  ASSERT_TRUE(shardtrain::dist::parse_progress_line(shardtrain::dist::format_progress_line(step_only), &got));
  EXPECT_FALSE(got.has_loss);
  for (const char* line : {"step 17/60 | loss 2.5", "@shardtrain-progress step=x max=3",
                           "@shardtrain-progress max=3", "", "@shardtrain-progress step=1 max=2 junk"}) {
    EXPECT_FALSE(shardtrain::dist::parse_progress_line(line, &got)) << line;
  }
}

TEST(Progress, BarShowsTheSlowestRankAndFitsTheTerminal) {
  shardtrain::dist::ProgressBar bar(-1);  // not a terminal: draws nothing
  EXPECT_FALSE(bar.active());
  ProgressReport lead;
  lead.step = 30;
  lead.max_steps = 60;
  lead.has_loss = true;
  lead.loss = 1.25;
  lead.tokens_per_s = 900;
  lead.eta_s = 75;
  bar.update(0, lead);
  ProgressReport behind;
  behind.step = 15;
  behind.max_steps = 60;
  bar.update(1, behind);
  EXPECT_EQ(bar.render(200), "[######..................] 15/60  25% | loss 1.2500 | 900 tok/s | eta 1m15s | "
                             "slowest: rank 1 at 15");
  EXPECT_EQ(bar.render(20).size(), 19u);
  EXPECT_EQ(shardtrain::dist::format_duration(3725), "1h02m");
  EXPECT_EQ(shardtrain::dist::format_duration(-1), "?");
}

}  // namespace
