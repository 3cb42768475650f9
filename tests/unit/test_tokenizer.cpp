// Tokenizers on small hand-written files, where every expected id can be
// worked out by hand: BPE merges in both spellings, byte fallback, unk and
// fuse_unk, added tokens (lstrip, rstrip, single_word), the template's
// BOS/EOS and tokenizer_config.json, each pre-tokenizer behaviour,
// normalizers, decoders, SentencePiece, "bytes"/"auto" and the errors,
// and hostile files (ids, expansion, files that are not regular files),
// refused by the rules docs/security.md states.
// Parity with real tokenizers is tests/tokenizer/parity.cpp.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>

#include "data/tokenizer_pipeline.h"
#include "shardtrain/core/error.h"
#include "shardtrain/data/tokenizer.h"
#include "temp_dir.h"

#ifndef MAKE_SPM_MODEL_PATH
#error "MAKE_SPM_MODEL_PATH must be the path of tests/tokenizer/make_spm_model"
#endif

namespace {

using nlohmann::json;
using shardtrain::ConfigError;
using shardtrain::data::load_tokenizer;
using shardtrain::testing::TempDir;
using namespace shardtrain::data::detail;

using Ids = std::vector<int32_t>;
const std::string kMeta = "\xE2\x96\x81";  // ▁

void write(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

// A character-level BPE with merges in both spellings, byte fallback for
// 'A' only, and added tokens of every kind.
json small_tokenizer() {
  json vocab = {{"<unk>", 0}, {"a", 1},  {"b", 2},       {"c", 3},      {"ab", 4}, {"abc", 5}, {kMeta, 6},
                {kMeta + "a", 7}, {"<0x41>", 8}, {"d", 9}, {"cd", 10}, {"x", 14}, {" ", 15}};
  return json{
      {"version", "1.0"},
      {"added_tokens",
       {{{"id", 20}, {"content", "<s>"}, {"special", true}, {"normalized", false}},
        {{"id", 21}, {"content", "<mask>"}, {"special", true}, {"lstrip", true}, {"rstrip", true}, {"normalized", false}},
        {{"id", 22}, {"content", "[w]"}, {"special", false}, {"single_word", true}, {"normalized", false}},
        {{"id", 23}, {"content", "</s>"}, {"special", true}, {"normalized", false}}}},
      {"normalizer", nullptr},
      {"pre_tokenizer", nullptr},
      {"post_processor",
       {{"type", "TemplateProcessing"},
        {"single", {{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}}, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
                    {{"SpecialToken", {{"id", "</s>"}, {"type_id", 0}}}}}},
        {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {20}}, {"tokens", {"<s>"}}}},
                            {"</s>", {{"id", "</s>"}, {"ids", {23}}, {"tokens", {"</s>"}}}}}}}},
      {"decoder", {{"type", "Sequence"}, {"decoders", {{{"type", "ByteFallback"}}, {{"type", "Fuse"}}}}}},
      {"model",
       {{"type", "BPE"}, {"unk_token", "<unk>"}, {"fuse_unk", true}, {"byte_fallback", true}, {"vocab", vocab},
        {"merges", json::array({json("a b"), json::array({"ab", "c"}), json(kMeta + " a"), json("c d")})}}}};
}

std::shared_ptr<const shardtrain::data::Tokenizer> load_json(const TempDir& dir, const json& j, const std::string& name = "tokenizer.json") {
  write(dir / name, j.dump());
  return load_tokenizer(dir / name);
}

TEST(TokenizerBpe, MergesInBothSpellingsLowestRankFirst) {
  TempDir dir;
  const auto tok = load_json(dir, small_tokenizer());
  EXPECT_EQ(tok->kind(), "tokenizer.json");
  EXPECT_EQ(tok->encode("abc"), (Ids{5}));      // a b -> ab, then ["ab", "c"] -> abc
  EXPECT_EQ(tok->encode("abcd"), (Ids{5, 9}));  // c d (rank 3) loses to ab c (rank 1)
  EXPECT_EQ(tok->encode("cdab"), (Ids{10, 4}));
  EXPECT_EQ(tok->vocab_size(), 24);
  EXPECT_EQ(tok->token_to_id("abc"), 5);
  EXPECT_EQ(tok->token_to_id("<mask>"), 21);
  EXPECT_FALSE(tok->token_to_id("zzz"));
}

TEST(TokenizerBpe, ByteFallbackThenUnkFused) {
  TempDir dir;
  json j = small_tokenizer();
  auto tok = load_json(dir, j);
  EXPECT_EQ(tok->encode("A"), (Ids{8}));               // <0x41>
  EXPECT_EQ(tok->encode("a\xC3\xA9\xC3\xA9" "b"), (Ids{1, 0, 2}));  // é has no byte tokens: one fused unk
  EXPECT_EQ(tok->decode({8, 1}), "Aa");
  j["model"]["fuse_unk"] = false;
  tok = load_json(dir, j);
  EXPECT_EQ(tok->encode("a\xC3\xA9\xC3\xA9" "b"), (Ids{1, 0, 0, 2}));
  // Invalid UTF-8 input is repaired (U+FFFD) before encoding, never an error.
  EXPECT_EQ(tok->encode("a\xFF"), (Ids{1, 0}));
}

TEST(TokenizerAddedTokens, MatchedBeforeTheModelWithStripAndSingleWord) {
  TempDir dir;
  const auto tok = load_json(dir, small_tokenizer());
  EXPECT_EQ(tok->encode("a<s>b"), (Ids{1, 20, 2}));
  EXPECT_EQ(tok->encode("a </s>"), (Ids{1, 15, 23}));
  EXPECT_EQ(tok->encode("a  <mask>  b"), (Ids{1, 21, 2}));  // lstrip and rstrip swallow the spaces
  EXPECT_EQ(tok->encode("x[w]x"), (Ids{14, 0, 14}));       // single_word: inside a word it is text
  EXPECT_EQ(tok->encode("x [w] x"), (Ids{14, 15, 22, 15, 14}));
  EXPECT_EQ(tok->decode({20, 1, 21, 2, 23}), "<s>a<mask>b</s>");
  EXPECT_EQ(tok->decode({20, 1, 21, 2, 22, 23}, true), "ab[w]");  // [w] is not special
}

TEST(TokenizerAddedTokens, NormalizedOnesAreMatchedInNormalizedText) {
  TempDir dir;
  json j = small_tokenizer();
  j["normalizer"] = {{"type", "Lowercase"}};
  j["added_tokens"].push_back({{"id", 24}, {"content", "<Mask2>"}, {"special", false}, {"normalized", true}});
  const auto tok = load_json(dir, j);
  EXPECT_EQ(tok->encode("A<MASK2>b"), (Ids{1, 24, 2}));  // lowercased, then matched as "<mask2>"
  EXPECT_EQ(tok->decode({24}), "<Mask2>");               // decoded as written
  EXPECT_EQ(tok->token_to_id("<Mask2>"), 24);
}

TEST(TokenizerAddedTokens, BosEosFromTheTemplateOrTokenizerConfig) {
  TempDir dir;
  auto tok = load_json(dir, small_tokenizer());
  EXPECT_EQ(tok->encode("ab", true), (Ids{20, 4, 23}));
  EXPECT_EQ(tok->bos_id(), 20);
  EXPECT_EQ(tok->eos_id(), 23);
  const std::string fingerprint = tok->fingerprint();
  write(dir / "tokenizer_config.json", R"({"bos_token": "<s>", "eos_token": {"content": "<mask>", "lstrip": true}})");
  tok = load_tokenizer(dir.path());  // a directory: its tokenizer.json
  EXPECT_EQ(tok->bos_id(), 20);
  EXPECT_EQ(tok->eos_id(), 21);
  EXPECT_NE(tok->fingerprint(), fingerprint);  // the config decides ids too
}

TEST(TokenizerAddedTokens, DecodeRejectsIdsOutsideTheVocabulary) {
  TempDir dir;
  const auto tok = load_json(dir, small_tokenizer());
  for (const int32_t id : {-1, 16, 24, 1000}) {
    try {
      tok->decode({1, id});
      FAIL() << "id " << id << " decoded";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("id " + std::to_string(id)), std::string::npos) << e.what();
    }
  }
}

TEST(TokenizerBpe, ContinuingSubwordPrefixAndEndOfWordSuffix) {
  // The subword-nmt spelling: "##" on inner characters, "</w>" on the last.
  TempDir dir;
  json j = small_tokenizer();
  j["added_tokens"] = json::array();
  j["post_processor"] = nullptr;
  j["decoder"] = nullptr;
  j["model"] = {{"type", "BPE"},
                {"continuing_subword_prefix", "##"},
                {"end_of_word_suffix", "</w>"},
                {"vocab", {{"a", 0}, {"##b", 1}, {"ab", 2}, {"##c</w>", 3}, {"abc</w>", 4}}},
                {"merges", {"a ##b", "ab ##c</w>"}}};
  const auto tok = load_json(dir, j);
  EXPECT_EQ(tok->encode("abc"), (Ids{4}));
  EXPECT_EQ(tok->encode("ac"), (Ids{0, 3}));
  EXPECT_EQ(tok->decode({0, 3}), "a ##c</w>");  // no decoder: tokens joined by spaces, as Hugging Face does
}

// ---- pre-tokenizers -------------------------------------------------------------------

std::vector<std::string> pre_tokenize(const json& j, const std::string& text, bool at_start = true) {
  const auto p = make_pre_tokenizer(j, "test");
  std::vector<std::string> out;
  p->pre_tokenize(PreToken{text, at_start}, [&out](PreToken&& piece) { out.push_back(piece.text); });
  return out;
}

using Strings = std::vector<std::string>;

json split(const std::string& behavior, bool invert = false) {
  return {{"type", "Split"}, {"pattern", {{"String", "-"}}}, {"behavior", behavior}, {"invert", invert}};
}

TEST(TokenizerPreTokenizers, SplitBehaviours) {
  EXPECT_EQ(pre_tokenize(split("Isolated"), "a-b--c"), (Strings{"a", "-", "b", "-", "-", "c"}));
  EXPECT_EQ(pre_tokenize(split("Removed"), "a-b--c"), (Strings{"a", "b", "c"}));
  EXPECT_EQ(pre_tokenize(split("MergedWithPrevious"), "a-b--c"), (Strings{"a-", "b-", "-", "c"}));
  EXPECT_EQ(pre_tokenize(split("MergedWithNext"), "a-b--c"), (Strings{"a", "-b", "-", "-c"}));
  EXPECT_EQ(pre_tokenize(split("Contiguous"), "a-b--c"), (Strings{"a", "-", "b", "--", "c"}));
  // Inverted, each match of "-" is its own piece: Hugging Face flips the
  // flags of the matches, it does not merge them.
  EXPECT_EQ(pre_tokenize(split("Removed", true), "a-b--c"), (Strings{"-", "-", "-"}));
  EXPECT_EQ(pre_tokenize(split("Isolated"), "-"), (Strings{"-"}));
  EXPECT_EQ(pre_tokenize(split("Isolated"), ""), (Strings{}));
  // A regex with Unicode classes and look-ahead (GPT-2's whitespace rule).
  const json ws = {{"type", "Split"}, {"pattern", {{"Regex", R"(\s+(?!\S)|\s+|\p{L}+)"}}}, {"behavior", "Isolated"}};
  EXPECT_EQ(pre_tokenize(ws, "\xC3\xA9t\xC3\xA9   x"), (Strings{"\xC3\xA9t\xC3\xA9", "  ", " ", "x"}));
}

TEST(TokenizerPreTokenizers, MetaspacePrependSchemes) {
  const auto meta = [](const std::string& scheme, bool split) {
    return json{{"type", "Metaspace"}, {"replacement", kMeta}, {"prepend_scheme", scheme}, {"split", split}};
  };
  EXPECT_EQ(pre_tokenize(meta("always", true), "hi you"), (Strings{kMeta + "hi", kMeta + "you"}));
  EXPECT_EQ(pre_tokenize(meta("always", false), "hi you"), (Strings{kMeta + "hi" + kMeta + "you"}));
  EXPECT_EQ(pre_tokenize(meta("first", true), "hi you", true), (Strings{kMeta + "hi", kMeta + "you"}));
  EXPECT_EQ(pre_tokenize(meta("first", true), "hi you", false), (Strings{"hi", kMeta + "you"}));
  EXPECT_EQ(pre_tokenize(meta("never", true), "hi  you"), (Strings{"hi", kMeta, kMeta + "you"}));
}

TEST(TokenizerPreTokenizers, DigitsByteLevelAndSequence) {
  EXPECT_EQ(pre_tokenize({{"type", "Digits"}, {"individual_digits", true}}, "ab123c"), (Strings{"ab", "1", "2", "3", "c"}));
  EXPECT_EQ(pre_tokenize({{"type", "Digits"}, {"individual_digits", false}}, "ab123c"), (Strings{"ab", "123", "c"}));
  const json byte_level = {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"use_regex", true}};
  // U+0120 "Ġ" is the space, U+010A "Ċ" the newline; é's bytes C3 A9 are "Ã©".
  EXPECT_EQ(pre_tokenize(byte_level, "hi there\n\xC3\xA9"),
            (Strings{"\xC4\xA0hi", "\xC4\xA0there", "\xC4\x8A", "\xC3\x83\xC2\xA9"}));
  const json seq = {{"type", "Sequence"}, {"pretokenizers", {{{"type", "Digits"}, {"individual_digits", true}}, byte_level}}};
  EXPECT_EQ(pre_tokenize(seq, "a12"), (Strings{"\xC4\xA0" "a", "\xC4\xA0" "1", "\xC4\xA0" "2"}));
}

TEST(TokenizerPreTokenizers, WhitespaceAndWhitespaceSplit) {
  EXPECT_EQ(pre_tokenize({{"type", "Whitespace"}}, "Hi, you!  ok"), (Strings{"Hi", ",", "you", "!", "ok"}));
  EXPECT_EQ(pre_tokenize({{"type", "WhitespaceSplit"}}, " a  b\tc\n"), (Strings{"a", "b", "c"}));
}

// ---- normalizers and decoders -----------------------------------------------------------

std::string normalize(const json& j, std::string text) {
  make_normalizer(j, "test")->normalize(text);
  return text;
}

TEST(TokenizerNormalizers, UnicodeFormsReplacePrependSequence) {
  EXPECT_EQ(normalize({{"type", "NFC"}}, "e\xCC\x81"), "\xC3\xA9");
  EXPECT_EQ(normalize({{"type", "NFKC"}}, "\xEF\xAC\x81le"), "file");  // the "fi" ligature
  EXPECT_EQ(normalize({{"type", "NFC"}}, "\xEF\xAC\x81"), "\xEF\xAC\x81");
  EXPECT_EQ(normalize({{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", kMeta}}, "a b  c"),
            "a" + kMeta + "b" + kMeta + kMeta + "c");
  EXPECT_EQ(normalize({{"type", "Replace"}, {"pattern", {{"Regex", R"(\d+)"}}}, {"content", "#"}}, "a12b3"), "a#b#");
  const json llama2 = {{"type", "Sequence"},
                       {"normalizers", {{{"type", "Prepend"}, {"prepend", kMeta}},
                                        {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", kMeta}}}}};
  EXPECT_EQ(normalize(llama2, "hi you"), kMeta + "hi" + kMeta + "you");
  EXPECT_EQ(normalize(llama2, ""), "");
  EXPECT_EQ(normalize({{"type", "Lowercase"}}, "\xC3\x80" "B"), "\xC3\xA0" "b");
  EXPECT_EQ(normalize({{"type", "Strip"}, {"strip_left", true}, {"strip_right", true}}, " \t a b \xE3\x80\x80"), "a b");
  EXPECT_EQ(normalize({{"type", "NFD"}}, "\xC3\xA9"), "e\xCC\x81");
}

std::string decode(const json& j, const std::vector<std::string>& tokens) {
  std::vector<DecodePiece> pieces;
  for (const auto& t : tokens) pieces.push_back(DecodePiece{t, false});
  make_decoder(j, "test")->decode(pieces);
  std::string out;
  for (const auto& p : pieces) out += p.text;
  return out;
}

TEST(TokenizerDecoders, ByteFallbackStripMetaspaceByteLevel) {
  const json fallback = {{"type", "ByteFallback"}};
  EXPECT_EQ(decode(fallback, {"<0xC3>", "<0xA9>", "x"}), "\xC3\xA9x");
  EXPECT_EQ(decode(fallback, {"<0xC3>", "x"}), "\xEF\xBF\xBDx");  // an incomplete character: U+FFFD
  EXPECT_EQ(decode({{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 1}}, {"  a  "}), " a ");
  EXPECT_EQ(decode({{"type", "Metaspace"}, {"replacement", kMeta}, {"prepend_scheme", "always"}},
                   {kMeta + "hi", kMeta + "you"}),
            "hi you");
  EXPECT_EQ(decode({{"type", "ByteLevel"}}, {"\xC4\xA0hi", "\xC3\x83", "\xC2\xA9"}), " hi\xC3\xA9");
  const json llama2 = {{"type", "Sequence"},
                       {"decoders", {{{"type", "Replace"}, {"pattern", {{"String", kMeta}}}, {"content", " "}},
                                     {{"type", "ByteFallback"}}, {{"type", "Fuse"}},
                                     {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}}}};
  EXPECT_EQ(decode(llama2, {kMeta + "hi", kMeta, "<0x41>"}), "hi A");
}

// ---- load_tokenizer and its errors ---------------------------------------------------------

std::string load_error(const std::string& spec) {
  try {
    load_tokenizer(spec);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

TEST(TokenizerLoad, BytesAndAuto) {
  const auto bytes = load_tokenizer("bytes");
  EXPECT_EQ(bytes->kind(), "bytes");
  EXPECT_EQ(bytes->vocab_size(), 256);
  EXPECT_EQ(bytes->encode("h\xC3\xA9"), (Ids{104, 0xC3, 0xA9}));
  EXPECT_EQ(bytes->decode({104, 0xC3, 0xA9}), "h\xC3\xA9");
  EXPECT_FALSE(bytes->eos_id());
  EXPECT_THROW(bytes->decode({256}), ConfigError);
  TempDir dir;
  EXPECT_EQ(load_tokenizer("auto", dir.path())->kind(), "bytes");
  EXPECT_EQ(load_tokenizer("auto")->kind(), "bytes");
  write(dir / "tokenizer.json", small_tokenizer().dump());
  EXPECT_EQ(load_tokenizer("auto", dir.path())->kind(), "tokenizer.json");
}

TEST(TokenizerLoad, ErrorsNameTheFileTheTypeAndWhatIsSupported) {
  TempDir dir;
  std::string e = load_error(dir / "missing.json");
  EXPECT_NE(e.find("missing.json"), std::string::npos) << e;
  EXPECT_NE(e.find("hint:"), std::string::npos) << e;
  e = load_error(dir.path());
  EXPECT_NE(e.find("neither tokenizer.json nor tokenizer.model"), std::string::npos) << e;

  json j = small_tokenizer();
  j["model"]["type"] = "Unigram";
  write(dir / "unigram.json", j.dump());
  e = load_error(dir / "unigram.json");
  EXPECT_NE(e.find("unigram.json"), std::string::npos) << e;
  EXPECT_NE(e.find("'Unigram'"), std::string::npos) << e;
  EXPECT_NE(e.find("supported: BPE"), std::string::npos) << e;

  j = small_tokenizer();
  j["pre_tokenizer"] = {{"type", "BertPreTokenizer"}};
  write(dir / "bert.json", j.dump());
  e = load_error(dir / "bert.json");
  EXPECT_NE(e.find("'BertPreTokenizer'"), std::string::npos) << e;
  EXPECT_NE(e.find("Metaspace"), std::string::npos) << e;
  EXPECT_EQ(e.find('\n'), std::string::npos) << "one line: " << e;

  write(dir / "broken.json", "{\"model\": ");
  e = load_error(dir / "broken.json");
  EXPECT_NE(e.find("not valid JSON"), std::string::npos) << e;
  write(dir / "garbage.model", "not a model");
  e = load_error(dir / "garbage.model");
  EXPECT_NE(e.find("not a SentencePiece model"), std::string::npos) << e;
}

// ---- hostile tokenizer.json files ------------------------------------------------------------
// Each is refused at load with a ConfigError that names the file and the
// entry. The bounds are the ones docs/security.md states: ids are integers in
// [0, 2 * (ids defined) + 1024), a document may grow in normalization to
// 16 times its size plus 4096 bytes.

// The error loading `j` as DIR/tokenizer.json gives ("" when it loads).
std::string hostile_error(const TempDir& dir, const json& j) {
  write(dir / "tokenizer.json", j.dump());
  try {
    load_tokenizer(dir / "tokenizer.json");
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

void expect_names(const std::string& error, const std::vector<std::string>& parts) {
  ASSERT_FALSE(error.empty()) << "loaded; expected an error naming " << parts.front();
  for (const auto& part : parts) EXPECT_NE(error.find(part), std::string::npos) << "no '" << part << "' in: " << error;
  EXPECT_EQ(error.find('\n'), std::string::npos) << "one line: " << error;
}

// Ten letters a..j with ids 0..9, no added tokens, nothing around the model.
json ten_letters() {
  json vocab = json::object();
  for (int i = 0; i < 10; ++i) vocab[std::string(1, static_cast<char>('a' + i))] = i;
  return json{{"added_tokens", json::array()},
              {"normalizer", nullptr},
              {"pre_tokenizer", nullptr},
              {"post_processor", nullptr},
              {"decoder", nullptr},
              {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", json::array()}}}};
}

TEST(TokenizerHostile, NegativeIdsAreRefusedAtLoad) {
  TempDir dir;
  json j = small_tokenizer();
  j["model"]["vocab"]["x"] = -5;  // today: id_to_token_[(size_t)-5], a SIGSEGV
  expect_names(hostile_error(dir, j), {"tokenizer.json", "model.vocab 'x'", "-5"});
  j = small_tokenizer();
  j["added_tokens"][0]["id"] = -7;  // <s>: would reach the embedding as token -7
  expect_names(hostile_error(dir, j), {"tokenizer.json", "added_tokens '<s>'", "-7"});
}

TEST(TokenizerHostile, IdsOutsideTheInt32RangeOrNotIntegersAreRefused) {
  TempDir dir;
  for (const json& id : {json(2147483647), json(int64_t{1} << 32), json(1.5), json("3")}) {
    json j = small_tokenizer();
    j["model"]["vocab"]["x"] = id;
    expect_names(hostile_error(dir, j), {"tokenizer.json", "model.vocab 'x'", id.dump()});
  }
}

TEST(TokenizerHostile, HolesInTheIdSpaceAreBounded) {
  // 11 ids defined (a..j and one added token): every id must be below
  // 2 * 11 + 1024 = 1046.
  TempDir dir;
  json j = ten_letters();
  j["added_tokens"] = {{{"id", 1045}, {"content", "<big>"}, {"special", true}}};
  write(dir / "tokenizer.json", j.dump());
  const auto tok = load_tokenizer(dir / "tokenizer.json");
  EXPECT_EQ(tok->vocab_size(), 1046);
  EXPECT_EQ(tok->encode("a<big>j"), (Ids{0, 1045, 9}));
  j["added_tokens"][0]["id"] = 1046;
  expect_names(hostile_error(dir, j), {"tokenizer.json", "added_tokens '<big>'", "1046", "below 1046"});
  // A model id far beyond its vocabulary: refused before anything is sized by it.
  for (const int64_t id : {int64_t{100000000}, int64_t{400000000}}) {
    j = ten_letters();
    j["model"]["vocab"]["j"] = id;
    expect_names(hostile_error(dir, j), {"tokenizer.json", "model.vocab 'j'", std::to_string(id), "below 1044"});
  }
}

TEST(TokenizerHostile, PostProcessorIdsMustBeTokens) {
  TempDir dir;
  json j = small_tokenizer();
  j["post_processor"]["special_tokens"]["<s>"]["ids"] = {-7};
  expect_names(hostile_error(dir, j), {"tokenizer.json", "post_processor special_tokens '<s>'", "-7"});
  j["post_processor"]["special_tokens"]["<s>"]["ids"] = {19};  // a hole: ids 16..19 are no token
  expect_names(hostile_error(dir, j), {"tokenizer.json", "post_processor special_tokens '<s>'", "19", "no token"});
  j["post_processor"] = {{"type", "RobertaProcessing"}, {"cls", {"<s>", -7}}, {"sep", {"</s>", 23}}};
  expect_names(hostile_error(dir, j), {"tokenizer.json", "post_processor cls", "-7"});
}

TEST(TokenizerHostile, AVocabularyWithoutAUsableTokenIsRefused) {
  TempDir dir;
  json j = ten_letters();
  j["model"]["vocab"] = json::object();  // today: every character silently dropped
  expect_names(hostile_error(dir, j), {"tokenizer.json", "model.vocab", "no token"});
  j["model"]["vocab"] = {{"", 0}};
  expect_names(hostile_error(dir, j), {"tokenizer.json", "model.vocab", "no token"});
}

// ten_letters() whose normalizer replaces "a" by `content`.
json replacing_a(const std::string& content) {
  json j = ten_letters();
  j["normalizer"] = {{"type", "Replace"}, {"pattern", {{"String", "a"}}}, {"content", content}};
  return j;
}

TEST(TokenizerHostile, NormalizationGrowsADocumentOnlyToSixteenTimesItsSizePlus4096) {
  TempDir dir;
  const std::string hundred_a(100, 'a');  // may grow to 16 * 100 + 4096 = 5696 bytes
  write(dir / "tokenizer.json", replacing_a(std::string(56, 'b')).dump());
  EXPECT_EQ(load_tokenizer(dir / "tokenizer.json")->encode(hundred_a), Ids(5600, 1));  // 5600 b's
  write(dir / "tokenizer.json", replacing_a(std::string(57, 'b')).dump());
  try {
    load_tokenizer(dir / "tokenizer.json")->encode(hundred_a);  // 5700 bytes
    FAIL() << "a document of 100 bytes grew to 5700";
  } catch (const ConfigError& e) {
    expect_names(e.what(), {"tokenizer.json", "normalizer Replace of \"a\"", "5700 bytes long", "5696 bytes"});
  }
  // The issue's file: "a" to 200,000 characters.
  write(dir / "tokenizer.json", replacing_a(std::string(200000, 'b')).dump());
  EXPECT_THROW(load_tokenizer(dir / "tokenizer.json")->encode(std::string(1000, 'a')), ConfigError);
  // The same through a regex.
  json j = replacing_a(std::string(200000, 'b'));
  j["normalizer"]["pattern"] = {{"Regex", "a"}};
  write(dir / "tokenizer.json", j.dump());
  EXPECT_THROW(load_tokenizer(dir / "tokenizer.json")->encode(std::string(1000, 'a')), ConfigError);
}

TEST(TokenizerHostile, TheExpansionBoundIsPerDocumentNotPerStretch) {
  // A 3000-byte Prepend on each stretch between added tokens: "b" alone
  // (1 byte, bound 4112) grows to 3001 bytes; "b<s>b" (bound 16 * 5 + 4096 =
  // 4176) would grow to 6002: its second stretch finds 4176 - 3001 = 1175
  // bytes left.
  TempDir dir;
  json j = ten_letters();
  j["normalizer"] = {{"type", "Prepend"}, {"prepend", std::string(3000, 'c')}};
  j["added_tokens"] = {{{"id", 10}, {"content", "<s>"}, {"special", true}, {"normalized", false}}};
  write(dir / "tokenizer.json", j.dump());
  const auto tok = load_tokenizer(dir / "tokenizer.json");
  EXPECT_EQ(tok->encode("b").size(), 3001u);
  try {
    tok->encode("b<s>b");
    FAIL() << "a document of 5 bytes grew to 6002";
  } catch (const ConfigError& e) {
    expect_names(e.what(), {"tokenizer.json", "normalizer Prepend", "3001 bytes long", "1175 bytes"});
  }
}

TEST(TokenizerHostile, MetaspaceReplacementIsOneCharacterAndDecoderReplaceIsBounded) {
  TempDir dir;
  for (const std::string& replacement : {std::string(), std::string("__"), std::string(100000, '_')}) {
    json j = small_tokenizer();
    j["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", replacement}, {"prepend_scheme", "always"}};
    expect_names(hostile_error(dir, j), {"tokenizer.json", "Metaspace replacement", "not one character"});
    j = small_tokenizer();
    j["decoder"] = {{"type", "Metaspace"}, {"replacement", replacement}};
    expect_names(hostile_error(dir, j), {"tokenizer.json", "Metaspace decoder replacement", "not one character"});
  }
  json j = ten_letters();
  j["decoder"] = {{"type", "Replace"}, {"pattern", {{"String", "a"}}}, {"content", std::string(5000, 'b')}};
  write(dir / "tokenizer.json", j.dump());
  const auto tok = load_tokenizer(dir / "tokenizer.json");
  try {
    tok->decode({0});  // 1 byte may grow to 4112
    FAIL() << "decoded 1 byte to 5000";
  } catch (const ConfigError& e) {
    expect_names(e.what(), {"tokenizer.json", "decoder Replace", "4112"});
  }
  j["decoder"]["content"] = std::string(4000, 'b');
  write(dir / "tokenizer.json", j.dump());
  EXPECT_EQ(load_tokenizer(dir / "tokenizer.json")->decode({0, 1}), std::string(4000, 'b') + "b");
}

// A test that would hang or read forever on a regression is killed instead
// (SIGALRM), so it fails rather than holding ctest for its whole timeout.
struct Deadline {
  explicit Deadline(unsigned seconds) { ::alarm(seconds); }
  ~Deadline() { ::alarm(0); }
};

TEST(TokenizerHostile, TokenizerConfigThatIsAFifoOrADeviceIsRefusedAtOnce) {
  const Deadline deadline(30);
  TempDir dir;
  write(dir / "tokenizer.json", small_tokenizer().dump());
  const std::string config = dir / "tokenizer_config.json";
  ASSERT_EQ(::mkfifo(config.c_str(), 0600), 0);
  expect_names(load_error(dir / "tokenizer.json"), {"tokenizer_config.json", "FIFO (named pipe), not a regular file"});
  ::unlink(config.c_str());
  ASSERT_EQ(::symlink("/dev/zero", config.c_str()), 0);
  expect_names(load_error(dir / "tokenizer.json"), {"tokenizer_config.json", "character device"});
  ::unlink(config.c_str());
  ASSERT_EQ(::symlink((dir / "nowhere.json").c_str(), config.c_str()), 0);
  expect_names(load_error(dir / "tokenizer.json"), {"tokenizer_config.json"});
  ::unlink(config.c_str());
  EXPECT_EQ(load_tokenizer(dir / "tokenizer.json")->kind(), "tokenizer.json");  // absent is fine
}

TEST(TokenizerHostile, AutoWithADanglingOrFifoTokenizerJsonIsAnError) {
  const Deadline deadline(30);
  TempDir dir;  // a model directory whose download did not finish
  const std::string tokenizer = dir / "tokenizer.json";
  ASSERT_EQ(::symlink((dir / "blobs/0123abcd").c_str(), tokenizer.c_str()), 0);
  for (const std::string& spec : {std::string("auto"), dir.path()}) {
    try {
      load_tokenizer(spec, dir.path());
      FAIL() << spec << ": loaded (today: the byte tokenizer, silently)";
    } catch (const ConfigError& e) {
      expect_names(e.what(), {"tokenizer.json", "dangling link", "blobs/0123abcd"});
    }
  }
  ::unlink(tokenizer.c_str());
  ASSERT_EQ(::mkfifo(tokenizer.c_str(), 0600), 0);
  try {
    load_tokenizer("auto", dir.path());
    FAIL() << "a FIFO tokenizer.json loaded";
  } catch (const ConfigError& e) {
    expect_names(e.what(), {"tokenizer.json", "FIFO (named pipe), not a regular file"});
  }
  expect_names(load_error(tokenizer), {"tokenizer.json", "FIFO (named pipe), not a regular file"});
}

// ---- SentencePiece --------------------------------------------------------------------------

TEST(TokenizerSentencePiece, TrainedModelEncodesDecodesAndMatchesControlPieces) {
  TempDir dir;
  std::string text;
  for (int i = 0; i < 200; ++i) {
    text += "the quick brown fox jumps over the lazy dog " + std::to_string(i) + "\n";
    text += "caf\xC3\xA9 na\xC3\xAFve r\xC3\xA9sum\xC3\xA9 \xE6\x9D\xB1\xE4\xBA\xAC\n";
  }
  write(dir / "train.txt", text);
  const std::string train = std::string(MAKE_SPM_MODEL_PATH) + " " + dir / "train.txt" + " " + dir / "tokenizer" + " 400";
  ASSERT_EQ(std::system(train.c_str()), 0) << train;
  const auto tok = load_tokenizer(dir.path());  // the directory's tokenizer.model
  EXPECT_EQ(tok->kind(), "sentencepiece");
  ASSERT_TRUE(tok->bos_id());
  ASSERT_TRUE(tok->eos_id());
  const std::string sample = "the lazy caf\xC3\xA9 \xF0\x9F\x99\x82 jumps";  // 🙂 only by byte fallback
  const Ids ids = tok->encode(sample);
  EXPECT_EQ(tok->decode(ids), sample);
  const Ids with_bos = tok->encode(sample, true);
  ASSERT_EQ(with_bos.size(), ids.size() + 1);
  EXPECT_EQ(with_bos[0], *tok->bos_id());
  // </s> written in the text is the EOS token, and decodes back to itself.
  const Ids eos_inside = tok->encode("the fox</s>the dog");
  EXPECT_NE(std::find(eos_inside.begin(), eos_inside.end(), *tok->eos_id()), eos_inside.end());
  EXPECT_EQ(tok->decode(eos_inside, true).find("</s>"), std::string::npos);
  EXPECT_NE(tok->decode(eos_inside).find("</s>"), std::string::npos);
  EXPECT_EQ(tok->token_to_id("</s>"), tok->eos_id());
  EXPECT_THROW(tok->decode({static_cast<int32_t>(tok->vocab_size())}), ConfigError);
}

}  // namespace
