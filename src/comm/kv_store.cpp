#include "comm/kv_store.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <poll.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/random.h>
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

#include "shardtrain/core/error.h"

namespace shardtrain::comm::detail {

using ::shardtrain::detail::str_cat;

namespace {

using Clock = std::chrono::steady_clock;
using Millis = std::chrono::milliseconds;

// ---- the wire ------------------------------------------------------------------
//
// Handshake: the host sends kMagic and a 32-byte challenge; the peer answers
// HMAC-SHA256(token, "client" + challenge) and a challenge of its own, which
// the host answers with HMAC-SHA256(token, "server" + challenge). Neither side
// ever sends the token. Then requests and replies, each a frame: a 4-byte
// big-endian length and that many bytes, starting with the op.

constexpr char kMagic[8] = {'S', 'T', 'S', 'T', 'O', 'R', 'E', '1'};
constexpr size_t kNonceBytes = 32;
constexpr size_t kMacBytes = 32;
constexpr uint32_t kMaxFrameBytes = 64u << 20;
// What the host sends a connection it turns away to make room (in place of
// or after its greeting): a peer of ours that reads it tries again.
constexpr char kBusy[8] = {'S', 'T', 'B', 'U', 'S', 'Y', '0', '1'};
// Connections in all (further bounded by the descriptor limit), and
// those that have not proved the token yet: in all, and from one address.
constexpr int kMaxConnections = 16384;
constexpr int kMaxStrangers = 512;
constexpr int kMaxStrangersPerSource = 64;
// A peer gets this long to complete the handshake (one round trip).
constexpr Millis kHandshakeTimeout{3000};
// Refused connections are logged one line per this long at most.
constexpr Millis kLogEvery{10000};
// Longest single wait a peer asks the host for.
constexpr Millis kWaitSlice{500};

enum Op : uint8_t { kSet = 1, kGet = 2, kAdd = 3, kWait = 4, kAge = 5 };
constexpr uint8_t kFailed = 0xFF;

using Bytes = std::array<unsigned char, kMacBytes>;

void random_bytes(void* out, size_t n) {
  auto* p = static_cast<unsigned char*>(out);
  while (n > 0) {
    const ssize_t got = ::getrandom(p, n, 0);
    if (got < 0 && errno == EINTR) continue;
    ST_CHECK(got > 0, Error, "cannot read random bytes from the kernel: ", std::strerror(errno));
    p += got;
    n -= static_cast<size_t>(got);
  }
}

Bytes mac(const std::string& token, const char* role, const unsigned char* nonce) {
  std::string message(role);
  message.append(reinterpret_cast<const char*>(nonce), kNonceBytes);
  // An empty key is a valid HMAC key; a static byte keeps OpenSSL from
  // reading a null pointer as "no key given".
  static const unsigned char kEmpty = 0;
  const void* key = token.empty() ? static_cast<const void*>(&kEmpty) : token.data();
  Bytes out{};
  unsigned int len = 0;
  ST_CHECK(HMAC(EVP_sha256(), key, static_cast<int>(token.size()),
                reinterpret_cast<const unsigned char*>(message.data()), message.size(),
                out.data(), &len) != nullptr &&
               len == kMacBytes,
           InternalError, "HMAC-SHA256 failed");
  return out;
}

bool same(const unsigned char* a, const unsigned char* b) {
  return CRYPTO_memcmp(a, b, kMacBytes) == 0;
}

// Reads or writes exactly `n` bytes before `deadline` (none: wait forever).
// False on EOF, an error or the deadline; errno tells which (0 for EOF).
bool io_exact(int fd, void* buf, size_t n, bool writing, std::optional<Clock::time_point> deadline) {
  auto* p = static_cast<char*>(buf);
  while (n > 0) {
    int wait_ms = -1;
    if (deadline) {
      const auto left = std::chrono::duration_cast<Millis>(*deadline - Clock::now()).count();
      if (left <= 0) {
        errno = ETIMEDOUT;
        return false;
      }
      wait_ms = static_cast<int>(std::min<int64_t>(left, 60000));
    }
    pollfd pfd{fd, static_cast<short>(writing ? POLLOUT : POLLIN), 0};
    const int ready = ::poll(&pfd, 1, wait_ms);
    if (ready < 0 && errno == EINTR) continue;
    if (ready < 0) return false;
    if (ready == 0) continue;  // re-check the deadline
    const ssize_t got = writing ? ::send(fd, p, n, MSG_NOSIGNAL) : ::recv(fd, p, n, 0);
    if (got < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (got <= 0) {
      if (got == 0) errno = 0;
      return false;
    }
    p += got;
    n -= static_cast<size_t>(got);
  }
  return true;
}

struct Writer {
  std::string buf;
  void u8(uint8_t v) { buf.push_back(static_cast<char>(v)); }
  void u32(uint32_t v) {
    const uint32_t be = htonl(v);
    buf.append(reinterpret_cast<const char*>(&be), 4);
  }
  void i64(int64_t v) {
    u32(static_cast<uint32_t>(static_cast<uint64_t>(v) >> 32));
    u32(static_cast<uint32_t>(static_cast<uint64_t>(v)));
  }
  void str(const std::string& s) {
    u32(static_cast<uint32_t>(s.size()));
    buf += s;
  }
};

// Reads a frame's fields; a field running past the end marks it bad.
struct Reader {
  const std::string& buf;
  size_t pos = 0;
  bool bad = false;
  bool take(size_t n) {
    if (bad || buf.size() - pos < n) return !(bad = true);
    return true;
  }
  uint8_t u8() { return take(1) ? static_cast<uint8_t>(buf[pos++]) : 0; }
  uint32_t u32() {
    if (!take(4)) return 0;
    uint32_t be;
    std::memcpy(&be, buf.data() + pos, 4);
    pos += 4;
    return ntohl(be);
  }
  int64_t i64() {
    const uint64_t hi = u32();
    const uint64_t lo = u32();
    return static_cast<int64_t>((hi << 32) | lo);
  }
  std::string str() {
    const uint32_t n = u32();
    if (!take(n)) return {};
    std::string s = buf.substr(pos, n);
    pos += n;
    return s;
  }
};

bool send_frame(int fd, const std::string& body, std::optional<Clock::time_point> deadline) {
  std::string frame;
  frame.reserve(body.size() + 4);
  const uint32_t be = htonl(static_cast<uint32_t>(body.size()));
  frame.append(reinterpret_cast<const char*>(&be), 4);
  frame += body;
  return io_exact(fd, frame.data(), frame.size(), true, deadline);
}

bool recv_frame(int fd, std::string& body, std::optional<Clock::time_point> deadline) {
  uint32_t be = 0;
  if (!io_exact(fd, &be, 4, false, deadline)) return false;
  const uint32_t n = ntohl(be);
  if (n > kMaxFrameBytes) {
    errno = EMSGSIZE;
    return false;
  }
  body.resize(n);
  return io_exact(fd, body.data(), n, false, deadline);
}

std::string peer_name(const sockaddr_in& addr) {
  char text[INET_ADDRSTRLEN] = "?";
  ::inet_ntop(AF_INET, &addr.sin_addr, text, sizeof text);
  return str_cat(text, ":", ntohs(addr.sin_port));
}

// The IPv4 address `name` stands for (numeric, or resolved).
sockaddr_in resolve(const std::string& name, int port) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const std::string host = name == "::1" || name == "localhost" ? "127.0.0.1" : name;
  const int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &found);
  ST_CHECK(rc == 0 && found != nullptr, CommError, "cannot resolve the store address '", name,
           "' (", ::gai_strerror(rc), "); set MASTER_ADDR (--master-addr) to host 0's address");
  sockaddr_in addr = *reinterpret_cast<const sockaddr_in*>(found->ai_addr);
  ::freeaddrinfo(found);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  return addr;
}

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

std::string world_prefix(int round) { return str_cat("shardtrain/r", round, "/world"); }

std::string heartbeat_key(int round, int rank) {
  return str_cat(world_prefix(round), "/heartbeat/", rank);
}

HeartbeatScan scan_heartbeats(KvStore& kv, int round, const std::vector<int>& ranks) {
  HeartbeatScan scan;
  for (const int r : ranks) {
    const auto age = kv.age_ms(heartbeat_key(round, r));
    if (!age) continue;
    if (*age < kStaleHeartbeatMs) {
      ++scan.fresh;
    } else {
      scan.stale.emplace_back(r, *age);
    }
  }
  return scan;
}

std::string HeartbeatScan::describe() const {
  std::string out;
  for (const auto& [rank, age] : stale) {
    out += str_cat(out.empty() ? "" : ", ", "rank ", rank, " (no heartbeat for ", age / 1000,
                   " s: stopped, hung or dead)");
  }
  return out;
}

std::string new_job_token() {
  unsigned char raw[32];
  random_bytes(raw, sizeof raw);
  static const char kHex[] = "0123456789abcdef";
  std::string out;
  for (unsigned char c : raw) {
    out.push_back(kHex[c >> 4]);
    out.push_back(kHex[c & 15]);
  }
  return out;
}

std::chrono::milliseconds timeout_from_env(std::chrono::milliseconds fallback) {
  const char* raw = std::getenv("SHARDTRAIN_TIMEOUT_S");
  if (raw == nullptr || *raw == '\0') return fallback;
  char* end = nullptr;
  const double seconds = std::strtod(raw, &end);
  ST_CHECK(end != raw && *end == '\0' && seconds > 0 && seconds < 1e9, ConfigError,
           "SHARDTRAIN_TIMEOUT_S='", raw,
           "' is not a positive number of seconds");
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0));
}

std::string job_token_from_env() {
  const char* token = std::getenv("SHARDTRAIN_JOB_TOKEN");
  return token == nullptr ? std::string() : std::string(token);
}

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

// ---- a peer ---------------------------------------------------------------------------

namespace {

class StoreClient final : public KvStore {
 public:
  StoreClient(int fd, std::string where, Millis timeout)
      : fd_(fd), where_(std::move(where)), timeout_(timeout) {}
  ~StoreClient() override { ::close(fd_); }

  void set(const std::string& key, const std::string& value) override {
    Writer w;
    w.u8(kSet);
    w.str(key);
    w.str(value);
    call("set", key, w.buf, timeout_);
  }

  std::optional<std::string> try_get(const std::string& key) override {
    Writer w;
    w.u8(kGet);
    w.str(key);
    const std::string reply = call("get", key, w.buf, timeout_);
    Reader r{reply};
    if (r.u8() == 0) return std::nullopt;
    std::string value = r.str();
    check(r, "get", key);
    return value;
  }

  int64_t add(const std::string& key, int64_t delta) override {
    Writer w;
    w.u8(kAdd);
    w.str(key);
    w.i64(delta);
    const std::string reply = call("add", key, w.buf, timeout_);
    Reader r{reply};
    if (r.u8() == kFailed) {
      throw InvalidArgument(str_cat("rendezvous store ", where_, ": add('", key, "') failed: ",
                                    r.str()));
    }
    const int64_t sum = r.i64();
    check(r, "add", key);
    return sum;
  }

  // Waits in slices, so another thread's calls (heartbeats) are not held up
  // behind a long wait on the one connection.
  bool wait(const std::vector<std::string>& keys, Millis timeout) override {
    const auto deadline = Clock::now() + timeout;
    for (;;) {
      const auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now());
      const Millis slice = std::clamp(left, Millis(0), kWaitSlice);
      Writer w;
      w.u8(kWait);
      w.u32(static_cast<uint32_t>(keys.size()));
      for (const auto& k : keys) w.str(k);
      w.i64(slice.count());
      // The host answers when the wait ends; allow it time to say so.
      const std::string reply = call("wait", keys.empty() ? "" : keys.front(), w.buf,
                                     slice + timeout_);
      if (!reply.empty() && reply[0] == 1) return true;
      if (left <= slice) return false;
    }
  }

  std::optional<int64_t> age_ms(const std::string& key) override {
    Writer w;
    w.u8(kAge);
    w.str(key);
    const std::string reply = call("age", key, w.buf, timeout_);
    Reader r{reply};
    const bool found = r.u8() == 1;
    const int64_t ms = r.i64();
    check(r, "age", key);
    if (!found) return std::nullopt;
    return ms;
  }

  std::string where() const override { return where_; }

 private:
  std::string call(const char* what, const std::string& key, const std::string& request,
                   Millis timeout) {
    std::lock_guard<std::mutex> lock(mu_);
    ST_CHECK(broken_.empty(), CommError, "rendezvous store ", where_, ": ", what, "('", key,
             "') not tried: the connection failed earlier (", broken_, ")");
    const auto deadline = Clock::now() + timeout;
    std::string reply;
    if (send_frame(fd_, request, deadline) && recv_frame(fd_, reply, deadline)) return reply;
    const int e = errno;
    broken_ = e == 0 ? "the host closed the connection" : std::strerror(e);
    const std::string text = str_cat(
        "rendezvous store ", where_, ": ", what, "('", key, "') failed: ", broken_,
        ". Hint: the store lives with node 0's launcher (or rank 0); if that process is gone, "
        "the job cannot continue there");
    if (e == ETIMEDOUT) throw TimeoutError(text);
    throw CommError(text);
  }

  void check(const Reader& r, const char* what, const std::string& key) const {
    ST_CHECK(!r.bad, CommError, "rendezvous store ", where_, ": ", what, "('", key,
             "') got a malformed reply");
  }

  std::mutex mu_;
  int fd_;
  std::string where_;
  Millis timeout_;
  std::string broken_;
};

// One connection attempt with a bounded connect; -1 with errno on failure.
int try_connect(const sockaddr_in& addr, Clock::time_point deadline) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return -1;
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0) {
    if (errno != EINPROGRESS) {
      const int e = errno;
      ::close(fd);
      errno = e;
      return -1;
    }
    pollfd pfd{fd, POLLOUT, 0};
    const auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now()).count();
    const int ready = ::poll(&pfd, 1, static_cast<int>(std::clamp<int64_t>(left, 1, 5000)));
    int err = ETIMEDOUT;
    socklen_t len = sizeof err;
    if (ready > 0) ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
    if (err != 0) {
      ::close(fd);
      errno = err;
      return -1;
    }
  }
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  return fd;
}


// How one handshake ended, seen from a peer.
enum class Greeted { kIn, kBusy, kClosed, kSilent, kStranger, kRefused, kFalseProof };

// The peer's half of the handshake on a connected `fd`.
Greeted handshake(int fd, const std::string& token, Clock::time_point deadline) {
  std::array<unsigned char, sizeof kMagic + kNonceBytes> hello{};
  if (!io_exact(fd, hello.data(), hello.size(), false, deadline)) {
    const int e = errno;
    if (std::memcmp(hello.data(), kBusy, sizeof kBusy) == 0) return Greeted::kBusy;
    if (hello[0] == 0) return e == ETIMEDOUT ? Greeted::kSilent : Greeted::kClosed;
    return Greeted::kStranger;
  }
  if (std::memcmp(hello.data(), kMagic, sizeof kMagic) != 0) return Greeted::kStranger;
  std::array<unsigned char, kMacBytes + kNonceBytes> reply{};
  const Bytes answer = mac(token, "client", hello.data() + sizeof kMagic);
  std::memcpy(reply.data(), answer.data(), kMacBytes);
  unsigned char* challenge = reply.data() + kMacBytes;
  random_bytes(challenge, kNonceBytes);
  Bytes proof{};
  if (!io_exact(fd, reply.data(), reply.size(), true, deadline) ||
      !io_exact(fd, proof.data(), proof.size(), false, deadline)) {
    // The host turned us away to make room before it read our answer.
    if (std::memcmp(proof.data(), kBusy, sizeof kBusy) == 0) return Greeted::kBusy;
    return Greeted::kRefused;
  }
  return same(proof.data(), mac(token, "server", challenge).data()) ? Greeted::kIn
                                                                     : Greeted::kFalseProof;
}

}  // namespace

std::unique_ptr<KvStore> connect_store(const std::string& address, int port,
                                       const std::string& token, Millis timeout) {
  ST_CHECK(port > 0 && port <= 65535, ConfigError, "store port ", port,
           " is out of range; use 1..65535 (MASTER_PORT)");
  const sockaddr_in addr = resolve(address, port);
  const std::string where = str_cat("tcp://", peer_name(addr));
  const auto start = Clock::now();
  const auto deadline = start + timeout;
  int turned_away = 0, closed = 0;
  for (;;) {
    int fd = -1;
    int last_error = 0;
    while ((fd = try_connect(addr, deadline)) < 0) {
      last_error = errno;
      // The host may not be up yet (refused) or be coming back (unreachable).
      if (Clock::now() + Millis(200) >= deadline) {
        throw TimeoutError(str_cat(
            "cannot reach the rendezvous store at ", where, " within ",
            timeout.count() / 1000.0, " s: ", std::strerror(last_error),
            ". Hint: node 0's launcher (or rank 0) hosts it; check MASTER_ADDR/MASTER_PORT, that "
            "node 0 started, and raise SHARDTRAIN_TIMEOUT_S if nodes start far apart"));
      }
      std::this_thread::sleep_for(Millis(200));
    }
    const auto hs_deadline = std::min(deadline, Clock::now() + kHandshakeTimeout) + Millis(1000);
    const Greeted how = handshake(fd, token, hs_deadline);
    if (how == Greeted::kIn) return std::make_unique<StoreClient>(fd, where, timeout);
    ::close(fd);
    // Turned away to make room: the crowd moves on, so try again, a little
    // later and not in step with the other peers. Closed without a word: a
    // store never does that (it says kBusy), so only a few more tries.
    if (how == Greeted::kBusy || (how == Greeted::kClosed && ++closed <= 3)) {
      ++turned_away;
      unsigned char jitter = 0;
      random_bytes(&jitter, 1);
      const auto pause = Millis(20 + jitter);
      if (Clock::now() + pause < deadline) {
        std::this_thread::sleep_for(pause);
        continue;
      }
    }
    const auto waited = std::chrono::duration_cast<Millis>(Clock::now() - start).count() / 1000.0;
    switch (how) {
      case Greeted::kBusy:
        throw TimeoutError(str_cat(
            "the rendezvous store at ", where, " turned this process away ", turned_away,
            " times in ", waited, " s: it is crowded with connections that have not proved "
            "the job token. Hint: something else keeps connecting to that port (a scanner, a "
            "flood, another program); stop it or firewall the port to the job's hosts, and "
            "raise SHARDTRAIN_TIMEOUT_S to wait longer"));
      case Greeted::kClosed:
        throw CommError(str_cat(
            "the process at ", where, " closed the connection before any greeting (", closed,
            " times in ", waited, " s): it is not a shardtrain rendezvous store, or not one that "
            "lets this process in. Hint: check MASTER_ADDR/MASTER_PORT; another program may use "
            "that port"));
      case Greeted::kSilent:
      case Greeted::kStranger:
        throw CommError(str_cat(
            "the process at ", where, " is not a shardtrain rendezvous store (",
            how == Greeted::kSilent ? "no greeting" : "a greeting of another kind",
            "). Hint: another program uses MASTER_PORT; pick another port"));
      default:
        throw CommError(str_cat(
            "the rendezvous store at ", where,
            how == Greeted::kFalseProof ? " could not prove that it knows the job token"
                                        : " refused this process's job token",
            ". Hint: every node must run with the same SHARDTRAIN_JOB_TOKEN (the launcher makes "
            "one per job when it is unset; nodes started separately need it set to one value)"));
    }
  }
}

}  // namespace shardtrain::comm::detail
