// Token files of both widths: version 1 (uint16, llm.c's GPT-2 layout) and
// version 2 (its width in header word 3; 4 bytes for vocabularies past
// 65,536 ids such as Llama-3's 128,256), written by write_token_file_v2 and
// served by TokenSource and WindowSampler alike.
#include <gtest/gtest.h>

#include <fstream>

#include "shardtrain/core/error.h"
#include "shardtrain/data/tokens.h"
#include "temp_dir.h"

namespace {

using shardtrain::ConfigError;
using shardtrain::InvalidArgument;
using namespace shardtrain::data;
using shardtrain::testing::TempDir;

std::vector<int32_t> header_of(const std::string& path) {
  std::vector<int32_t> header(256);
  std::ifstream(path, std::ios::binary).read(reinterpret_cast<char*>(header.data()), 1024);
  return header;
}

std::vector<int64_t> all_tokens(const TokenSource& s) {
  std::vector<int64_t> out(static_cast<size_t>(s.size()));
  s.copy_to(0, s.size(), out.data());
  return out;
}

void write_raw(const std::string& path, std::vector<int32_t> header, const std::string& payload) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(header.data()), 1024);
  out << payload;
}

std::string config_error(const std::string& path) {
  try {
    TokenSource::open(path);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

TEST(TokenizedFiles, NarrowIdsWriteVersionOneWideIdsVersionTwo) {
  TempDir dir;
  const std::vector<int32_t> narrow = {0, 1, 65535, 42};
  EXPECT_EQ(write_token_file_v2(dir / "narrow.bin", narrow), 2);
  EXPECT_EQ(header_of(dir / "narrow.bin")[1], kTokenFileVersion);
  EXPECT_EQ(all_tokens(TokenSource::open(dir / "narrow.bin")), (std::vector<int64_t>{0, 1, 65535, 42}));

  const std::vector<int32_t> wide = {128000, 9906, 65536, 128255, 0};
  EXPECT_EQ(write_token_file_v2(dir / "wide.bin", wide), 4);
  const auto header = header_of(dir / "wide.bin");
  EXPECT_EQ(header[1], kTokenFileVersionWide);
  EXPECT_EQ(header[2], 5);
  EXPECT_EQ(header[3], 4);
  const TokenSource source = TokenSource::open(dir / "wide.bin");
  EXPECT_EQ(all_tokens(source), (std::vector<int64_t>{128000, 9906, 65536, 128255, 0}));
  EXPECT_EQ(source.max_token(), 128255);
  EXPECT_EQ(all_tokens(source.slice(1, 3)), (std::vector<int64_t>{9906, 65536}));
  EXPECT_THROW(write_token_file_v2(dir / "neg.bin", {1, -5}), InvalidArgument);
}

TEST(TokenizedFiles, WindowSamplerServesWideTokens) {
  TempDir dir;
  std::vector<int32_t> tokens(1 + 4 * 8);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = 100000 + static_cast<int32_t>(i);
  write_token_file_v2(dir / "wide.bin", tokens);
  const WindowSampler sampler(TokenSource::open(dir / "wide.bin"), 8, 4, 0, false);
  const Batch b = sampler.micro_batch(0, 0, 4, 0, 1);
  EXPECT_EQ(b.input[1][0].item<int64_t>(), 100008);
  EXPECT_EQ(b.target[3][7].item<int64_t>(), 100032);
}

TEST(TokenizedFiles, LlmcVersionTwoAndVersionTwoOfWidthTwoRead) {
  TempDir dir;
  std::vector<int32_t> header(256, 0);
  header[0] = kTokenFileMagic;
  header[1] = 2;
  header[2] = 2;
  const uint32_t wide[2] = {128001, 7};
  write_raw(dir / "llmc.bin", header, std::string(reinterpret_cast<const char*>(wide), 8));  // word 3 = 0: uint32
  EXPECT_EQ(all_tokens(TokenSource::open(dir / "llmc.bin")), (std::vector<int64_t>{128001, 7}));
  header[3] = 2;
  const uint16_t narrow[2] = {513, 7};
  write_raw(dir / "v2w2.bin", header, std::string(reinterpret_cast<const char*>(narrow), 4));
  EXPECT_EQ(all_tokens(TokenSource::open(dir / "v2w2.bin")), (std::vector<int64_t>{513, 7}));
}

TEST(TokenizedFiles, WrongWidthVersionOrSizeIsAConfigErrorNamingTheFile) {
  TempDir dir;
  std::vector<int32_t> header(256, 0);
  header[0] = kTokenFileMagic;
  header[1] = 2;
  header[2] = 1;
  header[3] = 3;
  write_raw(dir / "w3.bin", header, "abc");
  std::string e = config_error(dir / "w3.bin");
  EXPECT_NE(e.find(dir / "w3.bin"), std::string::npos) << e;
  EXPECT_NE(e.find("width 3"), std::string::npos) << e;
  header[3] = 4;
  write_raw(dir / "short.bin", header, "ab");  // 2 bytes where 4 are due
  e = config_error(dir / "short.bin");
  EXPECT_NE(e.find("truncated"), std::string::npos) << e;
  header[1] = 7;
  write_raw(dir / "v7.bin", header, "abcd");
  e = config_error(dir / "v7.bin");
  EXPECT_NE(e.find("version 7"), std::string::npos) << e;
  EXPECT_NE(e.find(dir / "v7.bin"), std::string::npos) << e;
}

}  // namespace
