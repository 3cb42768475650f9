// The job's key-value store: rendezvous, restart rounds and heartbeats meet
// here. One process hosts it (node 0's launcher, or rank 0 when ranks are
// started without our launcher); everyone else reaches it over TCP after
// proving, by challenge and response, that it knows the job token. Internal.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace shardtrain::comm::detail {

class KvStore {
 public:
  virtual ~KvStore() = default;
  virtual void set(const std::string& key, const std::string& value) = 0;
  /// The value, or nullopt when the key is absent; never waits.
  virtual std::optional<std::string> try_get(const std::string& key) = 0;
  /// Adds `delta` to the integer at `key` (absent: 0) and returns the sum.
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  /// Waits until every key exists; false when `timeout` passed first.
  virtual bool wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) = 0;
  /// Milliseconds since `key` was last set, by the host's clock (so hosts
  /// with skewed clocks still agree); nullopt when absent.
  virtual std::optional<int64_t> age_ms(const std::string& key) = 0;
  /// "tcp://address:port" or "in-process", for messages.
  virtual std::string where() const = 0;
};

/// Where round `round`'s world group meets in the store, and the key rank
/// `rank` of that world refreshes about every second while it lives. The
/// communicator writes them; the launcher reads them to name a hung rank.
std::string world_prefix(int round);
std::string heartbeat_key(int round, int rank);
/// A heartbeat older than this means its rank is stopped, hung or dead.
constexpr int64_t kStaleHeartbeatMs = 5000;

/// The heartbeats of `ranks` in `round`: how many are fresh and which went
/// stale (rank, age in ms); a rank that never beat is in neither. The one
/// scan behind every "who is dead" question: the communicator's suspects
/// when an op times out, the launcher's when a rank fails, and its test of
/// whether a node is lost. Throws what the store throws.
struct HeartbeatScan {
  int fresh = 0;
  std::vector<std::pair<int, int64_t>> stale;
  /// "rank 3 (no heartbeat for 12 s: stopped, hung or dead), rank 5 (...)",
  /// or empty when none is stale.
  std::string describe() const;
};
HeartbeatScan scan_heartbeats(KvStore& kv, int round, const std::vector<int>& ranks);

/// 32 random bytes as 64 hex digits, from the kernel's generator.
std::string new_job_token();

/// SHARDTRAIN_TIMEOUT_S as a duration, or `fallback` when unset; ConfigError
/// when it is not a positive number of seconds.
std::chrono::milliseconds timeout_from_env(std::chrono::milliseconds fallback);

/// The token of this process's job: SHARDTRAIN_JOB_TOKEN, or empty.
std::string job_token_from_env();

/// Hosts the store: a listening socket on `address:port` (numeric IPv4 or a
/// name resolving to one; port 0 picks one), every connection served by one
/// thread. Connections that do not answer the challenge with the job token
/// within a few seconds are refused, reported through `log` (one line, then
/// a count every 10 s), and the store goes on serving the rest. Connections
/// that have not proved the token yet are bounded per source address and in
/// all; over a bound, the oldest of the most crowded address is turned away,
/// so strangers cannot keep the job's own peers out. An empty token accepts
/// anyone (ranks started without a launcher or a SHARDTRAIN_JOB_TOKEN).
/// Throws CommError when the address cannot be bound.
class StoreServer final : public KvStore {
 public:
  using Log = std::function<void(const std::string&)>;
  StoreServer(const std::string& address, int port, std::string token, Log log);
  ~StoreServer() override;
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;

  int port() const;
  /// Connections refused so far.
  int refused() const;

  void set(const std::string& key, const std::string& value) override;
  std::optional<std::string> try_get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t delta) override;
  bool wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override;
  std::optional<int64_t> age_ms(const std::string& key) override;
  std::string where() const override;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

/// Connects to the store at `address:port`, retrying refused connections
/// until `timeout` (the host may not be up yet) and trying again when the
/// store turns it away to make room, and answers its challenge
/// with `token`. Every call is bounded by `timeout` too. Throws CommError
/// (TimeoutError when nobody answered) naming the store and what to check.
std::unique_ptr<KvStore> connect_store(const std::string& address, int port,
                                       const std::string& token,
                                       std::chrono::milliseconds timeout);

}  // namespace shardtrain::comm::detail
