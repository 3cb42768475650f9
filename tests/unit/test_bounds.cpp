// Bounds and distributions seen from outside the code that enforces them
// (issue 47, "Tests from outside, third pass", and item 8): the sampler's
// draws against softmax(logits / T) computed here, generate's limits on
// --max-new-tokens and --temperature, and the JSON depth bound on objects and
// mixed nesting (every earlier deep-nesting test used arrays only).
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/wait.h>
#include <sys/socket.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <thread>
#include <string>
#include <vector>

#include "comm/kv_store.h"
#include "core/json.h"
#include "shardtrain/config/config.h"
#include "shardtrain/models/causal_lm.h"
#include "shardtrain/models/family.h"
#include "shardtrain/models/hf_dir.h"
#include "shardtrain/train/plan.h"
#include "temp_dir.h"
#include "test_helpers.h"

namespace st = shardtrain;
namespace m = shardtrain::models;

namespace {

#undef EXPECT_HAS  // each test file defines its own (the unit tests build as one unity target)
#define EXPECT_HAS(text, part) EXPECT_NE((text).find(part), std::string::npos) << (text)

// ---- the sampler ------------------------------------------------------------------------

// The same logits for every position, whatever the tokens: each draw of
// generate() is then one independent draw from softmax(kLogits / T).
const std::vector<float> kLogits = {0.0f, 1.0f, 2.0f, 3.0f};

class FixedLogits : public m::CausalLMImpl {
 public:
  at::Tensor forward(const at::Tensor& idx, const at::Tensor&, const at::Tensor&) override {
    return logits(idx.size(1));
  }
  at::Tensor forward_cached(const at::Tensor& idx, m::KVCache& cache) override {
    cache.length += idx.size(1);
    return logits(idx.size(1));
  }
  int64_t vocab_size() const override { return static_cast<int64_t>(kLogits.size()); }
  int64_t context_size() const override { return int64_t{1} << 30; }

 private:
  static at::Tensor logits(int64_t t) { return torch::tensor(kLogits).view({1, 1, -1}).expand({1, t, -1}); }
};

// softmax(kLogits / t), by the formula.
std::vector<double> softmax_at(double t) {
  std::vector<double> p;
  double total = 0;
  for (const float l : kLogits) total += std::exp(l / t);
  for (const float l : kLogits) p.push_back(std::exp(l / t) / total);
  return p;
}

double chi_square(const std::vector<int64_t>& counts, const std::vector<double>& p, int64_t n) {
  double x = 0;
  for (size_t i = 0; i < p.size(); ++i) {
    const double expected = static_cast<double>(n) * p[i];
    x += (static_cast<double>(counts[i]) - expected) * (static_cast<double>(counts[i]) - expected) / expected;
  }
  return x;
}

// N = 10,000 seeded draws at T = 2 are compared with softmax(logits / 2) by
// Pearson's chi-square, 3 degrees of freedom (4 tokens). Its upper 1e-6
// quantile is 30.66 (P(X > x) = erfc(sqrt(x/2)) + sqrt(2x/pi) e^(-x/2) for 3
// degrees), so a correct sampler fails below 31 with probability < 1e-6 over
// seeds. The temperature applied twice samples softmax(logits / 4):
// p = (.102, .167, .276, .455) against q = (.165, .212, .273, .350), a
// noncentrality N sum (q - p)^2 / p = 764, so the statistic is about 767
// with a standard deviation of about 55: it never comes near 31. The same
// draws compared with softmax(logits / 4) must be as far off (the test sees
// the difference it claims to).
TEST(Sampler, DrawsFollowSoftmaxOfLogitsOverTemperature) {
  constexpr int64_t kDraws = 10000;
  constexpr double kChiSquareBound = 31.0;
  FixedLogits model;
  const auto prompt = torch::tensor({{0}}, torch::kLong);
  const auto out = m::generate(model, prompt, m::GenerateOptions().max_new_tokens(kDraws).temperature(2.0).top_k(0).seed(5));
  ASSERT_EQ(out.size(1), kDraws + 1);
  std::vector<int64_t> counts(kLogits.size(), 0);
  for (int64_t i = 1; i <= kDraws; ++i) ++counts.at(static_cast<size_t>(out[0][i].item<int64_t>()));
  const double at_two = chi_square(counts, softmax_at(2.0), kDraws);
  EXPECT_LT(at_two, kChiSquareBound) << "counts " << counts[0] << " " << counts[1] << " " << counts[2] << " "
                                     << counts[3];
  EXPECT_GT(chi_square(counts, softmax_at(4.0), kDraws), kChiSquareBound);
}

// A temperature too small to divide by (1e-300 is 0 in fp32: infinite logits,
// NaN probabilities) is greedy, as 0 is: always the largest logit.
TEST(Sampler, ATinyTemperatureIsGreedy) {
  FixedLogits model;
  const auto prompt = torch::tensor({{0}}, torch::kLong);
  for (const double t : {1e-300, 1e-30, 1e-5}) {
    const auto out = m::generate(model, prompt, m::GenerateOptions().max_new_tokens(20).temperature(t).seed(1));
    EXPECT_TRUE(torch::equal(out.slice(1, 1), torch::full({1, 20}, 3, torch::kLong))) << t << ": " << out;
  }
}

// ---- generate's limits (issue 47, item 8) ------------------------------------------------

st::config::ModelConfig tiny_llama() {
  st::config::ModelConfig c;
  c.type = st::train::ModelType::Llama;
  c.n_layer = 1;
  c.n_head = 2;
  c.n_kv_head = 2;
  c.n_embd = 16;
  c.intermediate_size = 32;
  c.block_size = 16;
  c.vocab_size = 256;
  return c;
}

void write_model_dir(const std::string& dir) {
  const auto c = tiny_llama();
  torch::manual_seed(0);
  const auto& family = m::family_of(c.type);
  auto model = family.build(c);
  std::vector<std::pair<std::string, at::Tensor>> weights;
  for (const auto& p : model->named_parameters()) weights.emplace_back(p.key(), p.value().detach());
  m::save_hf_dir(dir, family.hf_config_json(c), weights, &family, m::kDefaultMaxShardBytes);
}

// --max-new-tokens 10^9 ran on, holding every id: more than 2^20 is a
// ConfigError (exit 2) that names the bound, before any model is read.
// --temperature 1e-300 was an untyped LibTorch error: it prints what
// --temperature 0 prints.
TEST(GenerateLimits, TooManyTokensAreRefusedATinyTemperatureIsGreedy) {
  st::testing::TempDir tmp("generate_limits");
  write_model_dir(tmp / "d");
  const std::string base = "generate --checkpoint " + tmp / "d" + " --prompt ab";
  const auto huge = st::testing::cli(base + " --max-new-tokens 1000000000", 20);
  EXPECT_EQ(huge.code, 2) << huge.out;
  EXPECT_HAS(huge.out, "--max-new-tokens 1000000000 is more than 1048576");
  const auto at_bound = st::testing::cli(base + " --max-new-tokens 1048577", 20);
  EXPECT_EQ(at_bound.code, 2) << at_bound.out;
  const auto greedy = st::testing::cli(base + " --max-new-tokens 6 --temperature 0");
  ASSERT_EQ(greedy.code, 0) << greedy.out;
  const auto tiny = st::testing::cli(base + " --max-new-tokens 6 --temperature 1e-300", 60);
  EXPECT_EQ(tiny.code, 0) << tiny.out;
  EXPECT_EQ(tiny.out, greedy.out);
}

// ---- the store's strangers per address --------------------------------------------------

// A connection to `port` on 127.0.0.1 from loopback address 127.0.0.`from`,
// established (or -1).
int connect_from(int from, int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
  sockaddr_in src{};
  src.sin_family = AF_INET;
  src.sin_addr.s_addr = htonl(0x7f000000u | static_cast<uint32_t>(from));
  if (::bind(fd, reinterpret_cast<sockaddr*>(&src), sizeof src) != 0) return ::close(fd), -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  pollfd p{fd, POLLOUT, 0};
  if (::poll(&p, 1, 2000) != 1) return ::close(fd), -1;
  return fd;
}

// Whether the store still holds `fd`: reads what it sent (its challenge, or
// a refusal) and looks for the end of the stream.
bool held(int fd) {
  char buf[256];
  for (;;) {
    const ssize_t n = ::recv(fd, buf, sizeof buf, MSG_DONTWAIT);
    if (n == 0) return false;
    if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK;
  }
}

// An idle horde of 100 connections from one address and 4 from another, all
// within the store's 3 s handshake window: the store keeps at most 64
// strangers per address (docs/security.md), whatever its total bound (512)
// leaves, so it holds at most 64 of the horde, and the other address's 4
// all survive. With only the total bound enforced it would hold all 104.
TEST(StoreStrangers, OneAddressHoldsAtMost64AndTheOthersSurvive) {
  st::comm::detail::StoreServer server("127.0.0.1", 0, "secret", [](const std::string&) {});
  std::vector<int> horde, others;
  for (int i = 0; i < 100; ++i) horde.push_back(connect_from(3, server.port()));
  for (int i = 0; i < 4; ++i) others.push_back(connect_from(2, server.port()));
  ASSERT_EQ(std::count(horde.begin(), horde.end(), -1) + std::count(others.begin(), others.end(), -1), 0);
  // The store's loop has admitted all 104 once it turned away 36 (or,
  // without the per-address bound, none): wait for that, at most 1 s.
  int from_horde = 0;
  for (int wait = 0; wait < 50; ++wait) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    if (server.refused() >= 36) break;
  }
  for (int fd : horde) from_horde += held(fd) ? 1 : 0;
  int from_others = 0;
  for (int fd : others) from_others += held(fd) ? 1 : 0;
  EXPECT_LE(from_horde, 64);
  EXPECT_GE(from_horde, 60) << "the store turned away more of the horde than its bound asks";
  EXPECT_EQ(from_others, 4) << "a few connections from another address were turned away for the horde";
  for (int fd : horde) ::close(fd);
  for (int fd : others) ::close(fd);
}

// ---- JSON nesting ------------------------------------------------------------------------

// n objects, each the only value of the one before: {"a":{"a":...{}...}}.
std::string deep_objects(int n) {
  std::string s;
  for (int i = 0; i < n; ++i) s += "{\"a\":";
  s.pop_back();
  s.pop_back();
  s.pop_back();
  s.pop_back();
  s.pop_back();
  s += "{}";
  for (int i = 1; i < n; ++i) s += "}";
  return s;
}

// n levels alternating an array and an object: [{"a":[{"a":...}]}].
std::string mixed(int n) {
  std::string open, close;
  for (int i = 0; i < n; ++i) {
    if (i % 2 == 0) {
      open += "[";
      close = "]" + close;
    } else {
      open += "{\"a\":";
      close = "}" + close;
    }
  }
  // The innermost level holds a number (an array) or is the empty object.
  if (n % 2 == 1) return open + "1" + close;
  return open.substr(0, open.size() - 5) + "{}" + close.substr(1);
}

bool refused(const std::string& text) {
  try {
    (void)st::detail::parse_json_text(text);
  } catch (const nlohmann::json::parse_error& e) {
    return std::string(e.what()).find("deeper than 64 levels") != std::string::npos;
  }
  return false;
}

// The bound is 64 levels of arrays and objects together (docs/security.md):
// 64 nested objects parse, 65 are refused, and so are 65 levels that
// alternate arrays and objects, whose arrays alone are only 33 deep. Braces
// inside strings are text.
TEST(JsonDepth, ObjectsAndMixedNestingCountAsArraysDo) {
  ASSERT_EQ(nlohmann::json::parse(deep_objects(3)), nlohmann::json::parse(R"({"a":{"a":{}}})"));
  ASSERT_EQ(nlohmann::json::parse(mixed(4)), nlohmann::json::parse(R"([{"a":[{}]}])"));
  ASSERT_EQ(nlohmann::json::parse(mixed(3)), nlohmann::json::parse(R"([{"a":[1]}])"));
  EXPECT_FALSE(refused(deep_objects(64)));
  EXPECT_TRUE(refused(deep_objects(65)));
  EXPECT_TRUE(refused(deep_objects(100000)));
  EXPECT_FALSE(refused(mixed(64)));
  EXPECT_TRUE(refused(mixed(65)));
  EXPECT_TRUE(refused(mixed(66)));
  EXPECT_FALSE(refused("{\"k\":\"" + std::string(100, '{') + "\"}"));
  nlohmann::json out;
  std::string why;
  EXPECT_FALSE(st::detail::parse_json(deep_objects(65), &out, &why));
  EXPECT_HAS(why, "deeper than 64 levels");
  EXPECT_TRUE(st::detail::parse_json_or_discarded(mixed(65)).is_discarded());
}

}  // namespace
