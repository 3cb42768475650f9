// The process launcher behind `shardtrain launch`: starts the ranks of one
// node, watches them and stops them together.
#pragma once

#include <string>
#include <vector>

#include "shardtrain/core/options.h"

namespace shardtrain::dist {

/// A program's main, as `int main(int argc, char** argv)`.
using RankMain = int (*)(int argc, char** argv);

/// What to launch and how, e.g.
///   LaunchOptions().nproc_per_node(4).command({"./train", "--steps", "10"})
/// Validated by launch(); a bad value is a ConfigError.
struct LaunchOptions {
  ST_ARG(int, nproc_per_node) = 1;
  ST_ARG(int, nnodes) = 1;
  ST_ARG(int, node_rank) = 0;
  /// Empty: 127.0.0.1.
  ST_ARG(std::string, master_addr) = "";
  /// 0: pick a free port on this machine (single node only).
  ST_ARG(int, master_port) = 0;
  /// Times the whole job (every node) is restarted after a failure.
  ST_ARG(int, max_restarts) = 0;
  /// Seconds the other ranks get between SIGTERM and SIGKILL once one failed.
  ST_ARG(double, stop_grace_s) = 3.0;
  /// Lines of output kept per rank and shown when that rank fails.
  ST_ARG(int, tail_lines) = 20;
  /// Program and its arguments; program is looked up in PATH.
  ST_ARG(std::vector<std::string>, command) = {};
  /// When `command` runs this very program: its main. The ranks are then
  /// forked from a helper process that already holds the program and
  /// LibTorch in memory, and call rank_main(command) instead of exec'ing
  /// command[0] (about 1 CPU-second less per rank and per restart). Unused
  /// when the launcher has threads when it starts, or with
  /// SHARDTRAIN_FORK_SERVER=0.
  ST_ARG(RankMain, rank_main) = nullptr;
};

/// Starts nproc_per_node ranks with the torchrun variables set (RANK,
/// LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,
/// MASTER_PORT, SHARDTRAIN_RESTART_COUNT) plus the job's store secret
/// and address (SHARDTRAIN_JOB_TOKEN, SHARDTRAIN_STORE), prefixes each line they
/// print with "[rank k] ", forwards SIGINT and SIGTERM (SIGHUP as SIGTERM)
/// to all of them, and
/// returns the exit code for the launcher: 0 when every rank succeeded;
/// otherwise the code of the first rank that failed (128 + signal for a rank
/// killed by a signal), after stopping the rest and printing that rank's
/// last lines to stderr, with any rank whose heartbeat had stopped named as
/// the suspect. A rank that exits kSkippedExitCode has not failed: the
/// others are not stopped, and the launcher exits kSkippedExitCode when no
/// rank failed.
///
/// Node 0's launcher hosts the job's rendezvous store at
/// master_addr:master_port, bound to that address only, for the whole job
/// (the ranks get another free port as MASTER_PORT, for a program that
/// hosts a store of its own there, as PyTorch's env:// does);
/// every connection must prove it knows the job token (the launcher makes
/// one per job; with nnodes > 1, SHARDTRAIN_JOB_TOKEN must be set to one
/// value on every node). The launchers meet there each round: a failure on
/// any node stops the ranks on every node, and node 0 decides whether the
/// whole job restarts: up to max_restarts times, with SHARDTRAIN_RESTART_COUNT
/// incremented, except when a rank exits with 2 (bad input: a configuration
/// error), which a restart cannot cure. A node whose launcher starts again
/// (after losing the node) joins the next round; node 0 waits for it up to
/// SHARDTRAIN_TIMEOUT_S. The Trainer resumes a restarted job from its newest
/// checkpoint (checkpoint.resume).
///
/// Conventions:
///   - "k" in the prefix is the global rank; stdout lines go to stdout, stderr
///     lines to stderr; an unterminated last line is flushed at EOF.
///   - Each rank runs in its own process group with stdin on /dev/null (a
///     background group reading the terminal would be stopped) and dies with
///     the launcher (PR_SET_PDEATHSIG). Other launchers' rank variables
///     (SLURM_PROCID, OMPI_COMM_WORLD_*, PMI_*, ...) are removed from its
///     environment: they describe the launcher's slot, not the rank's.
///   - A program that cannot be found exits 127 (126: cannot be executed),
///     reported like any other failure.
///   - SIGINT/SIGTERM to the launcher: forwarded to every rank's process
///     group, SIGKILL after stop_grace_s (or at once on a second signal); the
///     result is 128 + signal, or the code of a rank that had already failed.
///     A stop by signal never restarts. SIGHUP (a closed terminal) sends the
///     ranks SIGTERM and never escalates; ignored at start (nohup), it stays so.
///   - With nnodes > 1, master_addr and master_port are required.
///   - Nodes may start different numbers of ranks (each its own
///     nproc_per_node): every launcher publishes its count when it joins a
///     round, node i's ranks follow those of the nodes before it,
///     WORLD_SIZE is the sum and LOCAL_WORLD_SIZE the node's own count; only
///     then the ranks also get SHARDTRAIN_NODE_SIZES ("2,1", every node's
///     count in node order; see shardtrain/launch/env.h).
///   - Node 0's launcher is the job's anchor: if it dies, the other nodes
///     stop (their store is gone) and the job must be started again.
int launch(const LaunchOptions& options);

/// The exit code of a program that refused bad input (a configuration error,
/// bad arguments): shardtrain's tools exit with it, and launch() does not
/// restart a group whose rank exited with it.
constexpr int kBadInputExitCode = 2;

/// The exit code of a program that skipped its work (a test whose
/// precondition does not hold here), as Automake and ctest's
/// SKIP_RETURN_CODE take it: launch() neither stops the other ranks nor
/// restarts the job for it, and passes it on when no rank failed.
constexpr int kSkippedExitCode = 77;

/// A TCP port that was free on this machine a moment ago.
int find_free_port();

}  // namespace shardtrain::dist
