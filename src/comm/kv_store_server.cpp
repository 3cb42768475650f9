// The store server (StoreServer, kv_store.h): one thread's epoll loop serving
// every connection, the bounds on connections that have not proved the job
// token, and the waits peers ask for. The wire it speaks: kv_store_wire.h.
#include "comm/kv_store.h"

#include <netinet/tcp.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <list>
#include <mutex>
#include <set>
#include <thread>
#include <unordered_map>

#include "comm/kv_store_wire.h"
#include "shardtrain/core/error.h"

namespace shardtrain::comm::detail {

using ::shardtrain::detail::str_cat;
using namespace kv_wire;

namespace {

// Connections in all (further bounded by the descriptor limit), and
// those that have not proved the token yet: in all, and from one address.
constexpr int kMaxConnections = 16384;
constexpr int kMaxStrangers = 512;
constexpr int kMaxStrangersPerSource = 64;
// Refused connections are logged one line per this long at most.
constexpr Millis kLogEvery{10000};

bool parse_int(const std::string& text, int64_t& out) {
  if (text.empty()) return false;
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (errno != 0 || end != text.c_str() + text.size()) return false;
  out = v;
  return true;
}

}  // namespace

// ---- the host ---------------------------------------------------------------------
//
// One thread serves every connection from an epoll loop, so nothing grows
// with the number of connections a stranger opens: a connection's state is
// one entry of `conns`, erased when it closes. A connection that has not yet
// proved the token (a stranger) may stay kHandshakeTimeout; strangers are
// bounded per source address and in total, and a newcomer over either bound
// turns away the oldest stranger of the most crowded address, with kBusy so
// that one of our own peers caught in the crowd knows to try again. A flood
// or an idle horde from one host thus holds at most kMaxStrangersPerSource
// slots, and the job's own ranks, arriving from other addresses (or again,
// after kBusy), still get in.

struct StoreServer::Impl {
  struct Entry {
    std::string value;
    Clock::time_point set_at;
  };

  // One connection, as the loop sees it.
  struct Conn {
    int fd = -1;
    uint32_t source = 0;  // IPv4 address, network order
    std::string peer;
    bool proved = false;
    std::array<unsigned char, kNonceBytes> challenge{};
    Clock::time_point deadline;  // of the handshake
    std::list<int>::iterator queued;  // in `strangers`, while !proved
    std::string in, out;
    // A wait the peer asked for and that has not ended yet.
    bool waiting = false;
    std::vector<std::string> wait_keys;
    Clock::time_point wait_until;
  };

  std::string token;
  Log log;
  std::string where;
  int listen_fd = -1;
  int epoll_fd = -1;
  int wake_fd = -1;  // an eventfd: a local change or the stop
  int port = 0;
  int max_conns = kMaxConnections;
  int max_strangers = kMaxStrangers;

  // Shared with the callers of the local interface.
  std::mutex mu;
  std::condition_variable changed;
  std::unordered_map<std::string, Entry> map;
  bool stopping = false;
  std::atomic<int> refused{0};

  // The loop's own.
  std::unordered_map<int, Conn> conns;
  std::list<int> strangers;                   // oldest first
  std::unordered_map<uint32_t, int> crowd;    // strangers per source address
  std::set<int> waiters;
  bool dirty = false;                          // a key changed: re-check waiters
  Clock::time_point accept_paused_until{};
  bool accept_paused = false;
  Clock::time_point quiet_until{};             // refusals are logged at most every kLogEvery
  int unlogged = 0;
  std::thread loop;

  void poke() {
    const uint64_t one = 1;
    ssize_t ignored = ::write(wake_fd, &one, sizeof one);
    (void)ignored;
  }

  void put(const std::string& key, std::string value) {
    {
      std::lock_guard<std::mutex> lock(mu);
      map[key] = Entry{std::move(value), Clock::now()};
    }
    changed.notify_all();
  }

  std::optional<std::string> get(const std::string& key) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = map.find(key);
    if (it == map.end()) return std::nullopt;
    return it->second.value;
  }

  // nullopt when the stored value is not an integer.
  std::optional<int64_t> add(const std::string& key, int64_t delta) {
    int64_t sum = 0;
    {
      std::lock_guard<std::mutex> lock(mu);
      auto it = map.find(key);
      int64_t old = 0;
      if (it != map.end() && !parse_int(it->second.value, old)) return std::nullopt;
      sum = old + delta;
      map[key] = Entry{std::to_string(sum), Clock::now()};
    }
    changed.notify_all();
    return sum;
  }

  bool all_present(const std::vector<std::string>& keys) {
    for (const auto& k : keys)
      if (map.count(k) == 0) return false;
    return true;
  }

  bool wait(const std::vector<std::string>& keys, Millis timeout) {
    std::unique_lock<std::mutex> lock(mu);
    return changed.wait_for(lock, timeout, [&] { return stopping || all_present(keys); }) &&
           !stopping;
  }

  std::optional<int64_t> age(const std::string& key) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = map.find(key);
    if (it == map.end()) return std::nullopt;
    return std::chrono::duration_cast<Millis>(Clock::now() - it->second.set_at).count();
  }

  void run();
  int next_timeout_ms(Clock::time_point now) const;
  void accept_all(Clock::time_point now);
  bool make_room(uint32_t source);
  void admit(int fd, const sockaddr_in& addr, Clock::time_point now);
  void on_ready(Conn& c, uint32_t events);
  void on_proof(Conn& c);
  void serve_frames(Conn& c);
  void start_wait(Conn& c, std::vector<std::string> keys, int64_t timeout_ms);
  void check_waiters(Clock::time_point now);
  void expire(Clock::time_point now);
  bool flush(Conn& c);
  void close_conn(Conn& c);
  void turn_away(Conn& c, const std::string& why);
  void note_refusal(const std::string& text);
  std::string answer(const std::string& request, Conn& c, bool& ok);
};

// Sends what is queued for `c`; false when the peer is gone.
bool StoreServer::Impl::flush(Conn& c) {
  while (!c.out.empty()) {
    const ssize_t n = ::send(c.fd, c.out.data(), c.out.size(), MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    if (n <= 0) return false;
    c.out.erase(0, static_cast<size_t>(n));
  }
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLRDHUP | (c.out.empty() ? 0u : static_cast<uint32_t>(EPOLLOUT));
  ev.data.fd = c.fd;
  ::epoll_ctl(epoll_fd, EPOLL_CTL_MOD, c.fd, &ev);
  return true;
}

void StoreServer::Impl::close_conn(Conn& c) {
  if (!c.proved) {
    strangers.erase(c.queued);
    auto it = crowd.find(c.source);
    if (it != crowd.end() && --it->second <= 0) crowd.erase(it);
  }
  waiters.erase(c.fd);
  ::close(c.fd);  // also leaves the epoll set
  conns.erase(c.fd);
}

void StoreServer::Impl::note_refusal(const std::string& text) {
  ++refused;
  if (!log) return;
  // A flood must not become a flood of lines: one, then a count.
  const auto now = Clock::now();
  if (now < quiet_until) {
    ++unlogged;
    return;
  }
  log(text);
  quiet_until = now + kLogEvery;
}

// A stranger that must make room, or took too long: kBusy tells one of our
// own peers to try again.
void StoreServer::Impl::turn_away(Conn& c, const std::string& why) {
  ssize_t ignored = ::send(c.fd, kBusy, sizeof kBusy, MSG_NOSIGNAL | MSG_DONTWAIT);
  (void)ignored;
  note_refusal(str_cat("turned away a connection to the rendezvous store ", where, " from ",
                       c.peer, ": ", why));
  close_conn(c);
}

// Room for one more stranger from `source`; false when every slot holds a
// peer that proved the token.
bool StoreServer::Impl::make_room(uint32_t source) {
  const auto over = [&] {
    const auto it = crowd.find(source);
    return (it != crowd.end() && it->second >= kMaxStrangersPerSource) ||
           static_cast<int>(strangers.size()) >= max_strangers ||
           static_cast<int>(conns.size()) >= max_conns;
  };
  while (over()) {
    if (strangers.empty()) return false;
    // The most crowded address gives up its oldest: a flood from one host
    // evicts itself, not a rank arriving from another.
    uint32_t victim_source = source;
    const auto own = crowd.find(source);
    if (own == crowd.end() || own->second < kMaxStrangersPerSource) {
      int most = -1;
      for (const auto& [addr, n] : crowd) {
        if (n > most) most = n, victim_source = addr;
      }
    }
    for (int fd : strangers) {
      Conn& c = conns.at(fd);
      if (c.source != victim_source) continue;
      turn_away(c, str_cat("too many connections that have not proved the job token (",
                           strangers.size(), " in all, at most ", kMaxStrangersPerSource,
                           " per address); the oldest of the most crowded address made room"));
      break;
    }
  }
  return true;
}

void StoreServer::Impl::admit(int fd, const sockaddr_in& addr, Clock::time_point now) {
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  if (!make_room(addr.sin_addr.s_addr)) {
    ssize_t ignored = ::send(fd, kBusy, sizeof kBusy, MSG_NOSIGNAL | MSG_DONTWAIT);
    (void)ignored;
    ::close(fd);
    note_refusal(str_cat("turned away a connection to the rendezvous store ", where, " from ",
                         peer_name(addr), ": it already holds ", conns.size(),
                         " connections of the job"));
    return;
  }
  Conn& c = conns[fd];
  c.fd = fd;
  c.source = addr.sin_addr.s_addr;
  c.peer = peer_name(addr);
  c.deadline = now + kHandshakeTimeout;
  c.queued = strangers.insert(strangers.end(), fd);
  ++crowd[c.source];
  random_bytes(c.challenge.data(), kNonceBytes);
  c.out.assign(kMagic, sizeof kMagic);
  c.out.append(reinterpret_cast<const char*>(c.challenge.data()), kNonceBytes);
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLRDHUP;
  ev.data.fd = fd;
  ::epoll_ctl(epoll_fd, EPOLL_CTL_ADD, fd, &ev);
  if (!flush(c)) close_conn(c);
}

void StoreServer::Impl::accept_all(Clock::time_point now) {
  for (int i = 0; i < 256; ++i) {  // then let the others be served
    sockaddr_in addr{};
    socklen_t len = sizeof addr;
    const int fd = ::accept4(listen_fd, reinterpret_cast<sockaddr*>(&addr), &len,
                             SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd >= 0) {
      admit(fd, addr, now);
      continue;
    }
    if (errno == EINTR || errno == ECONNABORTED) continue;
    if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
      // Out of descriptors: a stranger gives one back, or new connections
      // wait in the backlog a little (rather than spinning on them).
      if (!strangers.empty()) {
        turn_away(conns.at(strangers.front()), "the host ran out of file descriptors");
        continue;
      }
      epoll_event ev{};
      ev.data.fd = listen_fd;
      ::epoll_ctl(epoll_fd, EPOLL_CTL_MOD, listen_fd, &ev);
      accept_paused = true;
      accept_paused_until = now + Millis(100);
    }
    return;  // EAGAIN: the backlog is empty
  }
}

void StoreServer::Impl::on_proof(Conn& c) {
  if (!same(reinterpret_cast<const unsigned char*>(c.in.data()),
            mac(token, "client", c.challenge.data()).data())) {
    note_refusal(str_cat("refused a connection to the rendezvous store ", where, " from ", c.peer,
                         ": it did not prove that it knows the job token"));
    close_conn(c);
    return;
  }
  const Bytes proof =
      mac(token, "server", reinterpret_cast<const unsigned char*>(c.in.data()) + kMacBytes);
  c.in.erase(0, kMacBytes + kNonceBytes);
  c.out.append(reinterpret_cast<const char*>(proof.data()), proof.size());
  c.proved = true;
  strangers.erase(c.queued);
  auto it = crowd.find(c.source);
  if (it != crowd.end() && --it->second <= 0) crowd.erase(it);
  if (!flush(c)) return close_conn(c);
  serve_frames(c);
}

// Answers the complete requests in `c.in`, one at a time: a request that
// waits holds back the ones after it, as the peer sent them in order.
void StoreServer::Impl::serve_frames(Conn& c) {
  while (!c.waiting && c.in.size() >= 4) {
    uint32_t be = 0;
    std::memcpy(&be, c.in.data(), 4);
    const uint32_t n = ntohl(be);
    if (n > kMaxFrameBytes) return close_conn(c);
    if (c.in.size() < 4 + static_cast<size_t>(n)) break;
    const std::string request = c.in.substr(4, n);
    c.in.erase(0, 4 + static_cast<size_t>(n));
    bool ok = true;
    const std::string reply = answer(request, c, ok);
    if (!ok) return close_conn(c);  // a malformed request: not one of ours
    if (c.waiting) break;
    const uint32_t len = htonl(static_cast<uint32_t>(reply.size()));
    c.out.append(reinterpret_cast<const char*>(&len), 4);
    c.out += reply;
  }
  if (!flush(c)) close_conn(c);
}

void StoreServer::Impl::on_ready(Conn& c, uint32_t events) {
  if (events & EPOLLOUT) {
    if (!flush(c)) return close_conn(c);
  }
  if (!(events & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR))) return;
  // A stranger has exactly one thing to say (a MAC and a challenge): read no
  // more than that from it.
  const size_t want = c.proved ? 65536 : kMacBytes + kNonceBytes - c.in.size();
  char buf[65536];
  const ssize_t n = ::recv(c.fd, buf, want, 0);
  if (n < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) return;
  if (n <= 0) {
    if (!c.proved) {
      note_refusal(str_cat("refused a connection to the rendezvous store ", where, " from ",
                           c.peer, ": it did not prove that it knows the job token"));
    }
    return close_conn(c);
  }
  c.in.append(buf, static_cast<size_t>(n));
  if (!c.proved) {
    if (c.in.size() == kMacBytes + kNonceBytes) on_proof(c);
    return;
  }
  serve_frames(c);
}

void StoreServer::Impl::start_wait(Conn& c, std::vector<std::string> keys, int64_t timeout_ms) {
  c.waiting = true;
  c.wait_keys = std::move(keys);
  // Peers ask for slices of kWaitSlice; a day bounds the arithmetic.
  c.wait_until = Clock::now() + Millis(std::min<int64_t>(timeout_ms, 86'400'000));
  waiters.insert(c.fd);
  dirty = true;
}

// Ends the waits whose keys all exist or whose time is up.
void StoreServer::Impl::check_waiters(Clock::time_point now) {
  std::vector<std::pair<int, bool>> done;
  {
    std::lock_guard<std::mutex> lock(mu);
    for (int fd : waiters) {
      const Conn& c = conns.at(fd);
      if (all_present(c.wait_keys)) done.emplace_back(fd, true);
      else if (now >= c.wait_until) done.emplace_back(fd, false);
    }
  }
  for (const auto& [fd, found] : done) {
    Conn& c = conns.at(fd);
    waiters.erase(fd);
    c.waiting = false;
    c.wait_keys.clear();
    const uint32_t len = htonl(1);
    c.out.append(reinterpret_cast<const char*>(&len), 4);
    c.out.push_back(found ? 1 : 0);
    serve_frames(c);  // the requests it sent meanwhile, if any
  }
}

// Strangers past their handshake deadline; a long-quiet count of refusals.
void StoreServer::Impl::expire(Clock::time_point now) {
  while (!strangers.empty()) {
    Conn& c = conns.at(strangers.front());
    if (now < c.deadline) break;
    turn_away(c, str_cat("it did not complete the handshake within ",
                         kHandshakeTimeout.count() / 1000.0, " s"));
  }
  if (unlogged > 0 && now >= quiet_until && log) {
    log(str_cat("turned away or refused ", unlogged, " more connections to the rendezvous store ",
                where, " in the last ", kLogEvery.count() / 1000,
                " s (connections that did not prove the job token, or too many at once)"));
    unlogged = 0;
    quiet_until = now + kLogEvery;
  }
  if (accept_paused && now >= accept_paused_until) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = listen_fd;
    ::epoll_ctl(epoll_fd, EPOLL_CTL_MOD, listen_fd, &ev);
    accept_paused = false;
  }
}

int StoreServer::Impl::next_timeout_ms(Clock::time_point now) const {
  auto next = now + Millis(60000);
  if (!strangers.empty()) next = std::min(next, conns.at(strangers.front()).deadline);
  for (int fd : waiters) next = std::min(next, conns.at(fd).wait_until);
  if (unlogged > 0) next = std::min(next, quiet_until);
  if (accept_paused) next = std::min(next, accept_paused_until);
  const auto ms = std::chrono::duration_cast<Millis>(next - now).count();
  return static_cast<int>(std::clamp<int64_t>(ms + 1, 0, 60000));
}

void StoreServer::Impl::run() {
  std::array<epoll_event, 256> events{};
  for (;;) {
    const int n = ::epoll_wait(epoll_fd, events.data(), static_cast<int>(events.size()),
                               next_timeout_ms(Clock::now()));
    if (n < 0 && errno != EINTR) break;
    const auto now = Clock::now();
    for (int i = 0; i < n; ++i) {
      const int fd = events[i].data.fd;
      if (fd == listen_fd) {
        accept_all(now);
      } else if (fd == wake_fd) {
        uint64_t count;
        ssize_t ignored = ::read(wake_fd, &count, sizeof count);
        (void)ignored;
        std::lock_guard<std::mutex> lock(mu);
        if (stopping) goto stop;
        dirty = true;
      } else if (auto it = conns.find(fd); it != conns.end()) {
        on_ready(it->second, events[i].events);
      }
    }
    if (dirty || !waiters.empty()) check_waiters(now);
    dirty = false;
    expire(now);
  }
stop:
  while (!conns.empty()) close_conn(conns.begin()->second);
}

std::string StoreServer::Impl::answer(const std::string& request, Conn& c, bool& ok) {
  Reader in{request};
  Writer out;
  const uint8_t op = in.u8();
  switch (op) {
    case kSet: {
      std::string key = in.str();
      std::string value = in.str();
      if (in.bad) break;
      put(key, std::move(value));
      dirty = true;
      out.u8(1);
      return out.buf;
    }
    case kGet: {
      const std::string key = in.str();
      if (in.bad) break;
      const auto value = get(key);
      out.u8(value ? 1 : 0);
      if (value) out.str(*value);
      return out.buf;
    }
    case kAdd: {
      const std::string key = in.str();
      const int64_t delta = in.i64();
      if (in.bad) break;
      const auto sum = add(key, delta);
      if (!sum) {
        out.u8(kFailed);
        out.str(str_cat("key '", key, "' does not hold an integer"));
        return out.buf;
      }
      dirty = true;
      out.u8(1);
      out.i64(*sum);
      return out.buf;
    }
    case kWait: {
      const uint32_t n = in.u32();
      if (n > 1u << 20) break;
      std::vector<std::string> keys;
      for (uint32_t i = 0; i < n && !in.bad; ++i) keys.push_back(in.str());
      const int64_t timeout_ms = in.i64();
      if (in.bad || timeout_ms < 0) break;
      start_wait(c, std::move(keys), timeout_ms);  // answered by check_waiters
      return {};
    }
    case kAge: {
      const std::string key = in.str();
      if (in.bad) break;
      const auto ms = age(key);
      out.u8(ms ? 1 : 0);
      out.i64(ms.value_or(0));
      return out.buf;
    }
    default: break;
  }
  ok = false;  // a malformed request: this peer is not one of ours
  return {};
}

StoreServer::StoreServer(const std::string& address, int port, std::string token, Log log)
    : impl_(std::make_unique<Impl>()) {
  Impl& s = *impl_;
  s.token = std::move(token);
  s.log = std::move(log);
  ST_CHECK(port >= 0 && port <= 65535, ConfigError, "store port ", port,
           " is out of range; use 1..65535 (MASTER_PORT)");
  sockaddr_in addr = resolve(address, port);
  s.listen_fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  ST_CHECK(s.listen_fd >= 0, CommError, "cannot create a socket: ", std::strerror(errno));
  const int one = 1;
  ::setsockopt(s.listen_fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (::bind(s.listen_fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      ::listen(s.listen_fd, 1024) != 0) {
    const int e = errno;
    ::close(s.listen_fd);
    ST_CHECK(false, CommError, "cannot host the rendezvous store on ", address, ":", port, ": ",
             std::strerror(e),
             e == EADDRINUSE ? ". Hint: another job uses this port; pick another --master-port"
                             : ". Hint: the master address must be an address of this host");
  }
  socklen_t len = sizeof addr;
  ::getsockname(s.listen_fd, reinterpret_cast<sockaddr*>(&addr), &len);
  s.port = ntohs(addr.sin_port);
  s.where = str_cat("tcp://", peer_name(addr));
  // The process's descriptor limit bounds the connections, with room kept
  // for its other files (a launcher holds two pipes per rank); strangers get
  // at most half.
  rlimit files{};
  if (::getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur != RLIM_INFINITY) {
    const rlim_t spare = files.rlim_cur > 512 ? files.rlim_cur - 256 : files.rlim_cur / 2;
    s.max_conns = static_cast<int>(std::clamp<rlim_t>(spare, 16, kMaxConnections));
  }
  s.max_strangers = std::min(kMaxStrangers, s.max_conns / 2);
  s.epoll_fd = ::epoll_create1(EPOLL_CLOEXEC);
  s.wake_fd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (s.epoll_fd < 0 || s.wake_fd < 0) {
    const int e = errno;
    for (int fd : {s.listen_fd, s.epoll_fd, s.wake_fd})
      if (fd >= 0) ::close(fd);
    ST_CHECK(false, CommError, "cannot host the rendezvous store: ", std::strerror(e));
  }
  for (int fd : {s.listen_fd, s.wake_fd}) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = fd;
    ::epoll_ctl(s.epoll_fd, EPOLL_CTL_ADD, fd, &ev);
  }
  // The store's thread leaves signals to the thread that handles them.
  sigset_t all, old;
  sigfillset(&all);
  ::pthread_sigmask(SIG_BLOCK, &all, &old);
  s.loop = std::thread([&s] { s.run(); });
  ::pthread_sigmask(SIG_SETMASK, &old, nullptr);
}

StoreServer::~StoreServer() {
  Impl& s = *impl_;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    s.stopping = true;
  }
  s.changed.notify_all();
  s.poke();
  s.loop.join();  // it closes every connection on its way out
  ::close(s.listen_fd);
  ::close(s.epoll_fd);
  ::close(s.wake_fd);
}

int StoreServer::port() const { return impl_->port; }
int StoreServer::refused() const { return impl_->refused.load(); }
void StoreServer::set(const std::string& key, const std::string& value) {
  impl_->put(key, value);
  impl_->poke();  // a peer may be waiting for it
}
std::optional<std::string> StoreServer::try_get(const std::string& key) { return impl_->get(key); }
int64_t StoreServer::add(const std::string& key, int64_t delta) {
  const auto sum = impl_->add(key, delta);
  ST_CHECK(sum.has_value(), InvalidArgument, "store key '", key, "' does not hold an integer");
  impl_->poke();
  return *sum;
}
bool StoreServer::wait(const std::vector<std::string>& keys, Millis timeout) {
  return impl_->wait(keys, timeout);
}
std::optional<int64_t> StoreServer::age_ms(const std::string& key) { return impl_->age(key); }
std::string StoreServer::where() const { return impl_->where; }

}  // namespace shardtrain::comm::detail
