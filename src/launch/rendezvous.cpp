#include "launch/rendezvous.h"

#include <vector>

#include "launch/console.h"
#include "launch/signals.h"
#include "shardtrain/core/error.h"
#include "shardtrain/launch/env.h"

namespace shardtrain::dist::detail {
namespace {

using Clock = std::chrono::steady_clock;
using ::shardtrain::detail::str_cat;

std::string launch_key(int round, const std::string& what) {
  return str_cat("shardtrain/launch/", round, "/", what);
}

// A stop signal arrived (and was taken from the self-pipe).
bool stop_requested() { return !drain_stop_signals().empty(); }

}  // namespace

int NodeLayout::world() const { return first_rank(static_cast<int>(sizes.size())); }

int NodeLayout::first_rank(int node) const {
  int first = 0;
  for (int n = 0; n < node; ++n) first += sizes[n];
  return first;
}

bool NodeLayout::uneven() const {
  for (int n : sizes) {
    if (n != sizes.front()) return true;
  }
  return false;
}

Rendezvous::Rendezvous(const LaunchOptions& o, const std::string& master, const std::string& token)
    : options_(o),
      master_(master),
      timeout_(comm::detail::timeout_from_env(std::chrono::minutes(10))) {
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
    say(str_cat("node ", o.node_rank(), ": connecting to node 0 at ", master, ":",
                o.master_port()));
    client_ = comm::detail::connect_store(master, o.master_port(), token, timeout_);
    kv_ = client_.get();
    port_ = o.master_port();
  }
}

int Rendezvous::first_round() {
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

bool Rendezvous::join(int round) {
  if (options_.node_rank() == 0) {
    kv_->set("shardtrain/launch/round", std::to_string(round));
    kv_->set(launch_key(round, "open"), "1");
  }
  kv_->add(launch_key(round, "joined"), 1);
  // A node's key holds the number of ranks it starts.
  const std::string own = std::to_string(options_.nproc_per_node());
  kv_->set(launch_key(round, "node/" + std::to_string(options_.node_rank())), own);
  if (options_.nnodes() == 1) {
    layout_.sizes = {options_.nproc_per_node()};
    return true;
  }
  std::vector<std::string> keys;
  for (int n = 0; n < options_.nnodes(); ++n)
    keys.push_back(launch_key(round, "node/" + std::to_string(n)));
  const auto start = Clock::now();
  auto next_note = start + std::chrono::seconds(10);
  for (;;) {
    if (kv_->wait(keys, std::chrono::milliseconds(500))) {
      read_layout(round, keys);
      return true;
    }
    if (stop_requested()) return false;
    const auto now = Clock::now();
    if (now < next_note && now < start + timeout_) continue;
    std::string missing;
    for (int n = 0; n < options_.nnodes(); ++n) {
      if (!kv_->try_get(keys[n])) missing += (missing.empty() ? "" : ", ") + std::to_string(n);
    }
    const long waited =
        static_cast<long>(std::chrono::duration_cast<std::chrono::seconds>(now - start).count());
    ST_CHECK(now < start + timeout_, TimeoutError, "node ", missing, " did not join round ", round,
             " of the job within ", waited,
             " s. Hint: start its launcher with the same --master-addr, --master-port and "
             "SHARDTRAIN_JOB_TOKEN; SHARDTRAIN_TIMEOUT_S sets how long to wait");
    say(str_cat("round ", round, ": waiting for node ", missing, " of ", options_.nnodes(), " (",
                waited, " s)"));
    next_note = now + std::chrono::seconds(10);
  }
}

void Rendezvous::read_layout(int round, const std::vector<std::string>& keys) {
  layout_.sizes.clear();
  for (int n = 0; n < options_.nnodes(); ++n) {
    const std::string value = kv_->try_get(keys[n]).value_or("");
    const bool digits = !value.empty() && value.size() <= 7 &&
                        value.find_first_not_of("0123456789") == std::string::npos;
    const int count = digits ? std::stoi(value) : 0;
    ST_CHECK(count >= 1, Error, "node ", n, " announced '", value, "' ranks for round ", round,
             " of the job; start every node's launcher from the same shardtrain version");
    layout_.sizes.push_back(count);
  }
  if (layout_.uneven() && options_.node_rank() == 0 && round == 0) {
    say(str_cat("nodes run ", dist::node_sizes_text(layout_.sizes), " ranks: ", layout_.world(),
                " in all"));
  }
}

void Rendezvous::fail(int round, const Failure& f) {
  try {
    if (kv_->add(launch_key(round, "failures"), 1) == 1) {
      kv_->set(launch_key(round, "failed"), std::to_string(f.code) + " " + f.what);
    }
  } catch (const std::exception& e) {
    say(str_cat("cannot tell the other nodes: ", e.what()));
  }
}

std::optional<Failure> Rendezvous::failed(int round) {
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
    return Failure{1, str_cat("lost the job's store on node 0 (", e.what(), ")")};
  }
}

bool Rendezvous::restart_after(int round, bool node0_wants, const std::string& why) {
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
    say(known_ ? gone_after(known_->what) : str_cat("lost the job's store on node 0: ", e.what()));
    return false;
  }
}

void Rendezvous::wait_until_stopped(int round) {
  if (options_.nnodes() == 1) return;
  const auto deadline =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(
                         options_.stop_grace_s() + kDrainSeconds + 10.0));
  try {
    for (;;) {
      std::vector<std::string> keys;
      for (int n = 1; n < options_.nnodes(); ++n) {
        if (!node_silent(round, n))
          keys.push_back(launch_key(round, "stopped/" + std::to_string(n)));
      }
      if (keys.empty() || kv_->wait(keys, std::chrono::milliseconds(500))) return;
      if (stop_requested() || Clock::now() >= deadline) return;
    }
  } catch (const std::exception&) {
  }
}

bool Rendezvous::node_silent(int round, int node) {
  std::vector<int> ranks;
  const int first = layout_.first_rank(node);
  for (int r = first; r < first + layout_.sizes[node]; ++r) ranks.push_back(r);
  const comm::detail::HeartbeatScan scan = comm::detail::scan_heartbeats(*kv_, round, ranks);
  return scan.fresh == 0 && !scan.stale.empty();
}

std::optional<Failure> Rendezvous::finish(int round) {
  if (options_.nnodes() == 1) return std::nullopt;
  try {
    kv_->set(launch_key(round, "done/" + std::to_string(options_.node_rank())), "1");
  } catch (const std::exception&) {
    return std::nullopt;  // node 0 is gone; our own ranks are done
  }
  if (options_.node_rank() != 0) return std::nullopt;
  std::vector<std::string> keys;
  for (int n = 0; n < options_.nnodes(); ++n)
    keys.push_back(launch_key(round, "done/" + std::to_string(n)));
  const auto deadline = Clock::now() + timeout_;
  while (!kv_->wait(keys, std::chrono::milliseconds(500))) {
    if (auto f = failed(round)) return f;
    if (stop_requested() || Clock::now() >= deadline) break;
  }
  return std::nullopt;
}

std::string Rendezvous::suspects(int round, int world_size) {
  std::vector<int> ranks(static_cast<size_t>(world_size));
  for (int r = 0; r < world_size; ++r) ranks[r] = r;
  try {
    return comm::detail::scan_heartbeats(*kv_, round, ranks).describe();
  } catch (const std::exception&) {
    return {};
  }
}

std::optional<std::string> Rendezvous::wait_for(const std::string& key, const char* what) {
  const auto deadline = Clock::now() + timeout_;
  for (;;) {
    if (kv_->wait({key}, std::chrono::milliseconds(500))) return kv_->try_get(key);
    if (stop_requested()) return std::nullopt;
    ST_CHECK(Clock::now() < deadline, TimeoutError, "node ", options_.node_rank(), " waited ",
             std::chrono::duration_cast<std::chrono::seconds>(timeout_).count(), " s for ", what,
             " (", kv_->where(),
             "). Hint: check node 0's launcher; SHARDTRAIN_TIMEOUT_S sets how long to wait");
  }
}

std::string Rendezvous::gone_after(const std::string& what) {
  return "node 0 ended the job (its store closed) after: " + what;
}

}  // namespace shardtrain::dist::detail
