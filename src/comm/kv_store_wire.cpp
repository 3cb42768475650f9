// The wire of the job's key-value store (kv_store_wire.h): the MAC of the
// handshake, frames over a blocking socket, the store's address; and what
// the job keeps in the store or takes from its environment: the world's keys,
// the heartbeat scan, the job token and the timeout.
#include "comm/kv_store_wire.h"

#include <netdb.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "comm/kv_store.h"
#include "shardtrain/core/error.h"

namespace shardtrain::comm::detail {

using ::shardtrain::detail::str_cat;

namespace kv_wire {

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

}  // namespace kv_wire

using namespace kv_wire;

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

}  // namespace shardtrain::comm::detail
