#include "launch/fork_server.h"

#include <dirent.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "launch/signals.h"
#include "shardtrain/core/error.h"

namespace shardtrain::dist::detail {
namespace {

// A request: an 8-byte length, sent with the rank's stdout and stderr pipe
// ends attached (SCM_RIGHTS), then that many bytes: argc and envc as 32-bit
// counts, then the arguments and the environment, each NUL-terminated. The
// reply is the rank's pid as a signed 64-bit number, or minus an errno.

bool write_all(int fd, const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

bool read_all(int fd, void* data, size_t n) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t r = ::read(fd, p, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

// The message header of a request's first part: the 8-byte length, with
// room for the two descriptors sent along. Not copyable: it points into
// itself.
struct LengthAndFds {
  uint64_t bytes = 0;
  char control[CMSG_SPACE(2 * sizeof(int))] = {};
  iovec iov{&bytes, sizeof bytes};
  msghdr msg{};
  LengthAndFds() {
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
  }
  LengthAndFds(const LengthAndFds&) = delete;
  LengthAndFds& operator=(const LengthAndFds&) = delete;
};

struct Request {
  std::vector<std::string> argv, env;
  int out = -1, err = -1;
};

// Reads one request; false when the launcher closed the socket (or sent
// something malformed, which only a bug could).
bool receive(int sock, Request& req) {
  LengthAndFds head;
  ssize_t r;
  do {
    r = ::recvmsg(sock, &head.msg, MSG_CMSG_CLOEXEC | MSG_WAITALL);
  } while (r < 0 && errno == EINTR);
  if (r != static_cast<ssize_t>(sizeof head.bytes)) return false;
  const uint64_t bytes = head.bytes;
  cmsghdr* c = CMSG_FIRSTHDR(&head.msg);
  if (c == nullptr || c->cmsg_type != SCM_RIGHTS || c->cmsg_len != CMSG_LEN(2 * sizeof(int))) {
    return false;
  }
  int fds[2];
  std::memcpy(fds, CMSG_DATA(c), sizeof fds);
  req.out = fds[0];
  req.err = fds[1];
  std::string payload(bytes, '\0');
  uint32_t counts[2];
  if (bytes < sizeof counts || !read_all(sock, payload.data(), bytes)) return false;
  std::memcpy(counts, payload.data(), sizeof counts);
  size_t at = sizeof counts;
  for (uint32_t i = 0; i < counts[0] + counts[1]; ++i) {
    const size_t end = payload.find('\0', at);
    if (end == std::string::npos) return false;
    (i < counts[0] ? req.argv : req.env).push_back(payload.substr(at, end - at));
    at = end + 1;
  }
  return !req.argv.empty();
}

// Closes what an exec would have: the descriptors the launcher had open
// with FD_CLOEXEC when it forked the helper (the run directory's lock, the
// helper's socket), so a forked rank starts with what an exec'ed one has.
void close_on_exec_descriptors() {
  DIR* d = ::opendir("/proc/self/fd");
  if (d == nullptr) return;
  std::vector<int> doomed;
  while (const dirent* e = ::readdir(d)) {
    const int fd = std::atoi(e->d_name);
    if (fd <= STDERR_FILENO || fd == ::dirfd(d)) continue;
    const int flags = ::fcntl(fd, F_GETFD);
    if (flags >= 0 && (flags & FD_CLOEXEC)) doomed.push_back(fd);
  }
  ::closedir(d);
  for (const int fd : doomed) ::close(fd);
}

// The rank, in the process the intermediate forked: never returns.
[[noreturn]] void become_rank(const Request& req, RankMain rank_main, pid_t launcher, int sock,
                              const struct sigaction& hup_at_start, const char* name) {
  ::setpgid(0, 0);
  ::prctl(PR_SET_NAME, name);  // the program's name again, not the helper's
  // Wait to be re-parented to the launcher (the intermediate exits at once),
  // so that the death signal below is tied to the launcher, not to it.
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (::getppid() != launcher) {
    if (std::chrono::steady_clock::now() > give_up) ::_exit(128 + SIGKILL);
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != launcher) ::_exit(128 + SIGKILL);  // the launcher died meanwhile
  reset_signals_in_child(hup_at_start);
  const int devnull = ::open("/dev/null", O_RDONLY);
  if (devnull >= 0) ::dup2(devnull, STDIN_FILENO);
  ::dup2(req.out, STDOUT_FILENO);
  ::dup2(req.err, STDERR_FILENO);
  for (int fd : {devnull, req.out, req.err, sock}) {
    if (fd > STDERR_FILENO) ::close(fd);
  }
  close_on_exec_descriptors();
  ::clearenv();
  for (const std::string& e : req.env) ::putenv(::strdup(e.c_str()));
  std::vector<char*> argv;
  for (const std::string& a : req.argv) argv.push_back(::strdup(a.c_str()));
  argv.push_back(nullptr);
  std::exit(rank_main(static_cast<int>(req.argv.size()), argv.data()));
}

// The helper's loop: one rank per request, until the launcher closes the
// socket.
[[noreturn]] void serve(int sock, RankMain rank_main, pid_t launcher,
                        const struct sigaction& hup_at_start) {
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != launcher) ::_exit(0);
  // Named apart from the ranks, its siblings under the launcher.
  char name[16] = {};
  ::prctl(PR_GET_NAME, name);
  ::prctl(PR_SET_NAME, kHelperName);
  // Stop signals are the launcher's to handle and forward; the helper must
  // live as long as the launcher does.
  struct sigaction ign {};
  ign.sa_handler = SIG_IGN;
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGPIPE}) ::sigaction(sig, &ign, nullptr);
  for (;;) {
    Request req;
    if (!receive(sock, req)) ::_exit(0);
    int64_t reply;
    const pid_t middle = ::fork();
    if (middle == 0) {
      const pid_t rank = ::fork();
      if (rank == 0) become_rank(req, rank_main, launcher, sock, hup_at_start, name);
      if (rank > 0) ::setpgid(rank, rank);  // also here, so it holds when the launcher learns the pid
      reply = rank > 0 ? rank : -errno;
      ::_exit(write_all(sock, &reply, sizeof reply) ? 0 : 1);
    }
    if (middle < 0) {
      reply = -errno;
      if (!write_all(sock, &reply, sizeof reply)) ::_exit(0);
    } else {
      int status = 0;
      ::waitpid(middle, &status, 0);
      // An intermediate that died before it answered: answer for it, or the
      // launcher would wait forever.
      if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        reply = -ECHILD;
        if (!write_all(sock, &reply, sizeof reply)) ::_exit(0);
      }
    }
    ::close(req.out);
    ::close(req.err);
  }
}

// OpenBLAS (LibTorch's BLAS here) starts its worker threads when it is
// loaded. They hold nothing a fork could break, and OpenBLAS starts them
// again when it next needs them (as it does after any fork); stopping them
// leaves the launcher with the one thread it may fork the helper from.
void stop_blas_threads() {
  using Shutdown = int (*)();
  if (auto shutdown = reinterpret_cast<Shutdown>(::dlsym(RTLD_DEFAULT, "blas_thread_shutdown_"))) {
    shutdown();
  }
}

int thread_count() {
  DIR* d = ::opendir("/proc/self/task");
  if (d == nullptr) return -1;
  int n = 0;
  while (const dirent* e = ::readdir(d)) n += e->d_name[0] != '.';
  ::closedir(d);
  return n;
}

}  // namespace

std::unique_ptr<ForkServer> ForkServer::start_if_possible(const LaunchOptions& options) {
  if (options.rank_main() == nullptr) return nullptr;
  if (const char* v = std::getenv("SHARDTRAIN_FORK_SERVER"); v && std::strcmp(v, "0") == 0) {
    return nullptr;
  }
  // A copy of a process with other threads could inherit a lock one of them
  // held (OpenMP's pool, an allocator's): exec each rank instead.
  stop_blas_threads();
  if (thread_count() != 1) return nullptr;
  int pair[2];
  ST_CHECK(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) == 0, Error,
           "cannot create the fork server's socket: ", std::strerror(errno));
  // Read before the helper ignores SIGHUP for itself.
  const struct sigaction hup_at_start = hup_for_children();
  const pid_t launcher = ::getpid();
  std::fflush(nullptr);  // nothing buffered may be written twice
  const pid_t helper = ::fork();
  if (helper == 0) {
    ::close(pair[0]);
    serve(pair[1], options.rank_main(), launcher, hup_at_start);
  }
  const int fork_errno = errno;
  ::close(pair[1]);
  if (helper < 0) {
    ::close(pair[0]);
    ST_CHECK(false, Error, "cannot start the fork server: ", std::strerror(fork_errno),
             "; check the process limit (ulimit -u)");
  }
  // Ranks the helper's intermediates orphan come to us.
  ::prctl(PR_SET_CHILD_SUBREAPER, 1);
  return std::unique_ptr<ForkServer>(new ForkServer(helper, pair[0]));
}

ForkServer::~ForkServer() {
  ::close(socket_);  // the helper's read ends: it exits
  ::waitpid(helper_, nullptr, 0);
  ::prctl(PR_SET_CHILD_SUBREAPER, 0);
}

pid_t ForkServer::spawn(const std::vector<std::string>& argv, const std::vector<std::string>& env,
                        int out_fd, int err_fd) {
  std::string payload(2 * sizeof(uint32_t), '\0');
  const uint32_t counts[2] = {static_cast<uint32_t>(argv.size()),
                              static_cast<uint32_t>(env.size())};
  std::memcpy(payload.data(), counts, sizeof counts);
  for (const auto* list : {&argv, &env}) {
    for (const std::string& s : *list) payload.append(s.c_str(), s.size() + 1);
  }
  LengthAndFds head;
  head.bytes = payload.size();
  cmsghdr* c = CMSG_FIRSTHDR(&head.msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(2 * sizeof(int));
  const int fds[2] = {out_fd, err_fd};
  std::memcpy(CMSG_DATA(c), fds, sizeof fds);
  ssize_t sent;
  do {
    sent = ::sendmsg(socket_, &head.msg, MSG_NOSIGNAL);
  } while (sent < 0 && errno == EINTR);
  int64_t reply = 0;
  const bool ok = sent == static_cast<ssize_t>(sizeof head.bytes) &&
                  write_all(socket_, payload.data(), payload.size()) &&
                  read_all(socket_, &reply, sizeof reply);
  ST_CHECK(ok, Error, "the launcher's fork server (pid ", helper_,
           ") is gone; set SHARDTRAIN_FORK_SERVER=0 to start each rank with exec");
  ST_CHECK(reply > 0, Error, "cannot start a rank: fork failed: ",
           std::strerror(static_cast<int>(-reply)), "; check the process limit (ulimit -u)");
  return static_cast<pid_t>(reply);
}

}  // namespace shardtrain::dist::detail
