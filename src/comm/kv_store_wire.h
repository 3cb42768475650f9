// The wire between the job's key-value store and its peers (kv_store.h): the
// handshake's constants and MAC, the frames and the ops they carry. Shared by
// the store server (kv_store_server.cpp) and the client (kv_store_client.cpp);
// kv_store_wire.cpp defines what is declared here. Internal.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>

namespace shardtrain::comm::detail::kv_wire {

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
// A peer gets this long to complete the handshake (one round trip).
constexpr Millis kHandshakeTimeout{3000};
// Longest single wait a peer asks the host for.
constexpr Millis kWaitSlice{500};

enum Op : uint8_t { kSet = 1, kGet = 2, kAdd = 3, kWait = 4, kAge = 5 };
constexpr uint8_t kFailed = 0xFF;

using Bytes = std::array<unsigned char, kMacBytes>;

void random_bytes(void* out, size_t n);

Bytes mac(const std::string& token, const char* role, const unsigned char* nonce);

bool same(const unsigned char* a, const unsigned char* b);

// Reads or writes exactly `n` bytes before `deadline` (none: wait forever).
// False on EOF, an error or the deadline; errno tells which (0 for EOF).
bool io_exact(int fd, void* buf, size_t n, bool writing, std::optional<Clock::time_point> deadline);

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

bool send_frame(int fd, const std::string& body, std::optional<Clock::time_point> deadline);

bool recv_frame(int fd, std::string& body, std::optional<Clock::time_point> deadline);

std::string peer_name(const sockaddr_in& addr);

// The IPv4 address `name` stands for (numeric, or resolved).
sockaddr_in resolve(const std::string& name, int port);

}  // namespace shardtrain::comm::detail::kv_wire
