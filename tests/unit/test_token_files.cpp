// Token files of both widths: version 1 (uint16, llm.c's GPT-2 layout) and
// version 2 (its width in header word 3; 4 bytes for vocabularies past
// 65,536 ids such as Llama-3's 128,256), written by write_token_file_v2 and
// served by TokenSource and WindowSampler alike.
#include <gtest/gtest.h>
#include <unistd.h>

#include <fstream>

#include "shardtrain/core/error.h"
#include "shardtrain/data/tokens.h"
#include "temp_dir.h"
#include "test_helpers.h"

namespace {

using shardtrain::ConfigError;
using shardtrain::InvalidArgument;
using namespace shardtrain::data;
using shardtrain::testing::cli;
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

std::string token_file_error(const std::string& path) {
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
  std::string e = token_file_error(dir / "w3.bin");
  EXPECT_NE(e.find(dir / "w3.bin"), std::string::npos) << e;
  EXPECT_NE(e.find("width 3"), std::string::npos) << e;
  header[3] = 4;
  write_raw(dir / "short.bin", header, "ab");  // 2 bytes where 4 are due
  e = token_file_error(dir / "short.bin");
  EXPECT_NE(e.find("truncated"), std::string::npos) << e;
  header[1] = 7;
  write_raw(dir / "v7.bin", header, "abcd");
  e = token_file_error(dir / "v7.bin");
  EXPECT_NE(e.find("version 7"), std::string::npos) << e;
  EXPECT_NE(e.find(dir / "v7.bin"), std::string::npos) << e;
}

// ---- shardtrain tokenize ---------------------------------------------------------------

void write_text(const std::string& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; }

// A byte-level BPE over the letters a-c (no merges) whose template ends
// documents with </s> (id 300): its EOS.
void write_small_tokenizer(const std::string& path) {
  std::string vocab;
  for (int b = 0; b < 256; ++b) vocab += "\"<0x" + std::string(1, "0123456789ABCDEF"[b / 16]) + "0123456789ABCDEF"[b % 16] + ">\": " + std::to_string(b) + ", ";
  write_text(path, R"({"added_tokens": [{"id": 300, "content": "</s>", "special": true}],
    "normalizer": null, "pre_tokenizer": null, "decoder": {"type": "ByteFallback"},
    "post_processor": {"type": "TemplateProcessing", "single": [{"Sequence": {"id": "A", "type_id": 0}},
       {"SpecialToken": {"id": "</s>", "type_id": 0}}], "special_tokens": {"</s>": {"id": "</s>", "ids": [300], "tokens": ["</s>"]}}},
    "model": {"type": "BPE", "byte_fallback": true, "vocab": {)" + vocab + R"("a": 256}, "merges": []}})");
}

// A token file cut short while training (re-copied, regenerated in place)
// once killed the rank with SIGBUS through its memory map and no message.
// Now the read names the file and is an IoError (exit 3) (issue 28, item 12).
TEST(TokenizedFiles, FileTruncatedWhileTrainingIsAnIoErrorNamingIt) {
  TempDir tmp;
  for (const bool wide : {false, true}) {
    const std::string path = tmp / (wide ? "wide.bin" : "narrow.bin");
    std::vector<int32_t> ids(100000);
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>(i % 200) + (wide ? 70000 : 0);
    ASSERT_EQ(write_token_file_v2(path, ids), wide ? 4 : 2);
    const TokenSource source = TokenSource::open(path);
    std::vector<int64_t> out(64);
    source.copy_to(90000, 64, out.data());
    EXPECT_EQ(out[0], ids[90000]);
    ASSERT_EQ(::truncate(path.c_str(), 4096), 0);
    source.copy_to(10, 64, out.data());  // what is still there reads
    EXPECT_EQ(out[3], ids[13]);
    try {
      source.copy_to(90000, 64, out.data());
      ADD_FAILURE() << "a read past the truncated end did not throw";
    } catch (const shardtrain::IoError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("token file '" + path + "' is shorter than when training started: tokens 90000..90063 of 100000 lie beyond its 4096 bytes now"), std::string::npos) << msg;
      EXPECT_NE(msg.find("truncated or replaced while training"), std::string::npos) << msg;
    }
    EXPECT_THROW(source.max_token(), shardtrain::IoError);
  }
}

TEST(TokenizedFiles, CliTokenizesTextAndJsonLinesInOrderWithEosBetween) {
  TempDir dir;
  write_small_tokenizer(dir / "tokenizer.json");
  write_text(dir / "one.txt", "ab");
  write_text(dir / "docs.jsonl", "{\"text\": \"a\"}\n\n{\"text\": \"ba\", \"id\": 2}\n");
  const auto run = cli("tokenize --tokenizer " + dir.path() + " --out " + dir / "out1.bin" + " --threads 1 " +
                       dir / "one.txt" + " " + dir / "docs.jsonl");
  ASSERT_EQ(run.code, 0) << run.out;
  EXPECT_NE(run.out.find("3 documents"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("MB/s"), std::string::npos) << run.out;
  // "ab" | EOS | "a" | EOS | "ba": a is 256, b falls back to its byte 0x62.
  EXPECT_EQ(all_tokens(TokenSource::open(dir / "out1.bin")), (std::vector<int64_t>{256, 0x62, 300, 256, 300, 0x62, 256}));
  // More threads than documents, same file.
  const auto run3 = cli("tokenize --tokenizer " + dir / "tokenizer.json" + " --out " + dir / "out3.bin" +
                        " --threads 3 --quiet " + dir / "one.txt" + " " + dir / "docs.jsonl");
  ASSERT_EQ(run3.code, 0) << run3.out;
  EXPECT_EQ(all_tokens(TokenSource::open(dir / "out3.bin")), all_tokens(TokenSource::open(dir / "out1.bin")));
  const auto bytes = cli("tokenize --tokenizer bytes --out " + dir / "bytes.bin" + " " + dir / "one.txt" + " " + dir / "one.txt");
  ASSERT_EQ(bytes.code, 0) << bytes.out;
  EXPECT_EQ(all_tokens(TokenSource::open(dir / "bytes.bin")), (std::vector<int64_t>{'a', 'b', 'a', 'b'}));  // no EOS
}

TEST(TokenizedFiles, CliErrorsNameTheInputAndTheTokenizer) {
  TempDir dir;
  write_text(dir / "bad.jsonl", "{\"text\": \"a\"}\n{\"body\": 1}\n");
  auto run = cli("tokenize --tokenizer bytes --out " + dir / "o.bin" + " " + dir / "bad.jsonl");
  EXPECT_NE(run.code, 0);
  EXPECT_NE(run.out.find("bad.jsonl:2"), std::string::npos) << run.out;
  run = cli("tokenize --tokenizer " + dir / "nope.json" + " --out " + dir / "o.bin" + " " + dir / "bad.jsonl");
  EXPECT_NE(run.code, 0);
  EXPECT_NE(run.out.find("nope.json"), std::string::npos) << run.out;
  run = cli("tokenize --out " + dir / "o.bin" + " x.txt");
  EXPECT_NE(run.out.find("--tokenizer"), std::string::npos) << run.out;
}

}  // namespace
