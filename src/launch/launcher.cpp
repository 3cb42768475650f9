#include "shardtrain/launch/launcher.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <deque>
#include <set>
#include <string>
#include <vector>

#include "comm/kv_store.h"
#include "launch/progress.h"
#include "shardtrain/core/error.h"

extern char** environ;

namespace shardtrain::dist {
namespace {

using Clock = std::chrono::steady_clock;

// Longest line kept in memory; a rank that prints more without a newline has
// it written out in pieces rather than growing the buffer without bound.
constexpr size_t kMaxLineBytes = 64 * 1024;
// How long output of exited ranks is still read when something (a grandchild
// that inherited the pipe) keeps it open.
constexpr double kDrainSeconds = 1.0;
// How often a launcher of a multi-node job looks for other nodes' failures.
constexpr int kWatchMs = 250;

// Variables the launcher sets, plus other launchers' rank variables: those
// describe the launcher's own slot, so a rank must not see them.
const std::set<std::string> kReplacedVars = {
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
    "MASTER_PORT", "SHARDTRAIN_RESTART_COUNT", "SHARDTRAIN_JOB_TOKEN",
    "SHARDTRAIN_STORE", "SHARDTRAIN_PROGRESS_TO_LAUNCHER", "SLURM_PROCID", "SLURM_LOCALID",
    "SLURM_NODEID", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "PMI_RANK", "PMI_SIZE",
    "MPI_LOCALRANKID", "MPI_LOCALNRANKS"};

// ---- signals: a self-pipe the handlers write the signal number into --------

int g_signal_pipe[2] = {-1, -1};
// SIGINT, SIGTERM or SIGHUP seen by take_stop_signal() (outside a running group).
int g_stop_signal = 0;

void on_signal(int sig) {
  const int saved = errno;
  const unsigned char byte = static_cast<unsigned char>(sig);
  // A full pipe only drops a wake-up that is already pending.
  ssize_t ignored = ::write(g_signal_pipe[1], &byte, 1);
  (void)ignored;
  errno = saved;
}

// Installs the handlers for the duration of launch() and restores the old ones.
// SIGHUP (the terminal closed, the SSH session dropped) stops the job as
// SIGTERM does, unless it was ignored when we started (nohup): then it stays
// ignored and the job goes on.
class SignalGuard {
 public:
  SignalGuard() {
    ST_ASSERT(g_signal_pipe[0] < 0, "launch() is already running in this process");
    ST_CHECK(::pipe2(g_signal_pipe, O_CLOEXEC | O_NONBLOCK) == 0, Error,
             "cannot create a pipe: ", std::strerror(errno));
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
  ~SignalGuard() {
    for (int i = 0; i < kCount; ++i) ::sigaction(kHandled[i], &old_[i], nullptr);
    ::sigaction(SIGPIPE, &old_[kCount], nullptr);
    ::close(g_signal_pipe[0]);
    ::close(g_signal_pipe[1]);
    g_signal_pipe[0] = g_signal_pipe[1] = -1;
  }
  SignalGuard(const SignalGuard&) = delete;
  SignalGuard& operator=(const SignalGuard&) = delete;

  static constexpr int kCount = 4;
  static constexpr int kHandled[kCount] = {SIGINT, SIGTERM, SIGHUP, SIGCHLD};

 private:
  struct sigaction old_[kCount + 1];
};

constexpr int SignalGuard::kHandled[SignalGuard::kCount];

// The signals that stop the job.
bool is_stop_signal(int sig) { return sig == SIGINT || sig == SIGTERM || sig == SIGHUP; }

// Empties the self-pipe; returns SIGINT, SIGTERM or SIGHUP when one of them
// arrived (the first of them), else 0. SIGCHLD only wakes the caller.
int take_stop_signal() {
  int stop = 0;
  unsigned char sigs[64];
  ssize_t n;
  while ((n = ::read(g_signal_pipe[0], sigs, sizeof sigs)) > 0) {
    for (ssize_t i = 0; i < n; ++i) {
      if (stop == 0 && is_stop_signal(sigs[i])) stop = sigs[i];
    }
  }
  if (stop != 0 && g_stop_signal == 0) g_stop_signal = stop;
  return stop;
}

// ---- output ------------------------------------------------------------------

// The one progress bar on our terminal (inactive when stdout is not one):
// every line we print goes above it.
ProgressBar& progress_bar() {
  static ProgressBar bar(STDOUT_FILENO);
  return bar;
}

void say(const std::string& text) {
  progress_bar().print(STDERR_FILENO, "shardtrain launch: " + text + "\n");
}

std::string describe_code(int code) {
  if (code > 128 && code < 128 + 65) {
    const char* name = ::strsignal(code - 128);
    return ::shardtrain::detail::str_cat("exit code ", code, ", killed by signal ", code - 128,
                                         name ? std::string(" (") + name + ")" : std::string());
  }
  if (code == 127) return "exit code 127, program not found";
  if (code == 126) return "exit code 126, program not executable";
  return ::shardtrain::detail::str_cat("exit code ", code);
}

// ---- the launchers' rendezvous ----------------------------------------------------
//
// Node 0's launcher hosts the job's store for the whole job, so it outlives
// every round of ranks (rank 0's death no longer takes the store with it).
// Each round k, every launcher announces itself under launch/k/ and waits for
// all nodes; the first failure anywhere is written to launch/k/failed, which
// every launcher watches and answers by stopping its ranks; node 0 then
// writes launch/k/next ("restart" or "stop") and the others follow it.

using comm::detail::KvStore;

std::string launch_key(int round, const std::string& what) {
  return ::shardtrain::detail::str_cat("shardtrain/launch/", round, "/", what);
}

struct Failure {
  int code = 1;
  std::string what;  // "node 1: rank 3 failed with exit code 1"
};

class Rendezvous {
 public:
  Rendezvous(const LaunchOptions& o, const std::string& master, const std::string& token)
      : options_(o), master_(master), timeout_(comm::detail::timeout_from_env(std::chrono::minutes(10))) {
    if (o.node_rank() == 0) {
      server_ = std::make_unique<comm::detail::StoreServer>(
          master, o.master_port(), token, [](const std::string& line) { say(line); });
      kv_ = server_.get();
      port_ = server_->port();
      // The ranks' own MASTER_PORT is another port: a program that hosts a
      // store of its own there (PyTorch's env://) must not meet ours.
      app_port_ = find_free_port();
      kv_->set("shardtrain/launch/master_port", std::to_string(app_port_));
    } else {
      say(::shardtrain::detail::str_cat("node ", o.node_rank(), ": connecting to node 0 at ",
                                        master, ":", o.master_port()));
      client_ = comm::detail::connect_store(master, o.master_port(), token, timeout_);
      kv_ = client_.get();
      port_ = o.master_port();
    }
  }

  /// "address:port" of the job's store, for the ranks (SHARDTRAIN_STORE).
  std::string store_address() const { return master_ + ":" + std::to_string(port_); }
  /// MASTER_PORT for the ranks, the same on every node.
  int app_port() const { return app_port_; }
  KvStore& store() { return *kv_; }

  /// The round this launcher starts in: node 0 opens round 0; a node that
  /// (re)starts later joins the newest round that is still gathering nodes.
  /// Returns -1 when a stop signal arrived while waiting.
  int first_round() {
    if (options_.node_rank() == 0) return 0;
    auto round = wait_for("shardtrain/launch/round", "node 0 to open the job");
    if (!round) return -1;
    app_port_ = std::stoi(kv_->try_get("shardtrain/launch/master_port").value_or("0"));
    int k = std::stoi(*round);
    for (;;) {
      const auto joined = kv_->try_get(launch_key(k, "joined"));
      const bool full = joined && std::stoi(*joined) >= options_.nnodes();
      if (!full && !kv_->try_get(launch_key(k, "failed"))) return k;
      // That round runs (or ends) without us: wait for the next one.
      if (!wait_for(launch_key(k + 1, "open"), "the job's current round to end")) return -1;
      ++k;
    }
  }

  /// Every node announces itself for `round` and waits for the others,
  /// saying every ~10 s which nodes are missing. False on a stop signal;
  /// TimeoutError when a node does not come within SHARDTRAIN_TIMEOUT_S.
  bool join(int round) {
    if (options_.node_rank() == 0) {
      kv_->set("shardtrain/launch/round", std::to_string(round));
      kv_->set(launch_key(round, "open"), "1");
    }
    kv_->add(launch_key(round, "joined"), 1);
    kv_->set(launch_key(round, "node/" + std::to_string(options_.node_rank())), "1");
    if (options_.nnodes() == 1) return true;
    std::vector<std::string> keys;
    for (int n = 0; n < options_.nnodes(); ++n) keys.push_back(launch_key(round, "node/" + std::to_string(n)));
    const auto start = Clock::now();
    auto next_note = start + std::chrono::seconds(10);
    for (;;) {
      if (kv_->wait(keys, std::chrono::milliseconds(500))) return true;
      if (take_stop_signal() != 0) return false;
      const auto now = Clock::now();
      if (now < next_note && now < start + timeout_) continue;
      std::string missing;
      for (int n = 0; n < options_.nnodes(); ++n) {
        if (!kv_->try_get(keys[n])) missing += (missing.empty() ? "" : ", ") + std::to_string(n);
      }
      const long waited = static_cast<long>(
          std::chrono::duration_cast<std::chrono::seconds>(now - start).count());
      ST_CHECK(now < start + timeout_, TimeoutError, "node ", missing, " did not join round ",
               round, " of the job within ", waited,
               " s. Hint: start its launcher with the same --master-addr, --master-port and "
               "SHARDTRAIN_JOB_TOKEN; SHARDTRAIN_TIMEOUT_S sets how long to wait");
      say(::shardtrain::detail::str_cat("round ", round, ": waiting for node ", missing, " of ",
                                        options_.nnodes(), " (", waited, " s)"));
      next_note = now + std::chrono::seconds(10);
    }
  }

  /// Records this node's failure in `round` unless another was first.
  void fail(int round, const Failure& f) {
    try {
      if (kv_->add(launch_key(round, "failures"), 1) == 1) {
        kv_->set(launch_key(round, "failed"), std::to_string(f.code) + " " + f.what);
      }
    } catch (const std::exception& e) {
      say(::shardtrain::detail::str_cat("cannot tell the other nodes: ", e.what()));
    }
  }

  /// The first failure of `round` on any node, if there was one. Losing the
  /// store (node 0's launcher is gone) is a failure that cannot restart; if
  /// a failure was read before, it says that node 0 ended the job on it.
  std::optional<Failure> failed(int round) {
    if (options_.nnodes() == 1) return std::nullopt;
    try {
      const auto value = kv_->try_get(launch_key(round, "failed"));
      if (!value) return std::nullopt;
      const size_t space = value->find(' ');
      known_ = Failure{std::atoi(value->c_str()), value->substr(space + 1)};
      return known_;
    } catch (const std::exception& e) {
      lost_store_ = true;
      if (known_) return Failure{known_->code, gone_after(known_->what)};
      return Failure{1, ::shardtrain::detail::str_cat("lost the job's store on node 0 (",
                                                      e.what(), ")")};
    }
  }

  /// After a failed round: node 0 decides whether the job restarts and tells
  /// the others, who follow. False: stop. On a stop node 0 gives its reason
  /// (`why`), which the others print. The store leaves with node 0's
  /// launcher, so on a stop node 0 first waits until the other nodes have
  /// read the decision (and so the failure, whose exit code they end with).
  bool restart_after(int round, bool node0_wants, const std::string& why = {}) {
    if (lost_store_) return false;
    if (options_.node_rank() == 0) {
      kv_->set(launch_key(round, "next"), node0_wants ? "restart" : "stop " + why);
      if (!node0_wants) wait_until_stopped(round);
      return node0_wants;
    }
    try {
      // The failure first: should the store go before the decision comes,
      // this node still knows why the job ended.
      failed(round);
      const auto next = wait_for(launch_key(round, "next"), "node 0 to decide on a restart");
      const bool restart = next && *next == "restart";
      if (!restart) {
        if (next && next->size() > 5) say("node 0 stopped the job: " + next->substr(5));
        kv_->set(launch_key(round, "stopped/" + std::to_string(options_.node_rank())), "1");
      }
      return restart;
    } catch (const std::exception& e) {
      say(known_ ? gone_after(known_->what)
                 : ::shardtrain::detail::str_cat("lost the job's store on node 0: ", e.what()));
      return false;
    }
  }

  /// Node 0, after deciding to stop: waits until every other node has read
  /// that, for as long as a node takes to stop its ranks and a little more,
  /// but not for a node whose ranks all went silent (a lost host never
  /// answers, and its ranks' heartbeats stop).
  void wait_until_stopped(int round) {
    if (options_.nnodes() == 1) return;
    const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                             std::chrono::duration<double>(options_.stop_grace_s() + kDrainSeconds + 10.0));
    try {
      for (;;) {
        std::vector<std::string> keys;
        for (int n = 1; n < options_.nnodes(); ++n) {
          if (!node_silent(round, n)) keys.push_back(launch_key(round, "stopped/" + std::to_string(n)));
        }
        if (keys.empty() || kv_->wait(keys, std::chrono::milliseconds(500))) return;
        if (take_stop_signal() != 0 || Clock::now() >= deadline) return;
      }
    } catch (const std::exception&) {
    }
  }

  /// Whether the ranks of `node` in `round` beat and all went stale (ranks
  /// that never beat, programs without a communicator, say nothing).
  bool node_silent(int round, int node) {
    const int per = options_.nproc_per_node();
    bool beat = false;
    for (int r = node * per; r < (node + 1) * per; ++r) {
      const auto age = kv_->age_ms(comm::detail::heartbeat_key(round, r));
      if (age && *age < comm::detail::kStaleHeartbeatMs) return false;
      beat = beat || age.has_value();
    }
    return beat;
  }

  /// This node's ranks all succeeded in `round`. Node 0 then waits for the
  /// other nodes to finish too, because they need its store until they do;
  /// returns a failure reported meanwhile, if any.
  std::optional<Failure> finish(int round) {
    if (options_.nnodes() == 1) return std::nullopt;
    try {
      kv_->set(launch_key(round, "done/" + std::to_string(options_.node_rank())), "1");
    } catch (const std::exception&) {
      return std::nullopt;  // node 0 is gone; our own ranks are done
    }
    if (options_.node_rank() != 0) return std::nullopt;
    std::vector<std::string> keys;
    for (int n = 0; n < options_.nnodes(); ++n) keys.push_back(launch_key(round, "done/" + std::to_string(n)));
    const auto deadline = Clock::now() + timeout_;
    while (!kv_->wait(keys, std::chrono::milliseconds(500))) {
      if (auto f = failed(round)) return f;
      if (take_stop_signal() != 0 || Clock::now() >= deadline) break;
    }
    return std::nullopt;
  }

  /// "rank 3 (no heartbeat for 12 s ...)" for ranks of `round` whose heartbeat
  /// went stale, or empty.
  std::string suspects(int round, int world_size) {
    std::string found;
    try {
      for (int r = 0; r < world_size; ++r) {
        const auto age = kv_->age_ms(comm::detail::heartbeat_key(round, r));
        if (!age || *age < comm::detail::kStaleHeartbeatMs) continue;
        found += ::shardtrain::detail::str_cat(found.empty() ? "" : ", ", "rank ", r,
                                               " (no heartbeat for ", *age / 1000,
                                               " s: stopped, hung or dead)");
      }
    } catch (const std::exception&) {
    }
    return found;
  }

 private:
  // Waits for `key`, in slices so a stop signal is noticed; nullopt on a
  // signal, TimeoutError after SHARDTRAIN_TIMEOUT_S.
  std::optional<std::string> wait_for(const std::string& key, const char* what) {
    const auto deadline = Clock::now() + timeout_;
    for (;;) {
      if (kv_->wait({key}, std::chrono::milliseconds(500))) return kv_->try_get(key);
      if (take_stop_signal() != 0) return std::nullopt;
      ST_CHECK(Clock::now() < deadline, TimeoutError, "node ", options_.node_rank(),
               " waited ", std::chrono::duration_cast<std::chrono::seconds>(timeout_).count(),
               " s for ", what, " (", kv_->where(),
               "). Hint: check node 0's launcher; SHARDTRAIN_TIMEOUT_S sets how long to wait");
    }
  }

  const LaunchOptions& options_;
  const std::string master_;
  std::chrono::milliseconds timeout_;
  int app_port_ = 0;
  std::unique_ptr<comm::detail::StoreServer> server_;
  std::unique_ptr<KvStore> client_;
  KvStore* kv_ = nullptr;
  int port_ = 0;
  bool lost_store_ = false;
  std::optional<Failure> known_;  // the last failure read from the store

  // What to say when node 0's store went away after `what` had stopped the
  // job: node 0 ended it (node 0 closes the store only when it stops).
  static std::string gone_after(const std::string& what) {
    return "node 0 ended the job (its store closed) after: " + what;
  }
};

// One of a rank's output pipes and the line it is in the middle of.
struct Stream {
  int fd = -1;
  int target = STDOUT_FILENO;
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

class Group {
 public:
  Group(const LaunchOptions& options, Rendezvous& rdzv, const std::string& token, int restart)
      : options_(options), rdzv_(rdzv), token_(token), restart_(restart) {}

  // Whatever happens (an exception included), no rank outlives the group.
  ~Group() {
    for (auto& r : ranks_) {
      if (r.running) {
        ::kill(-r.pid, SIGKILL);
        ::waitpid(r.pid, nullptr, 0);
      }
      close_stream(r.out);
      close_stream(r.err);
    }
  }
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;

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
  void start_all();
  void start(Rank& r, int local_rank);
  std::vector<std::string> child_env(int local_rank) const;
  void read_stream(Rank& r, Stream& s);
  void emit(Rank& r, Stream& s, const std::string& line);
  void close_stream(Stream& s);
  void reap();
  void stop_all(int sig);
  void report_failure() const;

  // Sends `sig` to every rank and starts the grace period before SIGKILL.
  void begin_stopping(int sig = SIGTERM);
  void watch_other_nodes();

  const LaunchOptions& options_;
  Rendezvous& rdzv_;
  const std::string& token_;
  const int restart_;
  std::vector<Rank> ranks_;
  std::optional<Failure> remote_;
  std::string suspects_;     // ranks whose heartbeat had stopped when one failed
  int failed_ = -1;          // index into ranks_
  bool skipped_ = false;     // a rank exited kSkippedExitCode
  int signal_ = 0;           // SIGINT / SIGTERM / SIGHUP received by the launcher
  bool stopping_ = false;
  bool killed_ = false;
  Clock::time_point kill_deadline_;
};

std::vector<std::string> Group::child_env(int local_rank) const {
  std::vector<std::string> env;
  for (char** e = environ; e && *e; ++e) {
    const char* eq = std::strchr(*e, '=');
    if (eq && kReplacedVars.count(std::string(*e, static_cast<size_t>(eq - *e)))) continue;
    env.emplace_back(*e);
  }
  const int rank = options_.node_rank() * options_.nproc_per_node() + local_rank;
  auto set = [&](const char* key, const std::string& value) {
    env.push_back(std::string(key) + "=" + value);
  };
  set("RANK", std::to_string(rank));
  set("LOCAL_RANK", std::to_string(local_rank));
  set("WORLD_SIZE", std::to_string(options_.nnodes() * options_.nproc_per_node()));
  set("LOCAL_WORLD_SIZE", std::to_string(options_.nproc_per_node()));
  set("GROUP_RANK", std::to_string(options_.node_rank()));
  set("MASTER_ADDR", options_.master_addr().empty() ? "127.0.0.1" : options_.master_addr());
  set("MASTER_PORT", std::to_string(rdzv_.app_port()));
  set("SHARDTRAIN_RESTART_COUNT", std::to_string(restart_));
  set("SHARDTRAIN_JOB_TOKEN", token_);
  set("SHARDTRAIN_STORE", rdzv_.store_address());
  if (progress_bar().active()) set(kProgressEnv, "1");
  return env;
}

void Group::start(Rank& r, int local_rank) {
  // Everything the child needs is built before fork(): between fork and exec
  // only async-signal-safe calls are allowed (the caller may have threads).
  std::vector<std::string> env_strings = child_env(local_rank);
  std::vector<char*> envp;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<std::string> args = options_.command();
  std::vector<char*> argv;
  for (auto& s : args) argv.push_back(s.data());
  argv.push_back(nullptr);
  const std::string exec_error = "shardtrain launch: cannot run '" + args[0] + "': ";

  int out[2], err[2];
  ST_CHECK(::pipe2(out, O_CLOEXEC) == 0, Error, "cannot create a pipe: ", std::strerror(errno));
  if (::pipe2(err, O_CLOEXEC) != 0) {
    const int e = errno;
    ::close(out[0]);
    ::close(out[1]);
    ST_CHECK(false, Error, "cannot create a pipe: ", std::strerror(e));
  }
  const int devnull = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  const pid_t parent = ::getpid();

  // Blocked across fork so that our handlers never run in the child.
  sigset_t all, old;
  sigfillset(&all);
  ::sigprocmask(SIG_BLOCK, &all, &old);
  const pid_t pid = ::fork();
  if (pid == 0) {
    // Own process group: a terminal's Ctrl-C reaches the launcher only, which
    // forwards it, and stop_all() can signal a rank's own children too.
    ::setpgid(0, 0);
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(128 + SIGKILL);  // the launcher died before prctl
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    for (int sig : {SIGINT, SIGTERM, SIGCHLD, SIGPIPE}) ::sigaction(sig, &dfl, nullptr);
    // SIGHUP too, unless it is ignored (nohup), which the rank inherits.
    struct sigaction hup {};
    if (::sigaction(SIGHUP, nullptr, &hup) == 0 && hup.sa_handler == on_signal) {
      ::sigaction(SIGHUP, &dfl, nullptr);
    }
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    // stdin is /dev/null: a rank in a background process group that read the
    // terminal would be stopped by SIGTTIN.
    if (devnull >= 0) ::dup2(devnull, STDIN_FILENO);
    ::dup2(out[1], STDOUT_FILENO);
    ::dup2(err[1], STDERR_FILENO);
    ::execvpe(argv[0], argv.data(), envp.data());
    const int e = errno;
    ssize_t ignored = ::write(STDERR_FILENO, exec_error.data(), exec_error.size());
    const char* why = ::strerror(e);
    ignored = ::write(STDERR_FILENO, why, std::strlen(why));
    ignored = ::write(STDERR_FILENO, "\n", 1);
    (void)ignored;
    ::_exit(e == ENOENT ? 127 : 126);  // the shell's codes for "not found" / "cannot run"
  }
  const int fork_errno = errno;
  ::sigprocmask(SIG_SETMASK, &old, nullptr);
  if (devnull >= 0) ::close(devnull);
  ::close(out[1]);
  ::close(err[1]);
  if (pid < 0) {
    ::close(out[0]);
    ::close(err[0]);
    ST_CHECK(false, Error, "cannot start rank ", r.rank, ": fork failed: ",
             std::strerror(fork_errno), "; check the process limit (ulimit -u)");
  }
  ::setpgid(pid, pid);  // also here, so a signal sent right away finds the group
  ::fcntl(out[0], F_SETFL, O_NONBLOCK);
  ::fcntl(err[0], F_SETFL, O_NONBLOCK);
  r.pid = pid;
  r.running = true;
  r.out.fd = out[0];
  r.out.target = STDOUT_FILENO;
  r.err.fd = err[0];
  r.err.target = STDERR_FILENO;
}

void Group::start_all() {
  ranks_.resize(static_cast<size_t>(options_.nproc_per_node()));
  for (int i = 0; i < options_.nproc_per_node(); ++i) {
    ranks_[i].rank = options_.node_rank() * options_.nproc_per_node() + i;
    start(ranks_[i], i);
  }
}

void Group::emit(Rank& r, Stream& s, const std::string& line) {
  ProgressReport report;
  if (s.target == STDOUT_FILENO && progress_bar().active() && parse_progress_line(line, &report)) {
    progress_bar().update(r.rank, report);
    return;
  }
  progress_bar().print(s.target, "[rank " + std::to_string(r.rank) + "] " + line + "\n");
  if (options_.tail_lines() <= 0) return;
  r.tail.push_back(line);
  while (r.tail.size() > static_cast<size_t>(options_.tail_lines())) r.tail.pop_front();
}

void Group::close_stream(Stream& s) {
  if (s.fd >= 0) ::close(s.fd);
  s.fd = -1;
}

void Group::read_stream(Rank& r, Stream& s) {
  char buf[16384];
  const ssize_t n = ::read(s.fd, buf, sizeof buf);
  if (n < 0 && (errno == EINTR || errno == EAGAIN)) return;
  if (n <= 0) {  // EOF (or a broken pipe): flush the unterminated last line
    if (!s.partial.empty()) emit(r, s, s.partial);
    s.partial.clear();
    close_stream(s);
    return;
  }
  s.partial.append(buf, static_cast<size_t>(n));
  size_t begin = 0;
  for (size_t nl; (nl = s.partial.find('\n', begin)) != std::string::npos; begin = nl + 1) {
    emit(r, s, s.partial.substr(begin, nl - begin));
  }
  s.partial.erase(0, begin);
  if (s.partial.size() > kMaxLineBytes) {
    emit(r, s, s.partial);
    s.partial.clear();
  }
}

void Group::stop_all(int sig) {
  for (auto& r : ranks_) {
    if (r.running) ::kill(-r.pid, sig);
  }
}

void Group::reap() {
  for (size_t i = 0; i < ranks_.size(); ++i) {
    Rank& r = ranks_[i];
    if (!r.running) continue;
    int status = 0;
    const pid_t got = ::waitpid(r.pid, &status, WNOHANG);
    if (got != r.pid) continue;
    r.running = false;
    r.code = WIFEXITED(status) ? WEXITSTATUS(status)
                               : WIFSIGNALED(status) ? 128 + WTERMSIG(status) : 1;
    // Exits after we began stopping the group are consequences, not causes.
    if (stopping_) continue;
    // A rank that skipped its work ended as cleanly as one that did it: the
    // others go on, and the group reports the skip only if nothing failed.
    if (r.code == kSkippedExitCode) skipped_ = true;
    if (r.code == 0 || r.code == kSkippedExitCode) continue;
    failed_ = static_cast<int>(i);
    // Now, before the others are stopped: a hung rank's heartbeat is the
    // only stale one, and it is why a healthy rank timed out.
    suspects_ = rdzv_.suspects(restart_, options_.nnodes() * options_.nproc_per_node());
    const std::string what = ::shardtrain::detail::str_cat("rank ", r.rank, " failed with ",
                                                           describe_code(r.code));
    int others = 0;
    for (auto& o : ranks_) others += o.running ? 1 : 0;
    say(what + (suspects_.empty() ? "" : "; suspect: " + suspects_) +
        (options_.nnodes() > 1 ? "; stopping the job on every node"
                               : others ? "; stopping the other ranks" : ""));
    rdzv_.fail(restart_, Failure{r.code, ::shardtrain::detail::str_cat("node ", options_.node_rank(),
                                                                       ": ", what)});
    begin_stopping();
  }
}

// Whether `pid` is stopped (SIGSTOP, a debugger): it cannot act on SIGTERM,
// so waiting out the grace period for it would only delay the stop.
bool is_stopped(pid_t pid) {
  FILE* f = std::fopen(("/proc/" + std::to_string(pid) + "/stat").c_str(), "r");
  if (f == nullptr) return false;
  char state = 0;
  // "pid (comm) state ...": the state follows the last ')'.
  char buf[512];
  const size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  if (const char* close = std::strrchr(buf, ')'); close && close[1] == ' ') state = close[2];
  return state == 'T' || state == 't';
}

void Group::begin_stopping(int sig) {
  stopping_ = true;
  kill_deadline_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                      std::chrono::duration<double>(options_.stop_grace_s()));
  stop_all(sig);
  for (auto& r : ranks_) {
    if (r.running && is_stopped(r.pid)) {
      say(::shardtrain::detail::str_cat("rank ", r.rank, " is stopped (SIGSTOP?); sending SIGKILL"));
      ::kill(-r.pid, SIGKILL);
    }
  }
}

// A failure on another node stops this node's ranks too: the job restarts
// (or ends) as a whole.
void Group::watch_other_nodes() {
  if (stopping_ || options_.nnodes() == 1) return;
  auto failure = rdzv_.failed(restart_);
  if (!failure) return;
  say("stopping this node's ranks: " + failure->what);
  remote_ = std::move(failure);
  begin_stopping();
}

int Group::run() {
  start_all();
  bool draining = false;
  Clock::time_point drain_deadline;
  std::vector<pollfd> fds;
  std::vector<std::pair<Rank*, Stream*>> owners;
  for (;;) {
    bool any_running = false, any_open = false;
    for (auto& r : ranks_) {
      any_running = any_running || r.running;
      any_open = any_open || r.out.fd >= 0 || r.err.fd >= 0;
    }
    const auto now = Clock::now();
    if (!any_running) {
      if (!any_open) break;
      if (!draining) {
        draining = true;
        drain_deadline = now + std::chrono::duration_cast<Clock::duration>(
                                   std::chrono::duration<double>(kDrainSeconds));
      } else if (now >= drain_deadline) {
        break;  // a grandchild holds the pipe open; don't wait for it
      }
    }
    if (any_running && stopping_ && !killed_ && now >= kill_deadline_) {
      say(::shardtrain::detail::str_cat("ranks still running ", options_.stop_grace_s(),
                                        " s after SIGTERM; sending SIGKILL"));
      stop_all(SIGKILL);
      killed_ = true;
    }

    // Wait for output, an exited rank or a signal; nothing else wakes us.
    fds.assign(1, pollfd{g_signal_pipe[0], POLLIN, 0});
    owners.assign(1, {nullptr, nullptr});
    for (auto& r : ranks_) {
      for (Stream* s : {&r.out, &r.err}) {
        if (s->fd < 0) continue;
        fds.push_back(pollfd{s->fd, POLLIN, 0});
        owners.emplace_back(&r, s);
      }
    }
    int timeout_ms = -1;
    auto ms_until = [&](Clock::time_point t) {
      const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(t - now).count();
      return static_cast<int>(std::max<long long>(0, std::min<long long>(ms + 1, 60000)));
    };
    if (!any_running) timeout_ms = ms_until(drain_deadline);
    else if (stopping_ && !killed_) timeout_ms = ms_until(kill_deadline_);
    // Other nodes' failures arrive through the store, which does not wake us.
    if (options_.nnodes() > 1 && any_running && !stopping_) timeout_ms = kWatchMs;
    const int ready = ::poll(fds.data(), fds.size(), timeout_ms);
    if (ready < 0 && errno != EINTR) {
      ST_CHECK(false, Error, "poll failed: ", std::strerror(errno));
    }

    // Output first, so a failed rank's last lines are in its tail.
    for (size_t i = 1; ready > 0 && i < fds.size(); ++i) {
      if (fds[i].revents) read_stream(*owners[i].first, *owners[i].second);
    }
    unsigned char sigs[64];
    ssize_t n;
    while ((n = ::read(g_signal_pipe[0], sigs, sizeof sigs)) > 0) {
      for (ssize_t i = 0; i < n; ++i) {
        const int sig = sigs[i];
        if (!is_stop_signal(sig)) continue;  // SIGCHLD: reaped below
        if (signal_ == 0) {
          signal_ = sig;
          // The ranks get SIGTERM for a hangup: every program knows it as
          // "save and stop", and a lost terminal is no reason to lose work.
          const int forward = sig == SIGHUP ? SIGTERM : sig;
          say(sig == SIGHUP ? std::string("got SIGHUP (the terminal or session closed); sending "
                                          "SIGTERM to the ranks so that they save and stop")
                            : ::shardtrain::detail::str_cat("got ", ::strsignal(sig),
                                                            "; forwarding it to the ranks"));
          if (stopping_) {
            stop_all(forward);
          } else {
            begin_stopping(forward);
          }
        } else if (sig != SIGHUP && !killed_) {
          // A second Ctrl-C means "now": don't wait out the grace period. A
          // hangup is often delivered twice (by the kernel and the shell):
          // it never means "now".
          say("got a second signal; sending SIGKILL to the ranks");
          stop_all(SIGKILL);
          killed_ = true;
        }
      }
    }
    reap();
    watch_other_nodes();
  }
  progress_bar().finish();
  if (failed_ >= 0) {
    report_failure();
    return ranks_[failed_].code;
  }
  if (signal_ != 0) return 128 + signal_;
  return skipped_ ? kSkippedExitCode : 0;
}

void Group::report_failure() const {
  const Rank& r = ranks_[failed_];
  std::string text;
  if (r.tail.empty()) {
    text = ::shardtrain::detail::str_cat("rank ", r.rank, " printed nothing before it failed with ",
                                         describe_code(r.code));
  } else {
    text = ::shardtrain::detail::str_cat("last ", r.tail.size(), " line",
                                         r.tail.size() == 1 ? "" : "s", " of rank ", r.rank,
                                         ", which failed with ", describe_code(r.code), ":");
    for (const auto& line : r.tail) text += "\n  [rank " + std::to_string(r.rank) + "] " + line;
  }
  if (!suspects_.empty()) {
    text += ::shardtrain::detail::str_cat("\n  suspect: ", suspects_, "; rank ", r.rank,
                                          "'s failure is probably a consequence");
  }
  say(text);
}

void validate(const LaunchOptions& o) {
  ST_CHECK(o.nproc_per_node() >= 1, ConfigError, "nproc_per_node=", o.nproc_per_node(),
           " must be >= 1");
  ST_CHECK(o.nnodes() >= 1, ConfigError, "nnodes=", o.nnodes(), " must be >= 1");
  ST_CHECK(o.nproc_per_node() <= 1'000'000 / o.nnodes(), ConfigError,
           "nnodes * nproc_per_node is too large (", o.nnodes(), " * ", o.nproc_per_node(), ")");
  ST_CHECK(o.node_rank() >= 0 && o.node_rank() < o.nnodes(), ConfigError, "node_rank=", o.node_rank(),
           " must be in 0..", o.nnodes() - 1, " (nnodes=", o.nnodes(), ")");
  ST_CHECK(o.master_port() >= 0 && o.master_port() <= 65535, ConfigError, "master_port=",
           o.master_port(), " must be 1..65535, or 0 to pick a free port");
  ST_CHECK(o.nnodes() == 1 || o.master_port() != 0, ConfigError, "with nnodes=", o.nnodes(),
           " the master port must be given (every node must use the same one); "
           "pass --master-port, e.g. 29500");
  ST_CHECK(o.nnodes() == 1 || !o.master_addr().empty(), ConfigError, "with nnodes=", o.nnodes(),
           " the master address must be given (the host of node 0); pass --master-addr");
  ST_CHECK(o.max_restarts() >= 0, ConfigError, "max_restarts=", o.max_restarts(), " must be >= 0");
  ST_CHECK(std::isfinite(o.stop_grace_s()) && o.stop_grace_s() >= 0, ConfigError,
           "stop_grace_s=", o.stop_grace_s(), " must be a number of seconds >= 0");
  ST_CHECK(o.tail_lines() >= 0, ConfigError, "tail_lines=", o.tail_lines(), " must be >= 0");
  ST_CHECK(!o.command().empty() && !o.command()[0].empty(), ConfigError,
           "no program to launch; give it after '--', e.g. shardtrain launch "
           "--nproc-per-node 2 -- ./train");
}

}  // namespace

int find_free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ST_CHECK(fd >= 0, Error, "cannot create a socket to find a free port: ",
           std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = 0;  // the kernel picks a free one
  socklen_t len = sizeof addr;
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  const int e = errno;
  ::close(fd);
  ST_CHECK(ok, Error, "cannot find a free TCP port: ", std::strerror(e),
           "; pass a master port explicitly");
  return ntohs(addr.sin_port);
}

int launch(const LaunchOptions& options) {
  validate(options);
  std::string token = comm::detail::job_token_from_env();
  ST_CHECK(!token.empty() || options.nnodes() == 1, ConfigError, "with nnodes=", options.nnodes(),
           " every node's launcher must know the job's secret: set SHARDTRAIN_JOB_TOKEN to the "
           "same value on every node, e.g. export SHARDTRAIN_JOB_TOKEN=$(head -c 32 /dev/urandom "
           "| od -An -tx1 | tr -d ' \\n')");
  if (token.empty()) token = comm::detail::new_job_token();
  const std::string master = options.master_addr().empty() ? "127.0.0.1" : options.master_addr();
  SignalGuard signals;
  // Node 0 hosts the store for every round: a restarted group meets where
  // the first did.
  Rendezvous rdzv(options, master, token);
  const int first = rdzv.first_round();
  for (int round = first; round >= 0; ++round) {
    if (!rdzv.join(round)) break;
    if (round == first && first > 0) {
      say(::shardtrain::detail::str_cat("node ", options.node_rank(), " joined the job at round ",
                                        round, " (restart ", round, " of ", options.max_restarts(),
                                        ")"));
    }
    Group group(options, rdzv, token, round);
    int code = group.run();
    if (group.interrupted()) return code;
    const bool local = group.failed_rank() >= 0;
    if (!local && !group.remote_failure()) {  // every rank of this node succeeded
      const auto late = rdzv.finish(round);
      if (!late) return code;
      say("this node's ranks finished, but " + late->what);
      rdzv.restart_after(round, false, late->what);  // the others wait for a decision
      return late->code;
    }
    if (!local) code = group.remote_failure()->code;
    bool restart = round < options.max_restarts();
    // Why the job stops, if it does, for the other nodes to print.
    std::string why = local ? ::shardtrain::detail::str_cat("node ", options.node_rank(), ": rank ",
                                                            group.failed_rank(), " failed with ",
                                                            describe_code(code))
                            : group.remote_failure()->what;
    if (code == kBadInputExitCode && options.max_restarts() > 0) {
      // Bad input fails the same way every time: restarting cannot help.
      say(::shardtrain::detail::str_cat("not restarting: ", local ? "rank " + std::to_string(group.failed_rank()) : group.remote_failure()->what,
                                        " exited with ", code,
                                        " (bad input, e.g. a configuration error)"));
      restart = false;
      why += " (bad input, e.g. a configuration error: not restarted)";
    } else if (!restart) {
      why += ::shardtrain::detail::str_cat(" (no restart left: --max-restarts ",
                                           options.max_restarts(), ")");
    }
    if (!rdzv.restart_after(round, restart, why)) {
      if (options.max_restarts() > 0 && round >= options.max_restarts()) {
        say(::shardtrain::detail::str_cat("giving up after ", options.max_restarts(), " restart",
                                          options.max_restarts() == 1 ? "" : "s"));
      }
      return code;
    }
    say(::shardtrain::detail::str_cat("restarting all ", options.nnodes() * options.nproc_per_node(),
                                      " ranks (restart ", round + 1, " of ",
                                      options.max_restarts(), ")"));
  }
  // A stop signal while waiting for other nodes.
  return 128 + (g_stop_signal != 0 ? g_stop_signal : SIGTERM);
}

}  // namespace shardtrain::dist
