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
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <map>
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
constexpr int kMaxConnections = 1024;
// A peer gets this long to complete the handshake.
constexpr Millis kHandshakeTimeout{10000};
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

struct StoreServer::Impl {
  struct Entry {
    std::string value;
    Clock::time_point set_at;
  };

  std::string token;
  Log log;
  std::string where;
  int listen_fd = -1;
  int wake[2] = {-1, -1};
  int port = 0;

  std::mutex mu;
  std::condition_variable changed;
  std::unordered_map<std::string, Entry> map;
  bool stopping = false;
  std::set<int> conns;  // open connection sockets, shut down on stop
  std::vector<std::thread> threads;
  std::atomic<int> refused{0};
  std::thread listener;

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

  bool wait(const std::vector<std::string>& keys, Millis timeout) {
    std::unique_lock<std::mutex> lock(mu);
    return changed.wait_for(lock, timeout, [&] {
      if (stopping) return true;
      for (const auto& k : keys)
        if (map.count(k) == 0) return false;
      return true;
    }) && !stopping;
  }

  std::optional<int64_t> age(const std::string& key) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = map.find(key);
    if (it == map.end()) return std::nullopt;
    return std::chrono::duration_cast<Millis>(Clock::now() - it->second.set_at).count();
  }

  void accept_loop();
  void serve(int fd, std::string peer);
  bool handshake(int fd);
  std::string answer(const std::string& request, bool& ok);
};

bool StoreServer::Impl::handshake(int fd) {
  const auto deadline = Clock::now() + kHandshakeTimeout;
  std::array<unsigned char, sizeof kMagic + kNonceBytes> hello{};
  std::memcpy(hello.data(), kMagic, sizeof kMagic);
  unsigned char* challenge = hello.data() + sizeof kMagic;
  random_bytes(challenge, kNonceBytes);
  if (!io_exact(fd, hello.data(), hello.size(), true, deadline)) return false;
  std::array<unsigned char, kMacBytes + kNonceBytes> reply{};
  if (!io_exact(fd, reply.data(), reply.size(), false, deadline)) return false;
  if (!same(reply.data(), mac(token, "client", challenge).data())) return false;
  const Bytes proof = mac(token, "server", reply.data() + kMacBytes);
  return io_exact(fd, const_cast<unsigned char*>(proof.data()), proof.size(), true, deadline);
}

std::string StoreServer::Impl::answer(const std::string& request, bool& ok) {
  Reader in{request};
  Writer out;
  const uint8_t op = in.u8();
  switch (op) {
    case kSet: {
      std::string key = in.str();
      std::string value = in.str();
      if (in.bad) break;
      put(key, std::move(value));
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
      out.u8(wait(keys, Millis(timeout_ms)) ? 1 : 0);
      return out.buf;
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

void StoreServer::Impl::serve(int fd, std::string peer) {
  if (!handshake(fd)) {
    bool quiet;
    {
      std::lock_guard<std::mutex> lock(mu);
      quiet = stopping;
    }
    if (!quiet) {
      ++refused;
      if (log) {
        log(str_cat("refused a connection to the rendezvous store ", where, " from ", peer,
                    ": it did not prove that it knows the job token"));
      }
    }
  } else {
    std::string request;
    while (recv_frame(fd, request, std::nullopt)) {
      bool ok = true;
      const std::string reply = answer(request, ok);
      if (!ok || !send_frame(fd, reply, std::nullopt)) break;
    }
  }
  std::lock_guard<std::mutex> lock(mu);
  conns.erase(fd);
  ::close(fd);
}

void StoreServer::Impl::accept_loop() {
  for (;;) {
    pollfd fds[2] = {{listen_fd, POLLIN, 0}, {wake[0], POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[1].revents) return;
    if (!(fds[0].revents & POLLIN)) continue;
    sockaddr_in addr{};
    socklen_t len = sizeof addr;
    const int fd = ::accept4(listen_fd, reinterpret_cast<sockaddr*>(&addr), &len, SOCK_CLOEXEC);
    if (fd < 0) continue;
    const int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    std::lock_guard<std::mutex> lock(mu);
    if (stopping || static_cast<int>(conns.size()) >= kMaxConnections) {
      ::close(fd);
      continue;
    }
    conns.insert(fd);
    threads.emplace_back([this, fd, peer = peer_name(addr)] { serve(fd, peer); });
  }
}

StoreServer::StoreServer(const std::string& address, int port, std::string token, Log log)
    : impl_(std::make_unique<Impl>()) {
  Impl& s = *impl_;
  s.token = std::move(token);
  s.log = std::move(log);
  ST_CHECK(port >= 0 && port <= 65535, ConfigError, "store port ", port,
           " is out of range; use 1..65535 (MASTER_PORT)");
  sockaddr_in addr = resolve(address, port);
  s.listen_fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ST_CHECK(s.listen_fd >= 0, CommError, "cannot create a socket: ", std::strerror(errno));
  const int one = 1;
  ::setsockopt(s.listen_fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (::bind(s.listen_fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      ::listen(s.listen_fd, 256) != 0) {
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
  if (::pipe2(s.wake, O_CLOEXEC) != 0) {
    ::close(s.listen_fd);
    ST_CHECK(false, CommError, "cannot create a pipe: ", std::strerror(errno));
  }
  // The store's threads leave signals to the thread that handles them.
  sigset_t all, old;
  sigfillset(&all);
  ::pthread_sigmask(SIG_BLOCK, &all, &old);
  s.listener = std::thread([&s] { s.accept_loop(); });
  ::pthread_sigmask(SIG_SETMASK, &old, nullptr);
}

StoreServer::~StoreServer() {
  Impl& s = *impl_;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    s.stopping = true;
    for (int fd : s.conns) ::shutdown(fd, SHUT_RDWR);
  }
  s.changed.notify_all();
  const char byte = 1;
  ssize_t ignored = ::write(s.wake[1], &byte, 1);
  (void)ignored;
  s.listener.join();
  // No new threads start once the listener is gone.
  for (auto& t : s.threads) t.join();
  ::close(s.listen_fd);
  ::close(s.wake[0]);
  ::close(s.wake[1]);
}

int StoreServer::port() const { return impl_->port; }
int StoreServer::refused() const { return impl_->refused.load(); }
void StoreServer::set(const std::string& key, const std::string& value) { impl_->put(key, value); }
std::optional<std::string> StoreServer::try_get(const std::string& key) { return impl_->get(key); }
int64_t StoreServer::add(const std::string& key, int64_t delta) {
  const auto sum = impl_->add(key, delta);
  ST_CHECK(sum.has_value(), InvalidArgument, "store key '", key, "' does not hold an integer");
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

}  // namespace

std::unique_ptr<KvStore> connect_store(const std::string& address, int port,
                                       const std::string& token, Millis timeout) {
  ST_CHECK(port > 0 && port <= 65535, ConfigError, "store port ", port,
           " is out of range; use 1..65535 (MASTER_PORT)");
  const sockaddr_in addr = resolve(address, port);
  const std::string where = str_cat("tcp://", peer_name(addr));
  const auto deadline = Clock::now() + timeout;
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
  std::array<unsigned char, sizeof kMagic + kNonceBytes> hello{};
  const bool got_hello = io_exact(fd, hello.data(), hello.size(), false, hs_deadline);
  if (!got_hello || std::memcmp(hello.data(), kMagic, sizeof kMagic) != 0) {
    ::close(fd);
    throw CommError(str_cat("the process at ", where,
                            " is not a shardtrain rendezvous store (no greeting). Hint: another "
                            "program uses MASTER_PORT; pick another port"));
  }
  std::array<unsigned char, kMacBytes + kNonceBytes> reply{};
  const Bytes answer = mac(token, "client", hello.data() + sizeof kMagic);
  std::memcpy(reply.data(), answer.data(), kMacBytes);
  unsigned char* challenge = reply.data() + kMacBytes;
  random_bytes(challenge, kNonceBytes);
  Bytes proof{};
  const bool done = io_exact(fd, reply.data(), reply.size(), true, hs_deadline) &&
                    io_exact(fd, proof.data(), proof.size(), false, hs_deadline);
  if (!done || !same(proof.data(), mac(token, "server", challenge).data())) {
    ::close(fd);
    throw CommError(str_cat(
        "the rendezvous store at ", where, done ? " could not prove that it knows the job token"
                                                : " refused this process's job token",
        ". Hint: every node must run with the same SHARDTRAIN_JOB_TOKEN (the launcher makes "
        "one per job when it is unset; nodes started separately need it set to one value)"));
  }
  return std::make_unique<StoreClient>(fd, where, timeout);
}

}  // namespace shardtrain::comm::detail
