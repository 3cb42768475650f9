// The job's store: what peers see over TCP, and who it lets in.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
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
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ASSERT_EQ(::listen(fd, 4), 0);
  socklen_t len = sizeof addr;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  try {
    connect_store("127.0.0.1", ntohs(addr.sin_port), "secret", 1s);
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
