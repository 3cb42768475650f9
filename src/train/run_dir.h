// One job per run directory, and only in directories shardtrain may write.
//
// A job holds an exclusive flock on <run.dir>/.shardtrain.lock for its whole
// life: a second job on the same directory is refused with the first one's
// host and PID instead of deleting its saves in progress and interleaving
// its metrics. The kernel drops the lock with the last descriptor, so a job
// that crashed never leaves a stale one.
//
// Who holds it: the process that lives as long as the job. Under
// `shardtrain train` that is the process the user started (the single rank,
// or the launcher that starts and restarts the ranks, so the hold spans
// restarts); its ranks see SHARDTRAIN_RUN_DIR_LOCKED and do not lock again.
// Otherwise (another launcher, a program using Trainer) rank 0 holds it for
// Trainer::fit.
//
// The lock file is also shardtrain's mark on the directory: a non-empty
// directory without it holds someone else's files, and is refused unless
// resuming or run.overwrite is set.
#pragma once

#include <memory>
#include <string>

namespace shardtrain::train::detail {

constexpr char kRunLockFile[] = ".shardtrain.lock";
/// The canonical run directory whose lock this process or an ancestor holds.
constexpr char kRunLockEnv[] = "SHARDTRAIN_RUN_DIR_LOCKED";

class RunDirLock {
 public:
  /// Creates `dir` if needed; refuses (ConfigError) a non-empty directory
  /// without shardtrain's mark unless `reuse` (resuming, run.overwrite); then
  /// takes the lock, refusing (ConfigError) while another job holds it, with
  /// that job's host and PID. With `refuse_previous_run` (`shardtrain
  /// train`), a directory a run already trained in (metrics.jsonl,
  /// checkpoints) is refused too unless `reuse`. Sets kRunLockEnv for the
  /// processes this one starts.
  static std::unique_ptr<RunDirLock> acquire(const std::string& dir, bool reuse, bool refuse_previous_run = false);
  ~RunDirLock();
  RunDirLock(const RunDirLock&) = delete;
  RunDirLock& operator=(const RunDirLock&) = delete;

 private:
  RunDirLock(int fd, std::string dir) : fd_(fd), dir_(std::move(dir)) {}
  int fd_;
  std::string dir_;  // canonical
};

/// True when this process or the one that started it holds `dir`'s lock.
bool run_dir_locked_above(const std::string& dir);

}  // namespace shardtrain::train::detail
