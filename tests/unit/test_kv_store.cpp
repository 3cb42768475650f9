// The job's store: what peers see over TCP, and who it lets in; the
// challenge-response handshake checked from both sides against HMACs the
// test computes itself.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <atomic>
#include <functional>
#include <thread>

#include "comm/kv_store.h"
#include "shardtrain/core/error.h"

using namespace shardtrain;
using namespace shardtrain::comm::detail;
using namespace std::chrono_literals;

namespace {

struct Hosted {
  std::vector<std::string> log;
  std::mutex mu;
  StoreServer server{"127.0.0.1", 0, "secret", [this](const std::string& line) {
                       std::lock_guard<std::mutex> lock(mu);
                       log.push_back(line);
                     }};
  std::string logged() {
    std::lock_guard<std::mutex> lock(mu);
    std::string all;
    for (const auto& l : log) all += l + "\n";
    return all;
  }
};

// A socket listening on a free loopback port, which it writes to `port`.
int listen_on_loopback(int* port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  EXPECT_EQ(::listen(fd, 64), 0);
  socklen_t len = sizeof addr;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  *port = ntohs(addr.sin_port);
  return fd;
}

}  // namespace

TEST(KvStore, PeersSeeWhatEachOtherSet) {
  Hosted h;
  auto a = connect_store("127.0.0.1", h.server.port(), "secret", 5s);
  auto b = connect_store("127.0.0.1", h.server.port(), "secret", 5s);
  EXPECT_FALSE(b->try_get("k").has_value());
  a->set("k", std::string("v\0w", 3));
  EXPECT_EQ(b->try_get("k").value(), std::string("v\0w", 3));
  EXPECT_EQ(h.server.try_get("k").value(), std::string("v\0w", 3));
  a->set("empty", "");
  EXPECT_EQ(b->try_get("empty").value(), "");
  EXPECT_EQ(a->add("n", 2), 2);
  EXPECT_EQ(b->add("n", -5), -3);
  EXPECT_EQ(h.server.add("n", 1), -2);
  EXPECT_THROW(a->add("k", 1), InvalidArgument);  // not an integer
  EXPECT_EQ(a->try_get("k").value(), std::string("v\0w", 3)) << "a refused add must not change it";
}

TEST(KvStore, WaitReturnsWhenTheKeyAppearsAndTimesOutOtherwise) {
  Hosted h;
  auto a = connect_store("127.0.0.1", h.server.port(), "secret", 5s);
  auto b = connect_store("127.0.0.1", h.server.port(), "secret", 5s);
  EXPECT_FALSE(a->wait({"late"}, 200ms));
  std::thread setter([&] {
    std::this_thread::sleep_for(300ms);
    b->set("late", "1");
  });
  const auto start = std::chrono::steady_clock::now();
  EXPECT_TRUE(a->wait({"late", "never-mind"}, 100ms) == false);
  // It returns when the key appears (after 0.3 s), long before its own
  // timeout, with room for a loaded machine.
  EXPECT_TRUE(a->wait({"late"}, 120s));
  EXPECT_LT(std::chrono::steady_clock::now() - start, 60s);
  setter.join();
}

TEST(KvStore, AgeIsMeasuredByTheHost) {
  Hosted h;
  auto a = connect_store("127.0.0.1", h.server.port(), "secret", 5s);
  EXPECT_FALSE(a->age_ms("hb").has_value());
  a->set("hb", "1");
  std::this_thread::sleep_for(300ms);
  const int64_t age = a->age_ms("hb").value();
  EXPECT_GE(age, 250);
  // A new value restarts the age: the host's age of it is at most the time
  // between sending it and asking (not a fixed margin a slow machine exceeds).
  const auto before = std::chrono::steady_clock::now();
  a->set("hb", "2");
  const int64_t fresh = a->age_ms("hb").value();
  const auto asked = std::chrono::duration_cast<std::chrono::milliseconds>(
      std::chrono::steady_clock::now() - before);
  EXPECT_LE(fresh, asked.count() + 1);
}

TEST(KvStore, AWrongTokenIsRefusedAndTheStoreGoesOn) {
  Hosted h;
  auto good = connect_store("127.0.0.1", h.server.port(), "secret", 5s);
  try {
    connect_store("127.0.0.1", h.server.port(), "guess", 5s);
    FAIL() << "a peer with the wrong token was let in";
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("SHARDTRAIN_JOB_TOKEN"), std::string::npos) << e.what();
  }
  for (int i = 0; i < 50 && h.server.refused() == 0; ++i) std::this_thread::sleep_for(20ms);
  EXPECT_EQ(h.server.refused(), 1);
  EXPECT_NE(h.logged().find("did not prove that it knows the job token"), std::string::npos)
      << h.logged();
  good->set("still", "here");
  EXPECT_EQ(h.server.try_get("still").value(), "here");
}

// A raw connection that skips the handshake and sends a request at once:
// the host must not answer it.
TEST(KvStore, ARequestWithoutTheHandshakeGetsNothing) {
  Hosted h;
  h.server.set("secret-key", "value");
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(h.server.port()));
  ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  // A GET frame for "secret-key", then 32 bytes of a guessed MAC's length.
  const std::string get = std::string("\0\0\0\x0f\x02\0\0\0\x0asecret-key", 19) + std::string(45, 'x');
  ASSERT_EQ(::send(fd, get.data(), get.size(), MSG_NOSIGNAL), static_cast<ssize_t>(get.size()));
  std::string got;
  char buf[256];
  timeval tv{3, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  for (ssize_t n; (n = ::recv(fd, buf, sizeof buf, 0)) > 0;) got.append(buf, n);
  ::close(fd);
  EXPECT_EQ(got.find("value"), std::string::npos);
  EXPECT_EQ(got.size(), 40u) << "only the greeting and challenge may come back";
  for (int i = 0; i < 50 && h.server.refused() == 0; ++i) std::this_thread::sleep_for(20ms);
  EXPECT_EQ(h.server.refused(), 1);
}

TEST(KvStore, SomethingElseOnThePortIsNamed) {
  // A listening socket that never speaks: not a store.
  int port = 0;
  const int fd = listen_on_loopback(&port);
  try {
    connect_store("127.0.0.1", port, "secret", 1s);
    FAIL() << "connected to something that is not a store";
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("not a shardtrain rendezvous store"), std::string::npos)
        << e.what();
  }
  ::close(fd);
}

TEST(KvStore, NobodyListeningIsATimeoutNamingTheAddress) {
  int port;
  {
    Hosted h;
    port = h.server.port();
  }
  try {
    connect_store("127.0.0.1", port, "secret", 600ms);
    FAIL() << "connected to a closed port";
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("127.0.0.1:" + std::to_string(port)), std::string::npos)
        << e.what();
  }
}

TEST(KvStore, TheHostGoingAwayFailsPeersPromptly) {
  auto h = std::make_unique<Hosted>();
  auto a = connect_store("127.0.0.1", h->server.port(), "secret", 30s);
  std::atomic<bool> done{false};
  std::thread waiter([&] {
    try {
      a->wait({"never"}, 120s);
    } catch (const CommError&) {
    }
    done = true;
  });
  std::this_thread::sleep_for(200ms);
  const auto start = std::chrono::steady_clock::now();
  h.reset();
  waiter.join();
  EXPECT_TRUE(done);
  // Woken by the closed store, long before the wait's own 120 s.
  EXPECT_LT(std::chrono::steady_clock::now() - start, 60s);
  EXPECT_THROW(a->set("x", "y"), CommError);
}

TEST(KvStore, TokensAreFreshAndHex) {
  const std::string a = new_job_token(), b = new_job_token();
  EXPECT_EQ(a.size(), 64u);
  EXPECT_NE(a, b);
  EXPECT_EQ(a.find_first_not_of("0123456789abcdef"), std::string::npos);
}

// ---- the handshake from both sides ------------------------------------------------------
// What each side must send is computed here with OpenSSL directly, from the
// protocol (src/comm/kv_store_wire.h): the store greets with
// "STSTORE1" and a 32-byte challenge; the client answers
// HMAC-SHA256(token, "client" + challenge) and a challenge of its own; the
// store proves itself with HMAC-SHA256(token, "server" + that challenge).

namespace {

std::string hmac(const std::string& token, const std::string& role, const std::string& nonce) {
  const std::string message = role + nonce;
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  static const unsigned char kNoKey = 0;
  HMAC(EVP_sha256(), token.empty() ? &kNoKey : reinterpret_cast<const unsigned char*>(token.data()),
       static_cast<int>(token.size()), reinterpret_cast<const unsigned char*>(message.data()),
       message.size(), out, &len);
  return std::string(reinterpret_cast<const char*>(out), len);
}

bool send_all(int fd, const std::string& bytes) {
  return ::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(bytes.size());
}

// Up to `n` bytes, fewer when the peer closes or 5 s pass.
std::string recv_up_to(int fd, size_t n) {
  timeval tv{5, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  std::string got;
  char buf[256];
  while (got.size() < n) {
    const ssize_t k = ::recv(fd, buf, std::min(sizeof buf, n - got.size()), 0);
    if (k <= 0) break;
    got.append(buf, static_cast<size_t>(k));
  }
  return got;
}

int connect_to(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  return fd;
}

const std::string kChallenge(32, '\x5a');

// A store impostor for one connection: greets with `challenge`, reads the
// client's answer, and sends proof(client's challenge) as its proof. Keeps
// what the client sent.
class FakeStore {
 public:
  explicit FakeStore(std::function<std::string(const std::string&)> proof,
                     std::string challenge = kChallenge)
      : proof_(std::move(proof)), challenge_(std::move(challenge)) {
    listen_fd_ = listen_on_loopback(&port_);
    thread_ = std::thread([this] {
      const int fd = ::accept(listen_fd_, nullptr, nullptr);
      if (fd < 0) return;
      send_all(fd, std::string("STSTORE1", 8) + challenge_);
      answer_ = recv_up_to(fd, 64);
      if (answer_.size() == 64) send_all(fd, proof_(answer_.substr(32)));
      recv_up_to(fd, 1);  // until the client closes (or 5 s)
      ::close(fd);
    });
  }
  ~FakeStore() {
    ::shutdown(listen_fd_, SHUT_RDWR);
    thread_.join();
    ::close(listen_fd_);
  }
  int port() const { return port_; }
  /// The client's answer: its MAC of the challenge, then its own challenge.
  /// Complete once connect_store has returned or thrown.
  std::string answer() {
    thread_.join();
    thread_ = std::thread([] {});
    return answer_;
  }

 private:
  std::function<std::string(const std::string&)> proof_;
  std::string challenge_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::string answer_;
  std::thread thread_;
};

// connect_store against an impostor sending proof(client's challenge):
// "" when let in, else the CommError's message.
std::string client_verdict(const std::function<std::string(const std::string&)>& proof) {
  FakeStore fake(proof);
  try {
    auto client = connect_store("127.0.0.1", fake.port(), "secret", 5s);
    return "";
  } catch (const CommError& e) {
    return e.what();
  }
}

}  // namespace

// The client's half: it answers the challenge as the protocol says and lets
// itself in only with the store's exact proof. A wrong token, the client's
// own MAC sent back (a reflection), and the true proof with any single byte
// changed are each refused.
TEST(KvStoreHandshake, TheClientAcceptsOnlyTheStoresExactProof) {
  {
    FakeStore fake([](const std::string& nonce) { return hmac("secret", "server", nonce); });
    EXPECT_NO_THROW(connect_store("127.0.0.1", fake.port(), "secret", 5s));
    const std::string answer = fake.answer();
    ASSERT_EQ(answer.size(), 64u);
    EXPECT_EQ(answer.substr(0, 32), hmac("secret", "client", kChallenge));
  }
  const std::string refused = "could not prove that it knows the job token";
  EXPECT_NE(client_verdict([](const std::string& n) { return hmac("guess", "server", n); }).find(refused),
            std::string::npos);
  EXPECT_NE(client_verdict([](const std::string& n) { return hmac("secret", "client", n); }).find(refused),
            std::string::npos);
  EXPECT_NE(client_verdict([](const std::string&) { return std::string(32, '\0'); }).find(refused),
            std::string::npos);
  for (size_t at = 0; at < 32; ++at) {
    const std::string verdict = client_verdict([at](const std::string& n) {
      std::string p = hmac("secret", "server", n);
      p[at] = static_cast<char>(p[at] ^ 0x01);
      return p;
    });
    EXPECT_NE(verdict.find(refused), std::string::npos) << "byte " << at << " changed: " << verdict;
  }
}

// The store's half: a MAC differing from the true one in one byte, at every
// position, gets no proof and is refused; the true one gets the proof the
// protocol defines.
TEST(KvStoreHandshake, TheStoreLetsInOnlyTheExactMac) {
  Hosted h;
  const std::string mine(32, '\x21');  // this client's challenge
  for (size_t at = 0; at <= 32; ++at) {  // 32: no byte changed
    SCOPED_TRACE("byte " + std::to_string(at));
    const int fd = connect_to(h.server.port());
    const std::string hello = recv_up_to(fd, 40);
    ASSERT_EQ(hello.size(), 40u);
    ASSERT_EQ(hello.substr(0, 8), "STSTORE1");
    std::string answer = hmac("secret", "client", hello.substr(8));
    if (at < 32) answer[at] = static_cast<char>(answer[at] ^ 0x80);
    ASSERT_TRUE(send_all(fd, answer + mine));
    const std::string proof = recv_up_to(fd, 32);
    ::close(fd);
    if (at < 32) {
      EXPECT_EQ(proof.size(), 0u) << "the store answered a wrong MAC";
    } else {
      EXPECT_EQ(proof, hmac("secret", "server", mine));
    }
  }
  for (int i = 0; i < 100 && h.server.refused() < 32; ++i) std::this_thread::sleep_for(20ms);
  EXPECT_EQ(h.server.refused(), 32);
}

// For one challenge, the store's proof and a client's answer differ (each
// is keyed by its role), so neither side can replay the other's.
TEST(KvStoreHandshake, TheTwoSidesAnswerOneChallengeDifferently) {
  const std::string challenge(32, '\x42');
  FakeStore fake([](const std::string& n) { return hmac("secret", "server", n); }, challenge);
  auto client = connect_store("127.0.0.1", fake.port(), "secret", 5s);
  client.reset();
  const std::string client_answer = fake.answer().substr(0, 32);
  Hosted h;
  const int fd = connect_to(h.server.port());
  const std::string hello = recv_up_to(fd, 40);
  ASSERT_EQ(hello.size(), 40u);
  ASSERT_TRUE(send_all(fd, hmac("secret", "client", hello.substr(8)) + challenge));
  const std::string store_proof = recv_up_to(fd, 32);
  ::close(fd);
  ASSERT_EQ(store_proof.size(), 32u);
  EXPECT_EQ(client_answer, hmac("secret", "client", challenge));
  EXPECT_EQ(store_proof, hmac("secret", "server", challenge));
  EXPECT_NE(client_answer, store_proof);
}

// ---- strangers by the thousand ---------------------------------------------------------
// A flood of connections that never prove the token, and a horde that holds
// them open without a word: the store keeps one thread and bounded memory,
// lets the job's peers in meanwhile, and logs a count, not a line each.

namespace {

// The threads of this process, from /proc.
int thread_count() {
  FILE* f = std::fopen("/proc/self/status", "r");
  char line[256];
  int n = -1;
  while (f && std::fgets(line, sizeof line, f)) {
    if (std::sscanf(line, "Threads: %d", &n) == 1) break;
  }
  if (f) std::fclose(f);
  return n;
}

// This process's virtual memory, in MiB, from /proc.
long virtual_mib() {
  FILE* f = std::fopen("/proc/self/status", "r");
  char line[256];
  long kib = -1;
  while (f && std::fgets(line, sizeof line, f)) {
    if (std::sscanf(line, "VmSize: %ld", &kib) == 1) break;
  }
  if (f) std::fclose(f);
  return kib / 1024;
}

// Raises this process's descriptor limit to `want` (or the hard limit);
// false when even that is less.
bool allow_files(rlim_t want) {
  rlimit r{};
  ::getrlimit(RLIMIT_NOFILE, &r);
  r.rlim_cur = std::min(r.rlim_max, std::max(r.rlim_cur, want));
  ::setrlimit(RLIMIT_NOFILE, &r);
  return r.rlim_cur >= want;
}

// A connection to `port` from loopback address 127.0.0.`from` (each a
// different source address to the store), not waiting for it to complete.
int connect_from(int from, int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
  sockaddr_in src{};
  src.sin_family = AF_INET;
  src.sin_addr.s_addr = htonl(0x7f000000u | static_cast<uint32_t>(from));
  ::bind(fd, reinterpret_cast<sockaddr*>(&src), sizeof src);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  return fd;
}

}  // namespace

TEST(KvStoreStrangers, AFloodLeavesOneThreadAndBoundedMemory) {
  ASSERT_TRUE(allow_files(4096));
  Hosted h;
  auto peer = connect_store("127.0.0.1", h.server.port(), "secret", 10s);
  const int threads = thread_count();
  const long vm = virtual_mib();
  // 4,000 connections opened and closed at once, 50 at a time in flight,
  // from 8 addresses; every 10th says something wrong first.
  for (int i = 0; i < 4000; i += 50) {
    std::vector<int> fds;
    for (int j = 0; j < 50; ++j) fds.push_back(connect_from(2 + (i + j) % 8, h.server.port()));
    for (size_t j = 0; j < fds.size(); j += 10) {
      pollfd p{fds[j], POLLOUT, 0};
      if (::poll(&p, 1, 1000) == 1) send_all(fds[j], std::string(64, 'x'));
    }
    for (int fd : fds) ::close(fd);
  }
  peer->set("after", "flood");
  EXPECT_EQ(h.server.try_get("after").value(), "flood");
  EXPECT_LE(thread_count(), threads) << "the store grew threads with the connections";
  EXPECT_LT(virtual_mib() - vm, 512) << "the store's memory grew with the connections";
  auto late = connect_store("127.0.0.1", h.server.port(), "secret", 10s);
  EXPECT_EQ(late->try_get("after").value(), "flood");
}

TEST(KvStoreStrangers, APeerGetsInWhileSilentStrangersFillTheStore) {
  ASSERT_TRUE(allow_files(4096));
  Hosted h;
  const int threads = thread_count();
  // 1,100 connections from 11 addresses that never say a word: more than
  // the store keeps for strangers, in all and per address.
  std::vector<int> horde;
  for (int i = 0; i < 1100; ++i) horde.push_back(connect_from(2 + i % 11, h.server.port()));
  std::this_thread::sleep_for(500ms);
  EXPECT_LE(thread_count(), threads + 1) << "a thread per silent stranger";
  // A peer of the job (from 127.0.0.1) still gets in, at once.
  const auto start = std::chrono::steady_clock::now();
  try {
    auto peer = connect_store("127.0.0.1", h.server.port(), "secret", 5s);
    peer->set("in", "yes");
    EXPECT_EQ(h.server.try_get("in").value(), "yes");
  } catch (const CommError& e) {
    ADD_FAILURE() << "a peer with the token was kept out by silent strangers: " << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, 3s);
  // Many turned away, few lines logged.
  for (int i = 0; i < 100 && h.server.refused() < 500; ++i) std::this_thread::sleep_for(20ms);
  EXPECT_GE(h.server.refused(), 500);
  const std::string logged = h.logged();
  EXPECT_LE(std::count(logged.begin(), logged.end(), '\n'), 3) << logged;
  for (int fd : horde) ::close(fd);
}

// A store that turns every connection away: the peer tries again until its
// timeout and then says so, not that the store is something else.
TEST(KvStoreStrangers, APeerTurnedAwayForGoodSaysWhy) {
  int port = 0;
  const int listen_fd = listen_on_loopback(&port);
  std::atomic<bool> stop{false};
  std::atomic<int> turned{0};
  std::thread bouncer([&] {
    while (!stop) {
      pollfd p{listen_fd, POLLIN, 0};
      if (::poll(&p, 1, 50) != 1) continue;
      const int fd = ::accept(listen_fd, nullptr, nullptr);
      if (fd < 0) continue;
      send_all(fd, std::string("STBUSY01", 8));
      ::close(fd);
      ++turned;
    }
  });
  try {
    connect_store("127.0.0.1", port, "secret", 1500ms);
    ADD_FAILURE() << "let in by a store that turns everyone away";
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("turned this process away"), std::string::npos)
        << e.what();
  } catch (const CommError& e) {
    ADD_FAILURE() << "not a TimeoutError naming the crowd: " << e.what();
  }
  EXPECT_GE(turned.load(), 2) << "the peer did not try again";
  stop = true;
  bouncer.join();
  ::close(listen_fd);
}

// Something on the port that closes every connection at once (no store
// does: it says why it turns a peer away): named promptly, not retried until
// the timeout.
TEST(KvStoreStrangers, APortThatClosesAtOnceIsNamedPromptly) {
  int port = 0;
  const int listen_fd = listen_on_loopback(&port);
  std::atomic<bool> stop{false};
  std::thread closer([&] {
    while (!stop) {
      pollfd p{listen_fd, POLLIN, 0};
      if (::poll(&p, 1, 50) != 1) continue;
      const int fd = ::accept(listen_fd, nullptr, nullptr);
      if (fd >= 0) ::close(fd);
    }
  });
  const auto start = std::chrono::steady_clock::now();
  try {
    connect_store("127.0.0.1", port, "secret", 30s);
    ADD_FAILURE() << "let in by a port that closes every connection";
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("closed the connection before any greeting"),
              std::string::npos)
        << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, 10s);
  stop = true;
  closer.join();
  ::close(listen_fd);
}
