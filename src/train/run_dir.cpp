#include "train/run_dir.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <vector>

#include "shardtrain/core/error.h"

namespace shardtrain::train::detail {

namespace fs = std::filesystem;
using ::shardtrain::detail::str_cat;

namespace {

std::string canonical_dir(const std::string& dir) {
  std::error_code ec;
  const fs::path c = fs::weakly_canonical(dir, ec);
  return ec ? fs::absolute(dir).lexically_normal().string() : c.string();
}

// Up to three entries of a directory that lacks shardtrain's mark.
std::vector<std::string> foreign_entries(const std::string& dir) {
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    names.push_back(e.path().filename().string() + (e.is_directory(ec) ? "/" : ""));
    if (names.size() == 3) break;
  }
  return names;
}

// What a previous run of ours left in `dir` (its metrics, its checkpoints),
// for the message; empty when there is none.
std::string previous_run(const std::string& dir) {
  std::error_code ec;
  std::string found;
  if (fs::exists(fs::path(dir) / "metrics.jsonl", ec)) found = "metrics.jsonl";
  for (const auto& e : fs::directory_iterator(fs::path(dir) / "checkpoints", ec)) {
    (void)e;
    found += found.empty() ? "checkpoints/" : ", checkpoints/";
    break;
  }
  return found;
}

std::string holder_line() {
  char host[256] = {0};
  if (::gethostname(host, sizeof(host) - 1) != 0) std::strcpy(host, "unknown");
  char when[32] = {0};
  const std::time_t now = std::time(nullptr);
  std::strftime(when, sizeof(when), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  return str_cat("host ", host, ", pid ", ::getpid(), ", since ", when, "\n");
}

}  // namespace

std::unique_ptr<RunDirLock> RunDirLock::acquire(const std::string& dir, bool reuse, bool refuse_previous_run) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  ST_CHECK(!ec, IoError, "cannot create the run directory '", dir, "': ", ec.message(),
           "; hint: check run.dir and its permissions");
  const fs::path lock = fs::path(dir) / kRunLockFile;
  const fs::file_status st = fs::symlink_status(lock, ec);
  const bool marked = fs::exists(st);
  ST_CHECK(!marked || fs::is_regular_file(st), ConfigError, "run.dir '", dir, "': '",
           lock.string(), "' is not shardtrain's lock file (a link or not a plain file)",
           "; hint: remove it, or choose another run.dir");
  if (!marked && !reuse) {
    const std::vector<std::string> theirs = foreign_entries(dir);
    std::string list;
    for (const auto& n : theirs) list += (list.empty() ? "'" : ", '") + n + "'";
    ST_CHECK(theirs.empty(), ConfigError, "run.dir '", dir,
             "' already holds files shardtrain did not write there (", list,
             theirs.size() == 3 ? ", ..." : "", "); hint: choose a new or empty run.dir, set "
             "checkpoint.resume to continue a run, or set run.overwrite: true to write into it "
             "anyway (config.yaml, model.safetensors, report.html and checkpoints/ may be replaced)");
  }
  const int fd = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
  ST_CHECK(fd >= 0, IoError, "cannot open the run directory's lock '", lock.string(), "': ",
           std::strerror(errno), "; hint: check run.dir and its permissions");
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    char buf[256] = {0};
    const ssize_t n = ::pread(fd, buf, sizeof(buf) - 1, 0);
    ::close(fd);
    std::string holder = n > 0 ? std::string(buf, static_cast<size_t>(n)) : "";
    while (!holder.empty() && (holder.back() == '\n' || holder.back() == ' ')) holder.pop_back();
    for (char& c : holder) {
      if (c == '\n' || c == '\r') c = ' ';
    }
    ST_CHECK(err != EWOULDBLOCK, ConfigError, "run.dir '", dir, "' is in use by another job (",
             holder.empty() ? "it has not said who it is yet" : holder,
             "); two jobs in one run directory delete each other's saves; hint: wait for that job "
             "to end (or stop it), or give this one another run.dir");
    ST_CHECK(false, IoError, "cannot lock the run directory '", dir, "': ", std::strerror(err),
             "; hint: run.dir must be on a file system that supports flock");
  }
  // A run directory of ours that a run already trained in (and that no job
  // holds now): starting again would train from scratch over its model and
  // append to its metrics.
  const std::string previous = refuse_previous_run && marked && !reuse ? previous_run(dir) : std::string();
  if (!previous.empty()) {
    ::close(fd);
    ST_CHECK(false, ConfigError, "run.dir '", dir, "' holds a previous run (", previous,
             "); hint: set checkpoint.resume: auto to continue it, run.overwrite: true to start over in it "
             "(its checkpoints, model and metrics are replaced), or choose another run.dir");
  }
  const std::string line = holder_line();
  if (::ftruncate(fd, 0) != 0 ||
      ::pwrite(fd, line.data(), line.size(), 0) != static_cast<ssize_t>(line.size())) {
    // Who holds it is only said to a second job; the lock itself is held.
  }
  const std::string canonical = canonical_dir(dir);
  ::setenv(kRunLockEnv, canonical.c_str(), 1);
  return std::unique_ptr<RunDirLock>(new RunDirLock(fd, canonical));
}

// Also runs while an error unwinds the trainer, with the communication
// threads still alive: it only releases the lock (first, so that it is
// released whatever follows) and forgets the variable, allocating nothing.
RunDirLock::~RunDirLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the lock
  const char* held = std::getenv(kRunLockEnv);
  if (held != nullptr && std::strcmp(held, dir_.c_str()) == 0) ::unsetenv(kRunLockEnv);
}

bool run_dir_locked_above(const std::string& dir) {
  const char* held = std::getenv(kRunLockEnv);
  return held != nullptr && *held != '\0' && canonical_dir(dir) == held;
}

}  // namespace shardtrain::train::detail
