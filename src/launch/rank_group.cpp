#include "launch/rank_group.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <set>

#include "core/file.h"
#include "launch/console.h"
#include "launch/fork_server.h"
#include "launch/signals.h"
#include "shardtrain/core/error.h"
#include "shardtrain/launch/env.h"

extern char** environ;

namespace shardtrain::dist::detail {
namespace {

using ::shardtrain::detail::str_cat;

// Longest line kept in memory; a rank that prints more without a newline has
// it written out in pieces rather than growing the buffer without bound.
constexpr size_t kMaxLineBytes = 64 * 1024;
// How often a launcher of a multi-node job looks for other nodes' failures.
constexpr int kWatchMs = 250;

// Variables the launcher sets, plus other launchers' rank variables: those
// describe the launcher's own slot, so a rank must not see them.
const std::set<std::string> kReplacedVars = {"RANK",
                                             "LOCAL_RANK",
                                             "WORLD_SIZE",
                                             "LOCAL_WORLD_SIZE",
                                             "GROUP_RANK",
                                             "MASTER_ADDR",
                                             "MASTER_PORT",
                                             "SHARDTRAIN_RESTART_COUNT",
                                             "SHARDTRAIN_JOB_TOKEN",
                                             "SHARDTRAIN_STORE",
                                             "SHARDTRAIN_PROGRESS_TO_LAUNCHER",
                                             "SHARDTRAIN_NODE_SIZES",
                                             "SLURM_PROCID",
                                             "SLURM_LOCALID",
                                             "SLURM_NODEID",
                                             "OMPI_COMM_WORLD_RANK",
                                             "OMPI_COMM_WORLD_SIZE",
                                             "OMPI_COMM_WORLD_LOCAL_RANK",
                                             "OMPI_COMM_WORLD_LOCAL_SIZE",
                                             "PMI_RANK",
                                             "PMI_SIZE",
                                             "MPI_LOCALRANKID",
                                             "MPI_LOCALNRANKS"};

// Whether `pid` is stopped (SIGSTOP, a debugger): it cannot act on SIGTERM,
// so waiting out the grace period for it would only delay the stop.
bool is_stopped(pid_t pid) {
  std::string stat, why;
  if (!::shardtrain::detail::read_regular_file("/proc/" + std::to_string(pid) + "/stat", 1 << 16, &stat, &why)) {
    return false;
  }
  // "pid (comm) state ...": the state follows the last ')'.
  const size_t close = stat.rfind(')');
  const char state = close != std::string::npos && close + 2 < stat.size() && stat[close + 1] == ' '
                         ? stat[close + 2]
                         : 0;
  return state == 'T' || state == 't';
}

}  // namespace

RankGroup::RankGroup(const LaunchOptions& options, Rendezvous& rdzv, const std::string& token,
                     int round, ForkServer* fork_server)
    : options_(options), rdzv_(rdzv), token_(token), round_(round), fork_server_(fork_server) {}

RankGroup::~RankGroup() {
  for (auto& r : ranks_) {
    if (r.running) {
      ::kill(-r.pid, SIGKILL);
      ::waitpid(r.pid, nullptr, 0);
    }
    close_stream(r.out);
    close_stream(r.err);
  }
}

std::vector<std::string> RankGroup::child_env(int local_rank) const {
  std::vector<std::string> env;
  for (char** e = environ; e && *e; ++e) {
    const char* eq = std::strchr(*e, '=');
    if (eq && kReplacedVars.count(std::string(*e, static_cast<size_t>(eq - *e)))) continue;
    env.emplace_back(*e);
  }
  // Node i's ranks follow those of the nodes before it, whatever their counts.
  const NodeLayout& layout = rdzv_.layout();
  const int rank = layout.first_rank(options_.node_rank()) + local_rank;
  auto set = [&](const char* key, const std::string& value) {
    env.push_back(std::string(key) + "=" + value);
  };
  set("RANK", std::to_string(rank));
  set("LOCAL_RANK", std::to_string(local_rank));
  set("WORLD_SIZE", std::to_string(layout.world()));
  set("LOCAL_WORLD_SIZE", std::to_string(options_.nproc_per_node()));
  // Only when nodes differ: what needs equal nodes refuses, the rest adapts.
  if (layout.uneven()) set(dist::kNodeSizesVar, dist::node_sizes_text(layout.sizes));
  set("GROUP_RANK", std::to_string(options_.node_rank()));
  set("MASTER_ADDR", options_.master_addr().empty() ? "127.0.0.1" : options_.master_addr());
  set("MASTER_PORT", std::to_string(rdzv_.app_port()));
  set("SHARDTRAIN_RESTART_COUNT", std::to_string(round_));
  set("SHARDTRAIN_JOB_TOKEN", token_);
  set("SHARDTRAIN_STORE", rdzv_.store_address());
  if (progress_bar().active()) set(kProgressEnv, "1");
  return env;
}

// fork() and exec: the rank is a fresh copy of the program. Returns its pid,
// or -1 with errno set when fork failed.
static pid_t fork_and_exec(const std::vector<std::string>& args,
                           const std::vector<std::string>& env, int out, int err) {
  // Everything the child needs is built before fork(): between fork and exec
  // only async-signal-safe calls are allowed (the caller may have threads).
  std::vector<std::string> env_strings = env, arg_strings = args;
  std::vector<char*> envp, argv;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  for (auto& s : arg_strings) argv.push_back(s.data());
  argv.push_back(nullptr);
  const std::string exec_error = "shardtrain launch: cannot run '" + args[0] + "': ";
  const int devnull = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  const pid_t parent = ::getpid();
  const struct sigaction hup = hup_for_children();

  // Blocked across fork so that our handlers never run in the child.
  sigset_t all, old;
  sigfillset(&all);
  ::sigprocmask(SIG_BLOCK, &all, &old);
  const pid_t pid = ::fork();
  if (pid == 0) {
    // Own process group: a terminal's Ctrl-C reaches the launcher only, which
    // forwards it, and signal_all() can signal a rank's own children too.
    ::setpgid(0, 0);
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(128 + SIGKILL);  // the launcher died before prctl
    reset_signals_in_child(hup);
    // stdin is /dev/null: a rank in a background process group that read the
    // terminal would be stopped by SIGTTIN.
    if (devnull >= 0) ::dup2(devnull, STDIN_FILENO);
    ::dup2(out, STDOUT_FILENO);
    ::dup2(err, STDERR_FILENO);
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
  if (pid > 0) ::setpgid(pid, pid);  // also here, so a signal sent right away finds the group
  errno = fork_errno;
  return pid;
}

void RankGroup::start(Rank& r, int local_rank) {
  int out[2], err[2];
  ST_CHECK(::pipe2(out, O_CLOEXEC) == 0, Error, "cannot create a pipe: ", std::strerror(errno));
  if (::pipe2(err, O_CLOEXEC) != 0) {
    const int e = errno;
    ::close(out[0]);
    ::close(out[1]);
    ST_CHECK(false, Error, "cannot create a pipe: ", std::strerror(e));
  }
  pid_t pid = -1;
  std::string failure;
  try {
    if (fork_server_ != nullptr) {
      pid = fork_server_->spawn(options_.command(), child_env(local_rank), out[1], err[1]);
    } else {
      pid = fork_and_exec(options_.command(), child_env(local_rank), out[1], err[1]);
      if (pid < 0) {
        failure = str_cat("fork failed: ", std::strerror(errno),
                          "; check the process limit (ulimit -u)");
      }
    }
  } catch (const std::exception& e) {
    failure = e.what();
  }
  ::close(out[1]);
  ::close(err[1]);
  if (pid < 0) {
    ::close(out[0]);
    ::close(err[0]);
    ST_CHECK(false, Error, "cannot start rank ", r.rank, ": ", failure);
  }
  ::fcntl(out[0], F_SETFL, O_NONBLOCK);
  ::fcntl(err[0], F_SETFL, O_NONBLOCK);
  r.pid = pid;
  r.running = true;
  r.out.fd = out[0];
  r.out.target = STDOUT_FILENO;
  r.err.fd = err[0];
  r.err.target = STDERR_FILENO;
}

void RankGroup::start_all() {
  ranks_.resize(static_cast<size_t>(options_.nproc_per_node()));
  const int first = rdzv_.layout().first_rank(options_.node_rank());
  for (int i = 0; i < options_.nproc_per_node(); ++i) {
    ranks_[i].rank = first + i;
    start(ranks_[i], i);
  }
}

void RankGroup::emit(Rank& r, Stream& s, const std::string& line) {
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

void RankGroup::close_stream(Stream& s) {
  if (s.fd >= 0) ::close(s.fd);
  s.fd = -1;
}

void RankGroup::read_stream(Rank& r, Stream& s) {
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

void RankGroup::signal_all(int sig) {
  for (auto& r : ranks_) {
    if (r.running) ::kill(-r.pid, sig);
  }
}

void RankGroup::reap() {
  for (size_t i = 0; i < ranks_.size(); ++i) {
    Rank& r = ranks_[i];
    if (!r.running) continue;
    int status = 0;
    const pid_t got = ::waitpid(r.pid, &status, WNOHANG);
    if (got != r.pid) continue;
    r.running = false;
    r.code = WIFEXITED(status)     ? WEXITSTATUS(status)
             : WIFSIGNALED(status) ? 128 + WTERMSIG(status)
                                   : 1;
    // Exits after we began stopping the group are consequences, not causes.
    if (phase_ != Phase::kRunning) continue;
    // A rank that skipped its work ended as cleanly as one that did it: the
    // others go on, and the group reports the skip only if nothing failed.
    if (r.code == kSkippedExitCode) skipped_ = true;
    if (r.code == 0 || r.code == kSkippedExitCode) continue;
    failed_ = static_cast<int>(i);
    // Now, before the others are stopped: a hung rank's heartbeat is the
    // only stale one, and it is why a healthy rank timed out.
    suspects_ = rdzv_.suspects(round_, rdzv_.layout().world());
    const std::string what = str_cat("rank ", r.rank, " failed with ", describe_code(r.code));
    int others = 0;
    for (auto& o : ranks_) others += o.running ? 1 : 0;
    say(what + (suspects_.empty() ? "" : "; suspect: " + suspects_) +
        (options_.nnodes() > 1 ? "; stopping the job on every node"
         : others              ? "; stopping the other ranks"
                               : ""));
    rdzv_.fail(round_, Failure{r.code, str_cat("node ", options_.node_rank(), ": ", what)});
    begin_stopping();
  }
}

void RankGroup::begin_stopping(int sig) {
  phase_ = Phase::kStopping;
  kill_deadline_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                      std::chrono::duration<double>(options_.stop_grace_s()));
  signal_all(sig);
  for (auto& r : ranks_) {
    if (r.running && is_stopped(r.pid)) {
      say(str_cat("rank ", r.rank, " is stopped (SIGSTOP?); sending SIGKILL"));
      ::kill(-r.pid, SIGKILL);
    }
  }
}

void RankGroup::kill_all(const std::string& why) {
  say(why);
  signal_all(SIGKILL);
  phase_ = Phase::kKilled;
}

void RankGroup::on_stop_signal(int sig) {
  if (signal_ == 0) {
    signal_ = sig;
    // The ranks get SIGTERM for a hangup: every program knows it as "save
    // and stop", and a lost terminal is no reason to lose work.
    const int forward = sig == SIGHUP ? SIGTERM : sig;
    say(sig == SIGHUP ? std::string("got SIGHUP (the terminal or session closed); sending "
                                    "SIGTERM to the ranks so that they save and stop")
                      : str_cat("got ", ::strsignal(sig), "; forwarding it to the ranks"));
    if (phase_ == Phase::kRunning) {
      begin_stopping(forward);
    } else {
      signal_all(forward);
    }
  } else if (sig != SIGHUP && phase_ != Phase::kKilled) {
    // A second Ctrl-C means "now": don't wait out the grace period. A hangup
    // is often delivered twice (by the kernel and the shell): it never means
    // "now".
    kill_all("got a second signal; sending SIGKILL to the ranks");
  }
}

// A failure on another node stops this node's ranks too: the job restarts
// (or ends) as a whole.
void RankGroup::watch_other_nodes() {
  if (phase_ != Phase::kRunning || options_.nnodes() == 1) return;
  auto failure = rdzv_.failed(round_);
  if (!failure) return;
  say("stopping this node's ranks: " + failure->what);
  remote_ = std::move(failure);
  begin_stopping();
}

int RankGroup::run() {
  start_all();
  // Set once no rank runs: their pipes are read until then at most.
  std::optional<Clock::time_point> drain_deadline;
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
      if (!drain_deadline) {
        drain_deadline = now + std::chrono::duration_cast<Clock::duration>(
                                   std::chrono::duration<double>(kDrainSeconds));
      } else if (now >= *drain_deadline) {
        break;  // a grandchild holds the pipe open; don't wait for it
      }
    }
    if (any_running && phase_ == Phase::kStopping && now >= kill_deadline_) {
      kill_all(str_cat("ranks still running ", options_.stop_grace_s(),
                       " s after SIGTERM; sending SIGKILL"));
    }

    // Wait for output, an exited rank or a signal; nothing else wakes us.
    fds.assign(1, pollfd{signal_fd(), POLLIN, 0});
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
    if (!any_running)
      timeout_ms = ms_until(*drain_deadline);
    else if (phase_ == Phase::kStopping)
      timeout_ms = ms_until(kill_deadline_);
    // Other nodes' failures arrive through the store, which does not wake us.
    if (options_.nnodes() > 1 && any_running && phase_ == Phase::kRunning) timeout_ms = kWatchMs;
    const int ready = ::poll(fds.data(), fds.size(), timeout_ms);
    if (ready < 0 && errno != EINTR) {
      ST_CHECK(false, Error, "poll failed: ", std::strerror(errno));
    }

    // Output first, so a failed rank's last lines are in its tail.
    for (size_t i = 1; ready > 0 && i < fds.size(); ++i) {
      if (fds[i].revents) read_stream(*owners[i].first, *owners[i].second);
    }
    for (const int sig : drain_stop_signals()) on_stop_signal(sig);
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

void RankGroup::report_failure() const {
  const Rank& r = ranks_[failed_];
  std::string text;
  if (r.tail.empty()) {
    text =
        str_cat("rank ", r.rank, " printed nothing before it failed with ", describe_code(r.code));
  } else {
    text = str_cat("last ", r.tail.size(), " line", r.tail.size() == 1 ? "" : "s", " of rank ",
                   r.rank, ", which failed with ", describe_code(r.code), ":");
    for (const auto& line : r.tail) text += "\n  [rank " + std::to_string(r.rank) + "] " + line;
  }
  if (!suspects_.empty()) {
    text += str_cat("\n  suspect: ", suspects_, "; rank ", r.rank,
                    "'s failure is probably a consequence");
  }
  say(text);
}

}  // namespace shardtrain::dist::detail
