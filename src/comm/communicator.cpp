// The Communicator: rendezvous, one communication thread per group, argument
// checks, and dispatch to the algorithm files (ring_*.cpp, chain_*.cpp).
#include "shardtrain/comm/communicator.h"

#include <signal.h>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/zeros.h>
#include <gloo/common/error.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <future>
#include <iostream>
#include <optional>
#include <mutex>
#include <thread>

#include "comm/detail.h"
#include "comm/shm.h"
#include "comm/interface.h"
#include "comm/mpi.h"
#include "comm/kv_store.h"
#include "comm/store.h"
#include "shardtrain/core/error.h"
#include "shardtrain/launch/env.h"

namespace shardtrain::comm {

using ::shardtrain::detail::str_cat;

const char* to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return "sum";
    case ReduceOp::Avg: return "avg";
    case ReduceOp::Max: return "max";
    case ReduceOp::Min: return "min";
  }
  return "?";
}

ShardRange shard_range(int64_t numel, int world_size, int rank) {
  ST_ASSERT(world_size > 0 && rank >= 0 && rank < world_size && numel >= 0);
  const int64_t base = numel / world_size;
  const int64_t extra = numel % world_size;
  ShardRange range;
  range.count = base + (rank < extra ? 1 : 0);
  range.offset = rank * base + std::min<int64_t>(rank, extra);
  return range;
}

namespace detail {

// ---- Work ----------------------------------------------------------------------

// The shared state behind a Work: finished once, by the thread that ran it.
class WorkState {
 public:
  void finish(std::exception_ptr error) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      error_ = std::move(error);
      done_ = true;
    }
    cv_.notify_all();
  }
  void wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [this] { return done_; });
    if (error_) std::rethrow_exception(error_);
  }
  bool is_completed() {
    std::lock_guard<std::mutex> lock(mutex_);
    return done_;
  }
  std::exception_ptr exception() {
    std::lock_guard<std::mutex> lock(mutex_);
    return error_;
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
};

// ---- the communication thread ----------------------------------------------------

// Runs tasks one at a time, in the order they were queued. Every rank queues
// a group's collectives in the same order, so they meet in the same order.
class Worker {
 public:
  Worker() : state_(std::make_shared<State>()), thread_([s = state_] { loop(*s); }) {}
  ~Worker() {
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      state_->stop = true;
    }
    state_->cv.notify_all();
    // A task that dropped the last reference to its own group ends here, on
    // this very thread: joining itself would throw std::system_error (and
    // terminate the process). The thread owns the state it still reads.
    if (thread_.get_id() == std::this_thread::get_id()) {
      thread_.detach();
    } else {
      thread_.join();
    }
  }
  void push(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      state_->queue.push_back(std::move(task));
    }
    state_->cv.notify_one();
  }

 private:
  struct State {
    std::mutex mutex;
    std::condition_variable cv;
    std::deque<std::function<void()>> queue;
    bool stop = false;
  };
  static void loop(State& s) {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(s.mutex);
        s.cv.wait(lock, [&s] { return s.stop || !s.queue.empty(); });
        if (s.queue.empty()) return;  // stop requested and nothing left to run
        task = std::move(s.queue.front());
        s.queue.pop_front();
      }
      // Tasks report their own errors through their Work; nothing may leave
      // this thread (that is std::terminate), whatever a failed op did.
      try {
        task();
      } catch (...) {
      }
    }
  }

  std::shared_ptr<State> state_;
  std::thread thread_;  // last: starts after the state it uses exists
};

// Refreshes this rank's heartbeat key about every second from its own
// thread, so a rank busy computing still beats and a stopped one does not.
class Heartbeat {
 public:
  Heartbeat(std::shared_ptr<KvStore> kv, std::string key)
      : kv_(std::move(kv)), key_(std::move(key)), thread_([this] { run(); }) {}
  ~Heartbeat() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  Heartbeat(const Heartbeat&) = delete;
  Heartbeat& operator=(const Heartbeat&) = delete;

 private:
  void run() {
    std::unique_lock<std::mutex> lock(mu_);
    for (uint64_t beat = 0; !stop_; ++beat) {
      lock.unlock();
      try {
        kv_->set(key_, std::to_string(beat));
      } catch (const std::exception&) {
        return;  // the store is gone; the ops will say so
      }
      lock.lock();
      cv_.wait_for(lock, std::chrono::seconds(1), [this] { return stop_; });
    }
  }

  std::shared_ptr<KvStore> kv_;
  std::string key_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;  // last: starts after the members it uses exist
};

// ---- the group -------------------------------------------------------------------

class Group {
 public:
  int rank = 0;
  int size = 1;
  std::string name = "world";
  std::vector<int> global_ranks{0};
  Timeout timeout{std::chrono::minutes(10)};
  int64_t segment_bytes = int64_t{1} << 20;
  int64_t one_round_bytes = kOneRoundBytes;  // SHARDTRAIN_ONE_ROUND_BYTES
  // Rendezvous state kept for new_group(); null for a world of one.
  std::shared_ptr<KvStore> kv;
  std::shared_ptr<gloo::rendezvous::Store> store;  // Gloo's view of kv
  int round = 0;  // the restart round; heartbeats are kept per round
  std::shared_ptr<gloo::transport::Device> device;
  Endpoint endpoint;  // the interface and address `device` is bound to
  int ranks_per_node = 0;  // LOCAL_WORLD_SIZE when the world spans several nodes, else 0
  std::string store_prefix;
  std::shared_ptr<gloo::rendezvous::Context> ctx;
  uint64_t groups_created = 0;
  ScratchArena scratch;
  std::atomic<uint64_t> seq{0};
  std::atomic<int64_t> busy_ns{0};  // time the worker spent running collectives
  uint64_t p2p_seq = 0;  // only used to name p2p ops in errors
  // Set by the first failed op; every later op fails fast with it.
  std::mutex broken_mutex;
  std::string broken;
  // The world group's liveness signal in the store (heartbeat_key).
  std::unique_ptr<Heartbeat> heartbeat;
  // Collectives through shared memory when every rank is on this host.
  std::unique_ptr<ShmChannel> shm;
  // Under the mpi backend, every op instead (kv, ctx and shm stay null).
  std::unique_ptr<MpiComm> mpi;
  // all_reduce's two levels when the group spans hosts with k > 1 ranks on
  // each (open_levels, hierarchical.cpp); null for flat rings. They have no
  // thread of their own: this group's worker runs their part of each op.
  std::unique_ptr<Group> host_level, cross_level;
  // Declared last: destroyed first, so queued ops finish while the rest lives.
  std::unique_ptr<Worker> p2p_worker;
  std::unique_ptr<Worker> worker;

  std::string broken_reason() {
    std::lock_guard<std::mutex> lock(broken_mutex);
    return broken;
  }
  void mark_broken(const std::string& why) {
    std::lock_guard<std::mutex> lock(broken_mutex);
    if (broken.empty()) broken = why;
  }

  // " Suspect: rank 1 (...)." for the world ranks of this group whose
  // heartbeat went stale, or empty: who to blame when an op timed out.
  std::string suspects() const {
    if (!kv) return {};
    std::vector<int> others;
    for (int member = 0; member < size; ++member) {
      if (member != rank) others.push_back(global_ranks[member]);
    }
    std::string found;
    try {
      found = scan_heartbeats(*kv, round, others).describe();
    } catch (const std::exception&) {
      return {};  // the store is gone too; nothing to compare against
    }
    return found.empty() ? found : str_cat(" Suspect: ", found, ".");
  }

  OpContext op_context(const char* op, uint64_t seq_no, Timeout op_timeout) {
    OpContext oc;
    oc.ctx = ctx.get();
    oc.rank = rank;
    oc.size = size;
    oc.op = op;
    oc.seq = seq_no;
    oc.group_name = &name;
    oc.global_ranks = &global_ranks;
    oc.ranks_per_node = ranks_per_node;
    oc.deadline = Clock::now() + (op_timeout.count() > 0 ? op_timeout : timeout);
    oc.segment_bytes = segment_bytes;
    oc.one_round_bytes = one_round_bytes;
    oc.scratch = &scratch;
    oc.shm = shm.get();
    oc.mpi = mpi.get();
    if (host_level) {
      oc.host = std::make_shared<OpContext>(host_level->op_context(op, seq_no, op_timeout));
      oc.cross = std::make_shared<OpContext>(cross_level->op_context(op, seq_no, op_timeout));
    }
    return oc;
  }
};

// ---- OpContext -----------------------------------------------------------------

std::string OpContext::describe(int peer) const {
  std::string text = str_cat(op, " #", seq, " on group '", *group_name, "' failed on rank ", rank,
                             " (global ", (*global_ranks)[rank], ")");
  if (peer < 0) return text;
  const int global = (*global_ranks)[peer];
  text += str_cat(" with peer rank ", peer, " (global ", global);
  if (ranks_per_node > 0) {
    const int node = global / ranks_per_node;
    text += str_cat(", on node ", node, ": global ranks ", node * ranks_per_node, "..",
                    (node + 1) * ranks_per_node - 1);
  }
  return text + ")";
}

namespace {

// Runs one transport call of an op and turns Gloo's exceptions into ours:
// TimeoutError when the deadline passed, CommError when the peer went away.
template <typename F>
void translated(const OpContext& oc, int peer, const char* what, F&& call) {
  try {
    if (!call()) throw CommError(oc.describe(peer) + str_cat(": the ", what, " was aborted"));
  } catch (const gloo::IoException& e) {
    const std::string msg = e.what();
    if (mentions_timeout(msg)) {
      throw TimeoutError(str_cat(
          oc.describe(peer), ": timed out waiting to ", what,
          ". Hint: the peer may have died, hung, or issued collectives in another order; raise "
          "SHARDTRAIN_TIMEOUT_S if steps are legitimately this slow. (gloo: ",
          msg, ")"));
    }
    throw CommError(str_cat(oc.describe(peer), ": ", what, " failed: ", msg,
                            ". Hint: the peer probably exited; see its own output for why."));
  } catch (const gloo::Exception& e) {
    throw CommError(str_cat(oc.describe(peer), ": ", what, " failed: ", e.what()));
  }
}

std::chrono::milliseconds time_left(const OpContext& oc) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(oc.deadline - Clock::now());
  return std::max(left, std::chrono::milliseconds(1));
}

}  // namespace

void OpContext::send(gloo::transport::UnboundBuffer& buf, int peer, uint64_t slot, size_t offset,
                     size_t nbytes) const {
  translated(*this, peer, "send", [&] {
    buf.send(peer, slot, offset, nbytes);
    return true;
  });
}

void OpContext::recv(gloo::transport::UnboundBuffer& buf, int peer, uint64_t slot, size_t offset,
                     size_t nbytes) const {
  translated(*this, peer, "receive", [&] {
    buf.recv(peer, slot, offset, nbytes);
    return true;
  });
}

void OpContext::wait_recv(gloo::transport::UnboundBuffer& buf, int peer) const {
  translated(*this, peer, "receive", [&] { return buf.waitRecv(nullptr, time_left(*this)); });
}

void OpContext::wait_send(gloo::transport::UnboundBuffer& buf, int peer) const {
  translated(*this, peer, "send", [&] { return buf.waitSend(nullptr, time_left(*this)); });
}

namespace {

DType dtype_of(const at::Tensor& t, const char* op, const char* arg) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::Float32;
    case at::kDouble: return DType::Float64;
    case at::kBFloat16: return DType::BFloat16;
    case at::kHalf: return DType::Float16;
    case at::kInt: return DType::Int32;
    case at::kLong: return DType::Int64;
    default: break;
  }
  ST_CHECK(false, InvalidArgument, op, ": ", arg, " has dtype ", t.scalar_type(),
           "; supported: float32, float64, bfloat16, float16, int32, int64");
  return DType::Float32;
}

DType check_tensor(const at::Tensor& t, const char* op, const char* arg) {
  ST_CHECK(t.defined(), InvalidArgument, op, ": ", arg, " is an undefined tensor");
  ST_CHECK(t.device().is_cpu(), InvalidArgument, op, ": ", arg, " is on ", t.device(),
           "; collectives move CPU tensors only");
  ST_CHECK(t.is_contiguous(), InvalidArgument, op, ": ", arg,
           " is not contiguous; pass a flat contiguous buffer (call .contiguous())");
  return dtype_of(t, op, arg);
}

void check_op(ReduceOp op, DType dtype, const char* name) {
  ST_CHECK(op != ReduceOp::Avg || dtype == DType::Float32 || dtype == DType::Float64 ||
               dtype == DType::BFloat16 || dtype == DType::Float16,
           InvalidArgument, name, ": avg is defined for floating-point tensors only; got ",
           to_string(dtype), ". Use sum and divide.");
}

char* bytes(const at::Tensor& t) { return static_cast<char*>(t.data_ptr()); }

// A TCP device bound to the address other ranks reach this one at
// (interface.h says which), recorded in `chosen`.
std::shared_ptr<gloo::transport::Device> make_device(const std::string& master_addr,
                                                     Endpoint& chosen) {
  chosen = choose_endpoint(master_addr);
  gloo::transport::tcp::attr attr;
  if (chosen.named) {
    attr.iface = chosen.iface;
  } else {
    attr.hostname = chosen.address;
  }
  try {
    return gloo::transport::tcp::CreateDevice(attr);
  } catch (const std::exception& e) {
    throw CommError(str_cat("cannot open a TCP device on ", chosen.iface, " ", chosen.address,
                            " (", chosen.why, "): ", e.what(),
                            ". Hint: set SHARDTRAIN_SOCKET_IFNAME to the interface the ranks "
                            "share."));
  }
}

// Announces `rank` under `prefix` and waits for all `size` ranks, saying
// every ~10 s which are missing, so a peer that never comes is visible long
// before the timeout.
void join(KvStore& kv, const std::string& prefix, int rank, int size, Timeout timeout) {
  std::vector<std::string> keys;
  for (int i = 0; i < size; ++i) keys.push_back(str_cat(prefix, "/joined/", i));
  kv.set(keys[rank], "1");
  const auto start = Clock::now();
  const auto deadline = start + timeout;
  int64_t said = -1;  // the waited second the last line gave: one line per second at most
  for (;;) {
    // Rounded up: a wait rounded down ends just before the deadline, again
    // and again, each time with the same line to say.
    const auto left = std::chrono::ceil<Timeout>(deadline - Clock::now());
    if (kv.wait(keys, std::clamp(left, Timeout(0), Timeout(std::chrono::seconds(10))))) return;
    std::string missing;
    int count = 0;
    for (int i = 0; i < size; ++i) {
      if (kv.try_get(keys[i])) continue;
      if (++count <= 16) missing += str_cat(count > 1 ? ", " : "", i);
    }
    if (count == 0) return;
    if (count > 16) missing += str_cat(" and ", count - 16, " more");
    const auto waited = std::chrono::duration_cast<std::chrono::seconds>(Clock::now() - start);
    if (Clock::now() >= deadline) {
      throw TimeoutError(str_cat(
          "rank ", rank, ": rank", count > 1 ? "s " : " ", missing, " of ", size,
          " never joined the rendezvous at ", kv.where(), " (waited ", waited.count(),
          " s). Hint: check that they were started, with the same MASTER_ADDR/MASTER_PORT, "
          "WORLD_SIZE and SHARDTRAIN_JOB_TOKEN; SHARDTRAIN_TIMEOUT_S sets how long to wait"));
    }
    if (waited.count() == said) continue;
    said = waited.count();
    std::cerr << str_cat("shardtrain: rank ", rank, " waiting for rank", count > 1 ? "s " : " ",
                         missing, " of ", size, " to join (", waited.count(), " s of ",
                         std::chrono::duration_cast<std::chrono::seconds>(timeout).count(),
                         " s)\n");
  }
}

// Connects `rank` of `size` over the store under `prefix`.
std::shared_ptr<gloo::rendezvous::Context> connect(gloo::rendezvous::Store& store,
                                                   const std::string& prefix,
                                                   std::shared_ptr<gloo::transport::Device>& device,
                                                   int rank, int size, Timeout timeout,
                                                   const std::string& group_name) {
  auto ctx = std::make_shared<gloo::rendezvous::Context>(rank, size);
  ctx->setTimeout(timeout);
  gloo::rendezvous::PrefixStore prefixed(prefix, store);
  try {
    ctx->connectFullMesh(prefixed, device);
  } catch (const CommError&) {
    throw;  // the store already named what is missing
  } catch (const std::exception& e) {
    throw_comm_error(e, str_cat("connecting group '", group_name, "' failed on rank ", rank, " of ",
                                size, ": ", first_line(e),
                                ". Hint: check that every rank started and can reach the others "
                                "(SHARDTRAIN_SOCKET_IFNAME)."));
  }
  return ctx;
}

// A level of `parent` for hierarchical collectives: the listed group ranks,
// connected under the parent's store prefix + "/" + tag, no thread of its own.
std::unique_ptr<Group> level_group(Group& parent, const std::vector<int>& members,
                                   const std::string& tag) {
  auto group = std::make_unique<Group>();
  group->rank = static_cast<int>(std::find(members.begin(), members.end(), parent.rank) - members.begin());
  group->size = static_cast<int>(members.size());
  group->global_ranks.clear();
  std::string list;
  for (int r : members) {
    group->global_ranks.push_back(parent.global_ranks[r]);
    list += (list.empty() ? "" : ",") + std::to_string(parent.global_ranks[r]);
  }
  group->name = str_cat(parent.name, "/", tag, "[", list, "]");
  group->timeout = parent.timeout;
  group->segment_bytes = parent.segment_bytes;
  group->one_round_bytes = parent.one_round_bytes;
  group->kv = parent.kv;
  group->store = parent.store;
  group->round = parent.round;
  group->device = parent.device;
  group->endpoint = parent.endpoint;
  group->ranks_per_node = parent.ranks_per_node;
  group->store_prefix = str_cat(parent.store_prefix, "/", tag);
  group->ctx = connect(*group->store, group->store_prefix, group->device, group->rank, group->size,
                       group->timeout, group->name);
  group->shm = ShmChannel::open(group->op_context("shared-memory setup", 0, group->timeout));
  return group;
}

// Gives a group spread over several hosts with k > 1 ranks on each its two
// levels (hierarchical.cpp), unless SHARDTRAIN_HIERARCHICAL=0. Every rank
// calls it; they first agree that the variable is set alike everywhere.
void open_levels(Group& g) {
  const bool wanted = hierarchical_from_env();  // a bad value is refused on every layout
  if (g.size < 2 || g.shm) return;  // one rank, or every rank on this host
  const std::optional<Levels> levels = plan_levels(g.global_ranks, g.rank, g.ranks_per_node);
  if (!levels) return;
  OpContext oc = g.op_context("hierarchical setup", 0, g.timeout);
  oc.phase = 6;  // slots of its own: never those of a numbered op
  std::vector<int64_t> on(static_cast<size_t>(g.size), 0);
  on[g.rank] = wanted ? 1 : 0;
  ring_all_gather(oc, on.data(), g.size, DType::Int64);
  ST_CHECK(std::all_of(on.begin(), on.end(), [&](int64_t v) { return v == on[0]; }), ConfigError,
           "SHARDTRAIN_HIERARCHICAL differs between the ranks of group '", g.name,
           "'; set it alike on every rank (or unset it everywhere)");
  if (on[0] == 0) return;
  g.host_level = level_group(g, levels->host, str_cat("host", levels->host_index));
  g.cross_level = level_group(g, levels->cross, str_cat("cross", levels->local_index));
}

}  // namespace
}  // namespace detail

// ---- Work ------------------------------------------------------------------------

Work::Work(std::shared_ptr<detail::WorkState> state) : state_(std::move(state)) {}

void Work::wait() const {
  ST_CHECK(state_ != nullptr, InvalidArgument, "wait() on an empty Work");
  state_->wait();
}

bool Work::is_completed() const { return state_ == nullptr || state_->is_completed(); }

std::exception_ptr Work::exception() const {
  return state_ == nullptr ? nullptr : state_->exception();
}

// ---- options -----------------------------------------------------------------------

CommOptions CommOptions::from_env() {
  const dist::ClusterEnv env = dist::ClusterEnv::detect();
  CommOptions options;
  options.rank(env.rank).world_size(env.world_size).master_addr(env.master_addr)
      .master_port(env.master_port);
  options.timeout(detail::timeout_from_env(options.timeout()));
  options.round(env.restart_count).job_token(detail::job_token_from_env());
  if (const char* store = std::getenv("SHARDTRAIN_STORE")) options.store(store);
  if (const char* init = std::getenv("SHARDTRAIN_INIT_METHOD"); init != nullptr && *init != '\0')
    options.init_method(init);
  options.segment_bytes(detail::byte_count_from_env("SHARDTRAIN_SEGMENT_BYTES", options.segment_bytes(), 1));
  if (const char* backend = std::getenv("SHARDTRAIN_BACKEND"); backend != nullptr && *backend != '\0')
    options.backend(enum_from_name<Backend>(backend, "SHARDTRAIN_BACKEND"));
  return options;
}

int64_t detail::byte_count_from_env(const char* name, int64_t fallback, int64_t least) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  const long long value = std::strtoll(v, &end, 10);
  ST_CHECK(end != v && *end == '\0' && value >= least, ConfigError, name, "='", v,
           "' is not a byte count of at least ", least);
  return value;
}

// ---- Communicator ------------------------------------------------------------------

std::shared_ptr<Communicator> Communicator::create(const CommOptions& options) {
  const bool mpi = options.backend() == Backend::Mpi ||
                  (options.backend() == Backend::Auto && detail::started_by_mpi_launcher());
  ST_CHECK(!mpi || options.world_size() == 1 || detail::started_by_mpi_launcher(), ConfigError,
           "the mpi backend needs a job started by mpirun or srun --mpi=pmix, but this process "
           "was not. Hint: start it with `mpirun -np N ...`, or use distributed.backend: gloo");
  ST_CHECK(options.world_size() >= 1, ConfigError, "world size ", options.world_size(),
           " must be at least 1");
  ST_CHECK(options.rank() >= 0 && options.rank() < options.world_size(), ConfigError, "rank ",
           options.rank(), " is outside 0..", options.world_size() - 1);
  ST_CHECK(options.timeout().count() > 0, ConfigError, "timeout must be positive");
  ST_CHECK(options.segment_bytes() > 0, ConfigError, "segment_bytes must be positive");

  auto group = std::make_unique<detail::Group>();
  group->rank = options.rank();
  group->size = options.world_size();
  group->global_ranks.resize(options.world_size());
  for (int i = 0; i < options.world_size(); ++i) group->global_ranks[i] = i;
  group->timeout = options.timeout();
  group->segment_bytes = options.segment_bytes();
  group->one_round_bytes = detail::byte_count_from_env("SHARDTRAIN_ONE_ROUND_BYTES", detail::kOneRoundBytes, 0);
  if (group->size > 1 && mpi) {
    group->mpi = detail::MpiComm::world(group->rank, group->size);
    group->worker = std::make_unique<detail::Worker>();
  } else if (group->size > 1) {
    ST_CHECK(!options.master_addr().empty(), ConfigError,
             "the job spans several nodes and MASTER_ADDR is unset, but the gloo backend needs "
             "rank 0's host. Hint: mpirun -x MASTER_ADDR=<host of rank 0>, or "
             "distributed.backend: mpi");
    group->kv = detail::open_store(options);
    group->store = detail::gloo_store(group->kv, options.timeout());
    group->round = options.round();
    // Gloo writes to its sockets without MSG_NOSIGNAL: a peer that died must
    // fail the op that wrote to it (and name that peer), not kill this rank
    // with SIGPIPE. A handler the program installed is left alone.
    struct sigaction pipe_action {};
    if (::sigaction(SIGPIPE, nullptr, &pipe_action) == 0 && pipe_action.sa_handler == SIG_DFL) {
      ::signal(SIGPIPE, SIG_IGN);
    }
    group->device = detail::make_device(options.master_addr(), group->endpoint);
    // Launchers start the same number of ranks on every node (LOCAL_WORLD_SIZE),
    // unless they say that nodes differ (SHARDTRAIN_NODE_SIZES): the
    // collectives then stay flat rings, since the hierarchical levels need
    // the same ranks on every host.
    const char* local = std::getenv("LOCAL_WORLD_SIZE");
    if (local != nullptr && dist::node_sizes_from_env().empty()) {
      const int n = std::atoi(local);
      if (n > 0 && n < group->size && group->size % n == 0) group->ranks_per_node = n;
    }
    group->store_prefix = detail::world_prefix(options.round());
    detail::join(*group->kv, group->store_prefix, group->rank, group->size, group->timeout);
    group->heartbeat = std::make_unique<detail::Heartbeat>(
        group->kv, detail::heartbeat_key(group->round, group->rank));
    group->ctx = detail::connect(*group->store, group->store_prefix, group->device, group->rank,
                                 group->size, group->timeout, group->name);
    group->shm = detail::ShmChannel::open(group->op_context("shared-memory setup", 0, group->timeout));
    detail::open_levels(*group);
    group->worker = std::make_unique<detail::Worker>();
  }
  return std::shared_ptr<Communicator>(new Communicator(std::move(group)));
}

Communicator::Communicator(std::unique_ptr<detail::Group> group) : group_(std::move(group)) {}
Communicator::~Communicator() = default;

int Communicator::rank() const { return group_->rank; }
int Communicator::size() const { return group_->size; }
const std::string& Communicator::name() const { return group_->name; }
const std::vector<int>& Communicator::global_ranks() const { return group_->global_ranks; }
std::string Communicator::endpoint() const {
  if (group_->mpi) return "MPI: " + group_->mpi->describe();
  const auto& e = group_->endpoint;
  if (e.address.empty()) return {};
  return str_cat(e.iface, " ", e.address, " (", e.why, ")",
                 group_->shm ? "; collectives among the ranks of this host through shared memory" : "",
                 group_->host_level ? str_cat("; hierarchical across hosts: ", group_->host_level->size,
                                              " ranks per host, one ring across hosts per local rank")
                                    : "");
}
double Communicator::busy_seconds() const { return static_cast<double>(group_->busy_ns.load()) * 1e-9; }

uint64_t Communicator::sequence_number() const { return group_->seq.load(); }

Communicator::PathCounts Communicator::path_counts() const {
  if (!group_->shm) return {};
  return {group_->shm->in_place_ops(), group_->shm->staged_ops()};
}

namespace {

// Runs one collective: inline for a world of one, else on the group's
// communication thread. The first failure breaks the group for good: a ring
// that lost a message cannot be trusted to line up again.
Work run_collective(detail::Group& g, const char* op, Timeout timeout, bool async,
                    std::function<void(const detail::OpContext&)> body) {
  const uint64_t seq = g.seq.fetch_add(1);
  auto state = std::make_shared<detail::WorkState>();
  auto task = [&g, op, seq, timeout, state, body = std::move(body)] {
    std::exception_ptr error;
    try {
      const std::string broken = g.broken_reason();
      if (!broken.empty()) {
        error = std::make_exception_ptr(CommError(str_cat(
            op, " #", seq, " on group '", g.name, "' was not run: the group failed earlier (",
            broken, "). Hint: restart the job; a failed collective leaves peers out of step.")));
      } else {
        const auto start = std::chrono::steady_clock::now();
        try {
          body(g.op_context(op, seq, timeout));
        } catch (const TimeoutError& e) {
          // A peer that never answered: name the ranks whose heartbeat stopped.
          const std::string text = e.what() + g.suspects();
          g.mark_broken(text);
          error = std::make_exception_ptr(TimeoutError(text));
        } catch (const std::exception& e) {
          g.mark_broken(e.what());
          error = std::current_exception();
        }
        // MPI cannot cancel a collective that failed: it may still write into
        // the op's tensors (which `body` holds) when a late peer arrives, so
        // they must outlive it. The group is broken; they are leaked.
        if (error && g.mpi) (void)new std::function<void(const detail::OpContext&)>(body);
        g.busy_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(
                         std::chrono::steady_clock::now() - start)
                         .count();
      }
    } catch (...) {
      error = std::current_exception();  // never leave a Work unfinished
    }
    state->finish(error);
  };
  if (g.size == 1) {
    task();
  } else {
    g.worker->push(std::move(task));
  }
  Work work(state);
  if (!async) work.wait();
  return work;
}

}  // namespace

namespace {

// All-reduce in place by whichever path the group has: MPI, hierarchical
// across hosts, shared memory on one host, one round for a small buffer,
// else the ring.
void all_reduce_in_place(const detail::OpContext& oc, char* buf, int64_t n, detail::DType dtype, ReduceOp op) {
  if (oc.size == 1) return;  // x op nothing = x, and avg over one rank divides by 1
  if (oc.mpi != nullptr) return oc.mpi->all_reduce(oc, buf, n, dtype, op);
  if (oc.host != nullptr) return detail::hierarchical_all_reduce(oc, buf, n, dtype, op);
  if (oc.shm != nullptr) {
    oc.shm->all_reduce(oc, buf, n, dtype, op);
    return;
  }
  detail::tcp_all_reduce(oc, buf, n, dtype, op);
}

}  // namespace

at::Tensor Communicator::allocate(int64_t numel, at::ScalarType dtype) {
  ST_CHECK(numel >= 0, InvalidArgument, "allocate: numel ", numel, " is negative");
  const auto options = at::TensorOptions().dtype(dtype);
  const size_t bytes = static_cast<size_t>(numel) *
                       detail::element_size(detail::check_tensor(at::empty({0}, options), "allocate", "dtype"));
  if (!group_->shm) return at::zeros({numel}, options);
  std::shared_ptr<detail::ShmChannel::Region> region;
  run_collective(*group_, "allocate", Timeout(0), false, [&region, bytes](const detail::OpContext& oc) {
    region = oc.shm->allocate(oc, bytes);
  });
  if (!region) return at::zeros({numel}, options);
  return at::from_blob(region->mine(), {numel}, [region](void*) {}, options);
}

Work Communicator::all_reduce(const at::Tensor& tensor, const AllReduceOptions& options) {
  const detail::DType dtype = detail::check_tensor(tensor, "all_reduce", "tensor");
  detail::check_op(options.op(), dtype, "all_reduce");
  const ReduceOp op = options.op();
  return run_collective(*group_, "all_reduce", options.timeout(), options.async(),
                        [tensor, dtype, op](const detail::OpContext& oc) {
    all_reduce_in_place(oc, detail::bytes(tensor), tensor.numel(), dtype, op);
  });
}

Work Communicator::reduce_scatter(const at::Tensor& input, const at::Tensor& output,
                                  const ReduceScatterOptions& options) {
  const detail::DType dtype = detail::check_tensor(input, "reduce_scatter", "input");
  ST_CHECK(detail::check_tensor(output, "reduce_scatter", "output") == dtype, InvalidArgument,
           "reduce_scatter: output dtype ", output.scalar_type(), " differs from input dtype ",
           input.scalar_type());
  detail::check_op(options.op(), dtype, "reduce_scatter");
  const ShardRange mine = shard_range(input.numel(), size(), rank());
  ST_CHECK(output.numel() == mine.count, InvalidArgument, "reduce_scatter: output has ",
           output.numel(), " elements but rank ", rank(), "'s shard of ", input.numel(),
           " elements over ", size(), " ranks has ", mine.count, " (see shard_range)");
  const ReduceOp op = options.op();
  return run_collective(*group_, "reduce_scatter", options.timeout(), options.async(),
                        [input, output, dtype, op](const detail::OpContext& oc) {
    const int64_t n = input.numel();
    if (oc.size == 1) {
      if (n > 0) std::memcpy(detail::bytes(output), detail::bytes(input), n * detail::element_size(dtype));
      return;
    }
    if (oc.mpi != nullptr) {
      oc.mpi->reduce_scatter(oc, detail::bytes(input), detail::bytes(output), n, dtype, op);
    } else if (oc.host != nullptr) {
      detail::hierarchical_reduce_scatter(oc, detail::bytes(input), detail::bytes(output), n, dtype, op);
    } else if (oc.shm != nullptr) {
      oc.shm->reduce_scatter(oc, detail::bytes(input), detail::bytes(output), n, dtype, op);
    } else {
      detail::ring_reduce_scatter(oc, detail::bytes(input), detail::bytes(output), n, dtype, op);
    }
  });
}

Work Communicator::all_gather(const at::Tensor& input, const at::Tensor& output,
                              const AllGatherOptions& options) {
  const detail::DType dtype = detail::check_tensor(output, "all_gather", "output");
  ST_CHECK(detail::check_tensor(input, "all_gather", "input") == dtype, InvalidArgument,
           "all_gather: input dtype ", input.scalar_type(), " differs from output dtype ",
           output.scalar_type());
  const ShardRange mine = shard_range(output.numel(), size(), rank());
  ST_CHECK(input.numel() == mine.count, InvalidArgument, "all_gather: input has ", input.numel(),
           " elements but rank ", rank(), "'s shard of ", output.numel(), " elements over ",
           size(), " ranks has ", mine.count, " (see shard_range)");
  return run_collective(*group_, "all_gather", options.timeout(), options.async(),
                        [input, output, dtype, mine](const detail::OpContext& oc) {
    if (oc.host != nullptr) {
      return detail::hierarchical_all_gather(oc, detail::bytes(input), detail::bytes(output),
                                             output.numel(), dtype);
    }
    const size_t es = detail::element_size(dtype);
    char* own = detail::bytes(output) + mine.offset * es;
    if (mine.count > 0 && own != detail::bytes(input))
      std::memcpy(own, detail::bytes(input), mine.count * es);
    if (oc.size == 1) return;
    if (oc.mpi != nullptr) {
      oc.mpi->all_gather(oc, detail::bytes(output), output.numel(), dtype);
    } else if (oc.shm != nullptr) {
      oc.shm->all_gather(oc, detail::bytes(output), output.numel(), dtype);
    } else {
      detail::ring_all_gather(oc, detail::bytes(output), output.numel(), dtype);
    }
  });
}

namespace {

// Elements per row along dim 0 of an all_to_all tensor.
int64_t row_width(const at::Tensor& t, const char* arg) {
  ST_CHECK(t.dim() >= 1, InvalidArgument, "all_to_all: ", arg,
           " is a 0-d tensor; splits count rows along dim 0, so give it at least one dimension");
  int64_t row = 1;
  for (int64_t d = 1; d < t.dim(); ++d) row *= t.size(d);
  return row;
}

void check_splits(const std::vector<int64_t>& splits, const at::Tensor& t, int size, const char* name) {
  ST_CHECK(static_cast<int>(splits.size()) == size, InvalidArgument, "all_to_all: ", name, " has ",
           splits.size(), " entries for a group of ", size, "; give one count of rows per group rank");
  int64_t sum = 0;
  for (size_t j = 0; j < splits.size(); ++j) {
    ST_CHECK(splits[j] >= 0, InvalidArgument, "all_to_all: ", name, "[", j, "] is ", splits[j],
             "; counts of rows cannot be negative");
    sum += splits[j];
  }
  ST_CHECK(sum == t.size(0), InvalidArgument, "all_to_all: ", name, " sum to ", sum, " rows but the tensor has ",
           t.size(0), " along dim 0; make them add up to its rows");
}

}  // namespace

Work Communicator::all_to_all(const at::Tensor& input, std::vector<int64_t> input_splits,
                              const at::Tensor& output, std::vector<int64_t> output_splits,
                              const AllToAllOptions& options) {
  const detail::DType dtype = detail::check_tensor(input, "all_to_all", "input");
  ST_CHECK(detail::check_tensor(output, "all_to_all", "output") == dtype, InvalidArgument,
           "all_to_all: output dtype ", output.scalar_type(), " differs from input dtype ", input.scalar_type());
  const int64_t row = row_width(input, "input");
  ST_CHECK(row_width(output, "output") == row, InvalidArgument, "all_to_all: output rows have ",
           row_width(output, "output"), " elements but input rows ", row, "; give both the same shape after dim 0");
  check_splits(input_splits, input, size(), "input_splits");
  check_splits(output_splits, output, size(), "output_splits");
  ST_CHECK(size() > 1 || input_splits[0] == output_splits[0], InvalidArgument,
           "all_to_all: a rank alone sends itself ", input_splits[0], " rows but expects ", output_splits[0],
           "; give input and output the same rows");
  const size_t es = detail::element_size(dtype);
  const char* in_lo = detail::bytes(input);
  const char* out_lo = detail::bytes(output);
  ST_CHECK(input.numel() == 0 || output.numel() == 0 || in_lo + input.numel() * es <= out_lo ||
               out_lo + output.numel() * es <= in_lo,
           InvalidArgument, "all_to_all: input and output overlap; give the output a buffer of its own");
  return run_collective(*group_, "all_to_all", options.timeout(), options.async(),
                        [input, output, dtype, row, in_splits = std::move(input_splits),
                         out_splits = std::move(output_splits)](const detail::OpContext& oc) {
    if (oc.size == 1) {
      if (input.numel() > 0) std::memcpy(detail::bytes(output), detail::bytes(input), input.numel() * detail::element_size(dtype));
      return;
    }
    const detail::AllToAllPlan plan = detail::agree_all_to_all(oc, dtype, row, in_splits, out_splits);
    detail::OpContext data = oc;
    data.phase = 1;  // slots of its own, apart from the agreement's
    if (oc.mpi != nullptr) {
      oc.mpi->all_to_all(data, detail::bytes(input), detail::bytes(output), plan, dtype);
    } else if (oc.shm != nullptr) {
      oc.shm->all_to_all(data, detail::bytes(input), detail::bytes(output), plan, dtype);
    } else {
      detail::pairwise_all_to_all(data, detail::bytes(input), detail::bytes(output), plan, dtype);
    }
  });
}

Work Communicator::broadcast(const at::Tensor& tensor, const BroadcastOptions& options) {
  const detail::DType dtype = detail::check_tensor(tensor, "broadcast", "tensor");
  const int root = options.root();
  ST_CHECK(root >= 0 && root < size(), InvalidArgument, "broadcast: root ", root,
           " is outside 0..", size() - 1);
  return run_collective(*group_, "broadcast", options.timeout(), options.async(),
                        [tensor, dtype, root](const detail::OpContext& oc) {
    if (oc.size == 1) return;
    if (oc.mpi != nullptr) {
      oc.mpi->broadcast(oc, detail::bytes(tensor), tensor.numel(), dtype, root);
    } else if (oc.shm != nullptr) {
      oc.shm->broadcast(oc, detail::bytes(tensor), tensor.numel(), dtype, root);
    } else {
      detail::chain_broadcast(oc, detail::bytes(tensor), tensor.numel(), dtype, root);
    }
  });
}

void Communicator::barrier(const BarrierOptions& options) {
  // Through shared memory when every rank is on this host; else a
  // one-element all-reduce: it returns on a rank only after every rank's
  // contribution arrived, which is what a barrier promises.
  auto token = std::make_shared<float>(0.0f);
  run_collective(*group_, "barrier", options.timeout(), false,
                 [token](const detail::OpContext& oc) {
    if (oc.size == 1) return;
    if (oc.mpi != nullptr) return oc.mpi->barrier(oc);
    if (oc.shm != nullptr) return oc.shm->barrier(oc);
    all_reduce_in_place(oc, reinterpret_cast<char*>(token.get()), 1, detail::DType::Float32, ReduceOp::Sum);
  });
}

namespace {

// Point-to-point ops are posted on the caller's thread at once (Gloo matches
// a send with its recv by tag), and a second thread waits for completion, so
// a rank may post a send before the matching recv without deadlocking.
Work run_p2p(detail::Group& g, const char* op, const at::Tensor& tensor, int peer,
             const P2POptions& options, bool is_send) {
  ST_CHECK(g.size > 1, InvalidArgument, op, " needs a group of at least two ranks");
  ST_CHECK(peer >= 0 && peer < g.size && peer != g.rank, InvalidArgument, op, ": peer ", peer,
           " must be another rank in 0..", g.size - 1);
  const std::string broken = g.broken_reason();
  ST_CHECK(broken.empty(), CommError, op, " on group '", g.name,
           "' refused: the group failed earlier (", broken, ")");
  const size_t nbytes = tensor.numel() * detail::element_size(detail::check_tensor(tensor, op, "tensor"));
  const detail::OpContext oc = g.op_context(op, g.p2p_seq++, options.timeout());
  // What the waiting thread completes: an MPI request, or a Gloo buffer.
  std::shared_ptr<detail::MpiRequest> request;
  std::shared_ptr<gloo::transport::UnboundBuffer> ub;
  if (g.mpi) {
    request = g.mpi->post(oc, detail::bytes(tensor), nbytes, peer, options.tag(), is_send);
  } else {
    // High bit set: p2p slots never collide with collective slots.
    const uint64_t slot = (uint64_t{1} << 63) | options.tag();
    ub = g.ctx->createUnboundBuffer(detail::bytes(tensor), std::max<size_t>(1, nbytes));
    if (nbytes > 0) {
      if (is_send) oc.send(*ub, peer, slot, 0, nbytes); else oc.recv(*ub, peer, slot, 0, nbytes);
    }
  }
  if (!g.p2p_worker) g.p2p_worker = std::make_unique<detail::Worker>();
  auto state = std::make_shared<detail::WorkState>();
  g.p2p_worker->push([&g, oc, peer, nbytes, is_send, tensor, ub, request, state] {
    std::exception_ptr error;
    try {
      if (request) {
        g.mpi->wait(oc, *request, peer);
      } else if (nbytes > 0) {
        if (is_send) oc.wait_send(*ub, peer); else oc.wait_recv(*ub, peer);
      }
    } catch (const std::exception& e) {
      g.mark_broken(e.what());
      error = std::current_exception();
      if (request) (void)new at::Tensor(tensor);  // MPI may still use it; see run_collective
    } catch (...) {
      error = std::current_exception();  // never leave a Work unfinished
      if (request) (void)new at::Tensor(tensor);
    }
    state->finish(error);
  });
  return Work(state);
}

}  // namespace

Work Communicator::send(const at::Tensor& tensor, int dst, const P2POptions& options) {
  return run_p2p(*group_, "send", tensor, dst, options, true);
}

Work Communicator::recv(const at::Tensor& tensor, int src, const P2POptions& options) {
  return run_p2p(*group_, "recv", tensor, src, options, false);
}

std::shared_ptr<Communicator> Communicator::new_group(std::vector<int> ranks) {
  std::sort(ranks.begin(), ranks.end());
  ST_CHECK(!ranks.empty() && std::adjacent_find(ranks.begin(), ranks.end()) == ranks.end() &&
               ranks.front() >= 0 && ranks.back() < size(),
           InvalidArgument, "new_group: ranks must be distinct members of 0..", size() - 1);
  detail::Group& parent = *group_;
  const uint64_t id = ++parent.groups_created;
  const auto it = std::find(ranks.begin(), ranks.end(), parent.rank);
  // Under MPI every rank of the parent takes part in the split, members or
  // not, on the parent's communication thread: an MPI communicator runs one
  // collective at a time, and the parent's may still be running.
  std::unique_ptr<detail::MpiComm> mpi;
  if (parent.mpi) {
    const bool member = it != ranks.end();
    auto done = std::make_shared<std::promise<void>>();
    parent.worker->push([&parent, &mpi, member, done] {
      try {
        mpi = parent.mpi->split(member, parent.rank);
        done->set_value();
      } catch (...) {
        done->set_exception(std::current_exception());
      }
    });
    done->get_future().get();
  }
  if (it == ranks.end()) return nullptr;

  auto group = std::make_unique<detail::Group>();
  group->rank = static_cast<int>(it - ranks.begin());
  group->size = static_cast<int>(ranks.size());
  group->global_ranks.clear();
  std::string list;
  for (int r : ranks) {
    group->global_ranks.push_back(parent.global_ranks[r]);
    list += (list.empty() ? "" : ",") + std::to_string(parent.global_ranks[r]);
  }
  group->name = str_cat(parent.name == "world" ? "" : parent.name + "/", "group", id, "[", list, "]");
  group->timeout = parent.timeout;
  group->segment_bytes = parent.segment_bytes;
  group->one_round_bytes = parent.one_round_bytes;
  if (group->size > 1 && mpi) {
    group->mpi = std::move(mpi);
    group->ranks_per_node = parent.ranks_per_node;
    group->worker = std::make_unique<detail::Worker>();
  } else if (group->size > 1) {
    group->kv = parent.kv;
    group->store = parent.store;
    group->round = parent.round;
    group->device = parent.device;
    group->endpoint = parent.endpoint;
    group->ranks_per_node = parent.ranks_per_node;
    group->store_prefix = str_cat(parent.store_prefix, "/group", id);
    group->ctx = detail::connect(*group->store, group->store_prefix, group->device, group->rank,
                                 group->size, group->timeout, group->name);
    group->shm = detail::ShmChannel::open(group->op_context("shared-memory setup", 0, group->timeout));
    detail::open_levels(*group);
    group->worker = std::make_unique<detail::Worker>();
  }
  return std::shared_ptr<Communicator>(new Communicator(std::move(group)));
}

}  // namespace shardtrain::comm
