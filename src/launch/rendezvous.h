// The launchers' rendezvous, one per launcher for the whole job.
//
// Node 0's launcher hosts the job's store for the whole job, so it outlives
// every round of ranks (rank 0's death no longer takes the store with it).
// Each round k, every launcher announces itself under launch/k/ with the
// number of ranks it starts and waits for all nodes, whose counts number the
// ranks (NodeLayout: nodes may differ); the first failure anywhere is written to launch/k/failed, which
// every launcher watches and answers by stopping its ranks; node 0 then
// writes launch/k/next ("restart" or "stop") and the others follow it.
// Waits notice stop signals (drain_stop_signals) and give up on them.
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "comm/kv_store.h"
#include "shardtrain/launch/launcher.h"

namespace shardtrain::dist::detail {

/// How long a launcher still reads the output of its exited ranks when
/// something (a grandchild that inherited the pipe) keeps it open; node 0
/// allows for it when it waits for the other nodes to stop.
constexpr double kDrainSeconds = 1.0;

/// A failure of one round, as every node learns it.
struct Failure {
  int code = 1;
  std::string what;  // "node 1: rank 3 failed with exit code 1"
};

/// The ranks each node of a round runs (its --nproc-per-node), in node
/// order, as every node published them when it joined. Nodes may differ:
/// node i's ranks come after those of the nodes before it.
struct NodeLayout {
  std::vector<int> sizes;

  /// Ranks in the job: the sum of the sizes.
  int world() const;
  /// Node `node`'s first global rank: the sum of the sizes before it.
  int first_rank(int node) const;
  /// Whether some node runs a different number of ranks than node 0.
  bool uneven() const;
};

class Rendezvous {
 public:
  /// Node 0 hosts the job's store on master:master_port; the others connect
  /// to it (TimeoutError after SHARDTRAIN_TIMEOUT_S).
  Rendezvous(const LaunchOptions& o, const std::string& master, const std::string& token);

  /// "address:port" of the job's store, for the ranks (SHARDTRAIN_STORE).
  std::string store_address() const { return master_ + ":" + std::to_string(port_); }
  /// MASTER_PORT for the ranks, the same on every node.
  int app_port() const { return app_port_; }

  /// The round this launcher starts in: node 0 opens round 0; a node that
  /// (re)starts later joins the newest round that is still gathering nodes.
  /// Returns -1 when a stop signal arrived while waiting.
  int first_round();

  /// Every node announces itself for `round` with its number of ranks and
  /// waits for the others, saying every ~10 s which nodes are missing; then
  /// layout() holds every node's count. False on a stop signal;
  /// TimeoutError when a node does not come within SHARDTRAIN_TIMEOUT_S.
  bool join(int round);

  /// The nodes' rank counts of the round last joined.
  const NodeLayout& layout() const { return layout_; }

  /// Records this node's failure in `round` unless another was first.
  void fail(int round, const Failure& f);

  /// The first failure of `round` on any node, if there was one. Losing the
  /// store (node 0's launcher is gone) is a failure that cannot restart; if
  /// a failure was read before, it says that node 0 ended the job on it.
  std::optional<Failure> failed(int round);

  /// After a failed round: node 0 decides whether the job restarts and tells
  /// the others, who follow. False: stop. On a stop node 0 gives its reason
  /// (`why`), which the others print. The store leaves with node 0's
  /// launcher, so on a stop node 0 first waits until the other nodes have
  /// read the decision (and so the failure, whose exit code they end with).
  bool restart_after(int round, bool node0_wants, const std::string& why = {});

  /// This node's ranks all succeeded in `round`. Node 0 then waits for the
  /// other nodes to finish too, because they need its store until they do;
  /// returns a failure reported meanwhile, if any.
  std::optional<Failure> finish(int round);

  /// "rank 3 (no heartbeat for 12 s ...)" for ranks of `round` whose heartbeat
  /// went stale, or empty.
  std::string suspects(int round, int world_size);

 private:
  /// Whether the ranks of `node` in `round` beat and all went stale (ranks
  /// that never beat, programs without a communicator, say nothing).
  bool node_silent(int round, int node);

  /// Reads every node's rank count for `round` (`keys`, all present) into layout_.
  void read_layout(int round, const std::vector<std::string>& keys);

  /// Node 0, after deciding to stop: waits until every other node has read
  /// that, for as long as a node takes to stop its ranks and a little more,
  /// but not for a node whose ranks all went silent (a lost host never
  /// answers, and its ranks' heartbeats stop).
  void wait_until_stopped(int round);

  // Waits for `key`, in slices so a stop signal is noticed; nullopt on a
  // signal, TimeoutError after SHARDTRAIN_TIMEOUT_S.
  std::optional<std::string> wait_for(const std::string& key, const char* what);

  const LaunchOptions& options_;
  const std::string master_;
  std::chrono::milliseconds timeout_;
  int app_port_ = 0;
  std::unique_ptr<comm::detail::StoreServer> server_;
  std::unique_ptr<comm::detail::KvStore> client_;
  comm::detail::KvStore* kv_ = nullptr;
  int port_ = 0;
  bool lost_store_ = false;
  std::optional<Failure> known_;  // the last failure read from the store
  NodeLayout layout_;             // of the round last joined

  // What to say when node 0's store went away after `what` had stopped the
  // job: node 0 ended it (node 0 closes the store only when it stops).
  static std::string gone_after(const std::string& what);
};

}  // namespace shardtrain::dist::detail
