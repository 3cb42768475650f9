// Byte tokenizer, token files, token sources and the window sampler's order.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "shardtrain/core/error.h"
#include "shardtrain/data/tokens.h"

namespace {

namespace fs = std::filesystem;
using shardtrain::ConfigError;
using shardtrain::data::Batch;
using shardtrain::data::ByteTokenizer;
using shardtrain::data::TokenSource;
using shardtrain::data::WindowSampler;
using shardtrain::data::write_token_file;

// A scratch directory per test, removed afterwards.
class TokenFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() /
           ("shardtrain_data_" + std::to_string(::getpid()) + "_" + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  void write_bytes(const std::string& file, const std::string& bytes) const {
    std::ofstream(file, std::ios::binary) << bytes;
  }
  fs::path dir_;
};

// Asserts that `fn` throws ConfigError whose message holds every needle.
template <typename Fn>
void expect_config_error(Fn fn, const std::vector<std::string>& needles) {
  try {
    fn();
    ADD_FAILURE() << "no ConfigError";
  } catch (const ConfigError& e) {
    for (const auto& n : needles) {
      EXPECT_NE(std::string(e.what()).find(n), std::string::npos)
          << "'" << n << "' not in: " << e.what();
    }
  }
}

std::vector<int64_t> all_tokens(const TokenSource& src) {
  std::vector<int64_t> out(static_cast<size_t>(src.size()));
  src.copy_to(0, src.size(), out.data());
  return out;
}

// A source whose token at position p is p (positions stay below 65536).
TokenSource positions(int64_t n) {
  std::vector<uint16_t> tokens(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) tokens[static_cast<size_t>(i)] = static_cast<uint16_t>(i);
  return TokenSource::from_tokens(std::move(tokens));
}

// ---- tokenizer -----------------------------------------------------------------------------

TEST(ByteTokenizer, RoundTripsUtf8AndEveryByte) {
  const std::string text = "Grüße, 世界! \xF0\x9F\x99\x82\n\ttab";
  const auto ids = ByteTokenizer::encode(text);
  EXPECT_EQ(ids.size(), text.size());  // bytes, not code points
  for (auto id : ids) EXPECT_TRUE(id >= 0 && id < ByteTokenizer::kVocabSize);
  EXPECT_EQ(ByteTokenizer::decode(ids), text);

  std::string every(256, '\0');
  for (int i = 0; i < 256; ++i) every[static_cast<size_t>(i)] = static_cast<char>(i);
  const auto every_ids = ByteTokenizer::encode(every);
  for (int i = 0; i < 256; ++i) EXPECT_EQ(every_ids[static_cast<size_t>(i)], i);
  EXPECT_EQ(ByteTokenizer::decode(every_ids), every);
  EXPECT_EQ(ByteTokenizer::decode({}), "");
}

TEST(ByteTokenizer, DecodeRejectsIdsOutsideTheByteRange) {
  expect_config_error([] { ByteTokenizer::decode({65, 256}); }, {"256", "position 1"});
  expect_config_error([] { ByteTokenizer::decode({-1}); }, {"-1", "position 0"});
}

// ---- token files ---------------------------------------------------------------------------

TEST_F(TokenFiles, TokenFileRoundTripsOddSizes) {
  for (int64_t n : {1, 2, 3, 255, 1001}) {
    std::vector<uint16_t> tokens(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      tokens[static_cast<size_t>(i)] = static_cast<uint16_t>((i * 7919 + 13) % 65536);
    }
    if (n > 2) tokens[2] = 65535;
    const auto file = path("t" + std::to_string(n) + ".bin");
    write_token_file(file, tokens);
    EXPECT_EQ(fs::file_size(file), 1024u + 2u * static_cast<size_t>(n));
    const auto src = TokenSource::open(file);
    ASSERT_EQ(src.size(), n);
    EXPECT_EQ(src.origin(), file);
    const auto read = all_tokens(src);
    EXPECT_TRUE(std::equal(read.begin(), read.end(), tokens.begin()));
    EXPECT_EQ(src.max_token(), *std::max_element(tokens.begin(), tokens.end()));
  }
}

TEST_F(TokenFiles, MappedTokensOutliveTheFirstSource) {
  const auto file = path("t.bin");
  write_token_file(file, {10, 20, 30, 40, 50});
  TokenSource tail = TokenSource::open(file).slice(2, 5);  // the opener is gone
  EXPECT_EQ(all_tokens(tail), (std::vector<int64_t>{30, 40, 50}));
  EXPECT_EQ(tail.slice(1, 2).max_token(), 40);
  EXPECT_EQ(tail.slice(3, 3).size(), 0);
  EXPECT_THROW(tail.slice(2, 4), shardtrain::InvalidArgument);
  std::vector<int64_t> out(4);
  EXPECT_THROW(tail.copy_to(1, 3, out.data()), shardtrain::InvalidArgument);
}

// The rule for zero tokens: writing one is allowed, opening one is a
// ConfigError (like an empty text file), from_tokens({}) is an empty source.
TEST_F(TokenFiles, ZeroTokenFileIsAConfigErrorOnOpen) {
  const auto file = path("empty.bin");
  write_token_file(file, {});
  EXPECT_EQ(fs::file_size(file), 1024u);
  expect_config_error([&] { TokenSource::open(file); }, {file, "0 tokens"});
  EXPECT_EQ(TokenSource::from_tokens({}).size(), 0);
  EXPECT_EQ(TokenSource::from_text("").size(), 0);
}

TEST_F(TokenFiles, TruncatedTokenFileNamesFileAndSizes) {
  const auto file = path("short.bin");
  write_token_file(file, std::vector<uint16_t>(10, 7));
  fs::resize_file(file, 1024 + 17);
  expect_config_error([&] { TokenSource::open(file); },
                      {file, "truncated", "10 tokens", "1044", "1041"});
  fs::resize_file(file, 100);  // not even a whole header
  expect_config_error([&] { TokenSource::open(file); }, {file, "truncated", "1024", "100"});
}

TEST_F(TokenFiles, ForeignMissingAndEmptyFilesNameThePath) {
  // Right magic, a version we do not know (1 and 2 are read: test_token_files.cpp).
  const auto v3 = path("v3.bin");
  std::vector<int32_t> header(256, 0);
  header[0] = shardtrain::data::kTokenFileMagic;
  header[1] = 3;
  header[2] = 1;
  std::string bytes(reinterpret_cast<const char*>(header.data()), 1024);
  write_bytes(v3, bytes + std::string(4, '\1'));
  expect_config_error([&] { TokenSource::open(v3); }, {v3, "version 3"});

  // Binary without the magic (a header-less nanoGPT .bin): not text either.
  const auto raw = path("raw.bin");
  write_bytes(raw, std::string("\x10\x00\x20\x00", 4));
  expect_config_error([&] { TokenSource::open(raw); }, {raw, "neither text nor a token file"});

  const auto missing = path("no_such_file.txt");
  expect_config_error([&] { TokenSource::open(missing); }, {missing, "hint"});

  const auto empty = path("empty.txt");
  write_bytes(empty, "");
  expect_config_error([&] { TokenSource::open(empty); }, {empty, "empty"});

  expect_config_error([&] { TokenSource::open(dir_.string()); }, {dir_.string()});
}

TEST_F(TokenFiles, TextFilesAreByteTokenized) {
  const auto file = path("hello.txt");
  const std::string text = "héllo\n";
  write_bytes(file, text);
  const auto src = TokenSource::open(file);
  EXPECT_EQ(all_tokens(src), ByteTokenizer::encode(text));
  EXPECT_EQ(all_tokens(TokenSource::from_text(text)), ByteTokenizer::encode(text));
  // Short text below the size of the magic word is still text.
  write_bytes(file, "ab");
  EXPECT_EQ(TokenSource::open(file).size(), 2);
  EXPECT_EQ(TokenSource::open(file).max_token(), 'b');
}

// ---- window sampler ------------------------------------------------------------------------

TEST(WindowSampler, CountsWindowsOfBlockSizePlusOne) {
  // A window needs T + 1 tokens; windows start every T tokens.
  EXPECT_EQ(WindowSampler(positions(9), 4, 1, 0, false).num_windows(), 2);
  EXPECT_EQ(WindowSampler(positions(12), 4, 1, 0, false).num_windows(), 2);
  EXPECT_EQ(WindowSampler(positions(13), 4, 1, 0, false).num_windows(), 3);
  WindowSampler s(positions(101), 4, 6, 0, false);  // 25 windows
  EXPECT_EQ(s.num_windows(), 25);
  EXPECT_EQ(s.steps_per_epoch(), 4);
  EXPECT_EQ(s.epoch_of(3), 0);
  EXPECT_EQ(s.epoch_of(4), 1);
}

TEST(WindowSampler, SequentialOrderFollowsTheFormula) {
  const int64_t T = 5;
  for (auto [W, B, A] : std::vector<std::tuple<int, int64_t, int64_t>>{
           {1, 1, 1}, {1, 4, 1}, {3, 2, 2}, {3, 5, 1}, {2, 3, 3}, {4, 1, 2}, {6, 1, 1}}) {
    const int64_t G = W * B * A;
    const int64_t steps = 3;
    // Three steps and a partial one: the partial one is dropped from the epoch.
    WindowSampler sampler(positions((steps * G + G - 1) * T + 1), T, G, 0, false);
    ASSERT_EQ(sampler.steps_per_epoch(), steps);
    for (int64_t s = 0; s < steps + 1; ++s) {  // step 3 is epoch 1's step 0
      for (int64_t j = 0; j < A; ++j) {
        for (int k = 0; k < W; ++k) {
          const Batch b = sampler.micro_batch(s, j, B, k, W);
          ASSERT_EQ(b.input.sizes().vec(), (std::vector<int64_t>{B, T}));
          ASSERT_EQ(b.input.scalar_type(), torch::kLong);
          ASSERT_EQ(b.target.scalar_type(), torch::kLong);
          for (int64_t r = 0; r < B; ++r) {
            const int64_t se = s % steps;
            const int64_t first = ((se * A + j) * W * B + k * B + r) * T;
            const auto expected = torch::arange(first, first + T, torch::kLong);
            EXPECT_TRUE(torch::equal(b.input[r], expected))
                << "W=" << W << " B=" << B << " A=" << A << " s=" << s << " j=" << j
                << " k=" << k << " r=" << r;
            EXPECT_TRUE(torch::equal(b.target[r], expected + 1));
          }
        }
      }
    }
  }
}

// The set of windows in step s depends only on (seed, G, s): every split of G
// into world size x micro batch x accumulation sees the same windows.
TEST(WindowSampler, StepContentIsIndependentOfTheSplit) {
  const int64_t T = 3;
  const int64_t G = 8;
  const auto source = positions(21 * T + 2);  // 21 windows: 2 steps per epoch, 5 left over
  for (bool shuffle : {false, true}) {
    std::vector<std::vector<int64_t>> reference;
    for (auto [W, B, A] : std::vector<std::tuple<int, int64_t, int64_t>>{
             {1, 8, 1}, {2, 4, 1}, {2, 2, 2}, {4, 1, 2}, {1, 1, 8}, {8, 1, 1}}) {
      ASSERT_EQ(W * B * A, G);
      WindowSampler sampler(source, T, G, 1234, shuffle);
      std::vector<std::vector<int64_t>> per_step;
      for (int64_t s = 0; s < 5; ++s) {  // crosses two epoch boundaries
        std::vector<int64_t> starts;
        for (int64_t j = 0; j < A; ++j) {
          for (int k = 0; k < W; ++k) {
            const auto input = sampler.micro_batch(s, j, B, k, W).input;
            for (int64_t r = 0; r < B; ++r) starts.push_back(input[r][0].item<int64_t>());
          }
        }
        std::sort(starts.begin(), starts.end());
        EXPECT_EQ(std::adjacent_find(starts.begin(), starts.end()), starts.end())
            << "a window repeats within a step";
        for (auto start : starts) EXPECT_EQ(start % T, 0);
        per_step.push_back(starts);
      }
      if (reference.empty()) {
        reference = per_step;
      } else {
        EXPECT_EQ(per_step, reference) << "W=" << W << " B=" << B << " A=" << A
                                       << " shuffle=" << shuffle;
      }
    }
  }
}

// Windows of one epoch in visiting order (micro-batch of the whole step).
std::vector<int64_t> epoch_order(const WindowSampler& sampler, int64_t epoch, int64_t G) {
  std::vector<int64_t> order;
  for (int64_t s = 0; s < sampler.steps_per_epoch(); ++s) {
    const auto input = sampler.micro_batch(epoch * sampler.steps_per_epoch() + s, 0, G, 0, 1).input;
    for (int64_t r = 0; r < G; ++r) order.push_back(input[r][0].item<int64_t>() / input.size(1));
  }
  return order;
}

TEST(WindowSampler, EpochsReshuffleDeterministically) {
  const int64_t T = 4;
  const int64_t G = 5;
  const auto source = positions(53 * T + 1);  // 53 windows, 10 steps per epoch
  WindowSampler a(source, T, G, 7, true);
  WindowSampler b(source, T, G, 7, true);
  WindowSampler other_seed(source, T, G, 8, true);
  WindowSampler sequential(source, T, G, 7, false);

  const auto e0 = epoch_order(a, 0, G);
  const auto e1 = epoch_order(a, 1, G);
  ASSERT_EQ(e0.size(), 50u);
  for (const auto& order : {e0, e1}) {
    std::set<int64_t> unique(order.begin(), order.end());
    EXPECT_EQ(unique.size(), order.size()) << "a window repeats within an epoch";
    EXPECT_LT(*unique.rbegin(), 53);
  }
  EXPECT_NE(e0, e1);
  EXPECT_NE(e0, epoch_order(sequential, 0, G));
  EXPECT_NE(e0, epoch_order(other_seed, 0, G));
  // Same seed, same order, whatever was asked before (the cache must not leak).
  EXPECT_EQ(epoch_order(b, 1, G), e1);
  EXPECT_EQ(epoch_order(b, 0, G), e0);
  EXPECT_EQ(epoch_order(a, 0, G), e0);
  // The sequential order is the identity.
  const auto seq = epoch_order(sequential, 3, G);
  for (int64_t i = 0; i < 50; ++i) EXPECT_EQ(seq[static_cast<size_t>(i)], i);
}

TEST(WindowSampler, TooLittleDataIsAConfigError) {
  const int64_t T = 8;
  const int64_t G = 4;
  EXPECT_NO_THROW(WindowSampler(positions(G * T + 1), T, G, 0, false));
  expect_config_error([&] { WindowSampler(positions(G * T), T, G, 0, false); },
                      {"<tokens>", "3 windows", "4"});
  expect_config_error([&] { WindowSampler(TokenSource::from_tokens({}), T, G, 0, true); },
                      {"0 windows"});
  EXPECT_THROW(WindowSampler(positions(100), 0, 1, 0, false), ConfigError);
  EXPECT_THROW(WindowSampler(positions(100), 4, 0, 0, false), ConfigError);
}

TEST(WindowSampler, RejectsSplitsPastTheGlobalBatch) {
  WindowSampler sampler(positions(100), 4, 6, 0, false);
  EXPECT_NO_THROW(sampler.micro_batch(0, 2, 1, 1, 2));
  EXPECT_THROW(sampler.micro_batch(0, 3, 1, 1, 2), shardtrain::InvalidArgument);
  EXPECT_THROW(sampler.micro_batch(0, 0, 4, 1, 2), shardtrain::InvalidArgument);
  EXPECT_THROW(sampler.micro_batch(0, 0, 1, 2, 2), shardtrain::InvalidArgument);
  EXPECT_THROW(sampler.micro_batch(-1, 0, 1, 0, 1), shardtrain::InvalidArgument);
}

// ---- the bundled corpus --------------------------------------------------------------------

TEST(Corpus, BundledCorpusOpensAndIsLargeEnough) {
  const std::string file = std::string(SHARDTRAIN_SOURCE_DIR) + "/data/corpus.txt";
  const auto src = TokenSource::open(file);
  EXPECT_GE(src.size(), 500000);
  EXPECT_LE(src.size(), 5 * 1024 * 1024);
  EXPECT_LT(src.max_token(), ByteTokenizer::kVocabSize);
  WindowSampler sampler(src, 256, 32, 1, true);
  const auto batch = sampler.micro_batch(0, 0, 32, 0, 1);
  EXPECT_TRUE(torch::equal(batch.input.slice(1, 1), batch.target.slice(1, 0, 255)));
}

}  // namespace
