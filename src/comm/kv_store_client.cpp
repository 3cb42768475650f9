// The store's client (connect_store, kv_store.h): connecting with retries,
// the peer's half of the handshake, then each call one request frame and its
// reply. The wire it speaks: kv_store_wire.h.
#include "comm/kv_store.h"

#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>

#include "comm/kv_store_wire.h"
#include "shardtrain/core/error.h"

namespace shardtrain::comm::detail {

using ::shardtrain::detail::str_cat;
using namespace kv_wire;

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
