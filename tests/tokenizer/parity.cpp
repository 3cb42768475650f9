// Token-for-token parity of our tokenizer.json implementation with
// independent ones (expected.cjs writes what they produce): encode with and
// without special tokens, and decode with and without skipping them, on a
// corpus with accents, CJK, emoji, digit runs, whitespace runs, \r\n and
// special tokens written in the text.
//
// Run by ctest as tokenizer.parity.<model> after the tokenizer.parity.setup
// fixture; TOKENIZER_PARITY_DIR is the directory expected.cjs wrote.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdlib>
#include <fstream>
#include <thread>

#include "shardtrain/data/tokenizer.h"

namespace {

using nlohmann::json;
using shardtrain::data::load_tokenizer;
using shardtrain::data::Tokenizer;

const json& expected() {
  static const json j = [] {
    const char* dir = std::getenv("TOKENIZER_PARITY_DIR");
    if (dir == nullptr) throw std::runtime_error("TOKENIZER_PARITY_DIR is not set (ctest's tokenizer.parity.setup sets it up)");
    std::ifstream in(std::string(dir) + "/expected.json");
    if (!in.good()) throw std::runtime_error(std::string("cannot read ") + dir + "/expected.json");
    return json::parse(in);
  }();
  return j;
}

const json& model_cases(const std::string& name) {
  for (const json& m : expected().at("models")) {
    if (m.at("name") == name) return m;
  }
  throw std::runtime_error("expected.json has no model " + name);
}

// Where two id lists first differ, with a few ids of context, for messages.
std::string first_difference(const std::vector<int32_t>& ours, const std::vector<int32_t>& theirs) {
  size_t i = 0;
  while (i < ours.size() && i < theirs.size() && ours[i] == theirs[i]) ++i;
  std::string s = "first difference at index " + std::to_string(i) + " (sizes " + std::to_string(ours.size()) +
                  " vs " + std::to_string(theirs.size()) + "): ours [";
  for (size_t k = i; k < ours.size() && k < i + 6; ++k) s += std::to_string(ours[k]) + " ";
  s += "] theirs [";
  for (size_t k = i; k < theirs.size() && k < i + 6; ++k) s += std::to_string(theirs[k]) + " ";
  return s + "]";
}

void check_model(const std::string& name) {
  const json& m = model_cases(name);
  const auto tok = load_tokenizer(m.at("dir").get<std::string>());
  ASSERT_EQ(tok->kind(), "tokenizer.json");
  size_t total = 0;
  for (const json& c : m.at("cases")) {
    const std::string text = c.at("text");
    const auto want = c.at("ids").get<std::vector<int32_t>>();
    const auto want_special = c.at("ids_special").get<std::vector<int32_t>>();
    const auto ids = tok->encode(text);
    EXPECT_EQ(ids, want) << name << " encode of " << json(text).dump().substr(0, 200) << ": " << first_difference(ids, want);
    const auto ids_special = tok->encode(text, true);
    EXPECT_EQ(ids_special, want_special) << name << " encode with special tokens of " << json(text).dump().substr(0, 200)
                                         << ": " << first_difference(ids_special, want_special);
    EXPECT_EQ(json(tok->decode(want)).dump(), json(c.at("decoded")).dump()) << name << " decode";
    EXPECT_EQ(json(tok->decode(want, true)).dump(), json(c.at("decoded_skip")).dump()) << name << " decode, skipping special tokens";
    const auto each = c.at("decoded_each").get<std::vector<std::string>>();
    for (size_t i = 0; i < each.size(); ++i) {
      EXPECT_EQ(json(tok->decode({want[i]})).dump(), json(each[i]).dump()) << name << " decode of the single id " << want[i];
    }
    total += want.size();
  }
  EXPECT_GT(total, 1000u) << "the corpus should give more than a few tokens";
}

TEST(TokenizerParity, Llama3) { check_model("llama3"); }
TEST(TokenizerParity, Qwen3) { check_model("qwen3"); }
TEST(TokenizerParity, Llama2) { check_model("llama2"); }
// Llama-2's vocabulary behind a Metaspace pre-tokenizer (prepend_scheme
// "first": no "▁" after a special token) and a Metaspace decoder.
TEST(TokenizerParity, Llama2Metaspace) { check_model("llama2-metaspace"); }
TEST(TokenizerParity, Gpt2) { check_model("gpt2"); }
// Byte fallback, a Replace normalizer, Split MergedWithPrevious and 6,415
// added tokens, special and not (runs of spaces and newlines among them).
TEST(TokenizerParity, Gemma3) { check_model("gemma3"); }

// GPT-2's own encoder (gpt-3-encoder), not a tokenizer.json implementation.
TEST(TokenizerParity, Gpt2Encoder) {
  const auto tok = load_tokenizer(model_cases("gpt2").at("dir").get<std::string>());
  for (const json& c : expected().at("gpt2_encoder")) {
    const std::string text = c.at("text");
    const auto want = c.at("ids").get<std::vector<int32_t>>();
    const auto ids = tok->encode(text);
    EXPECT_EQ(ids, want) << "gpt-3-encoder of " << json(text).dump().substr(0, 200) << ": " << first_difference(ids, want);
  }
}

// encode is const and thread-safe: four threads over the whole corpus, each
// several times (caches warm and cold), give the single-thread ids.
TEST(TokenizerParity, ThreadSafeEncode) {
  for (const char* name : {"llama3", "llama2"}) {
    const json& m = model_cases(name);
    const auto tok = load_tokenizer(m.at("dir").get<std::string>());
    std::vector<std::string> texts;
    std::vector<std::vector<int32_t>> want;
    for (const json& c : m.at("cases")) {
      texts.push_back(c.at("text"));
      want.push_back(c.at("ids").get<std::vector<int32_t>>());
    }
    std::vector<int> bad(4, 0);
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&, t] {
        for (int round = 0; round < 3; ++round) {
          for (size_t i = 0; i < texts.size(); ++i) {
            const size_t k = (i + static_cast<size_t>(t) * 7) % texts.size();
            if (tok->encode(texts[k]) != want[k]) ++bad[static_cast<size_t>(t)];
          }
        }
      });
    }
    for (auto& th : threads) th.join();
    for (int t = 0; t < 4; ++t) EXPECT_EQ(bad[static_cast<size_t>(t)], 0) << name << " thread " << t;
  }
}

}  // namespace
