// Instruction and chat datasets: JSON-lines records, chat templates, loss
// masking, packing, the row sampler's global order, validation split, the
// samples cache and the errors (docs/data.md).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "shardtrain/core/error.h"
#include "shardtrain/data/chat_template.h"
#include "shardtrain/data/jsonl.h"
#include "shardtrain/data/lm_data.h"
#include "shardtrain/data/packing.h"
#include "shardtrain/data/row_sampler.h"
#include "shardtrain/data/samples.h"
#include "shardtrain/comm/communicator.h"
#include "shardtrain/config/config.h"
#include "shardtrain/models/causal_lm.h"
#include "shardtrain/models/family.h"
#include "shardtrain/train/task.h"
#include "shardtrain/train/trainer.h"
#include "temp_dir.h"

namespace {

namespace fs = std::filesystem;
using namespace shardtrain::data;
using shardtrain::ConfigError;
using shardtrain::testing::TempDir;

// Bytes, plus the templates' special tokens matched as single ids 256.. (as
// a real tokenizer matches added tokens inside text). BOS and EOS optional.
class ToyTokenizer : public Tokenizer {
 public:
  static inline const std::vector<std::string> kSpecials = {
      "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
      "<|im_start|>",      "<|im_end|>",          "<s>",               "</s>"};
  ToyTokenizer(std::optional<int32_t> bos = std::nullopt, std::optional<int32_t> eos = std::nullopt)
      : bos_(bos), eos_(eos) {}
  std::vector<int32_t> encode(std::string_view text, bool) const override {
    std::vector<int32_t> ids;
    for (size_t i = 0; i < text.size();) {
      bool special = false;
      for (size_t s = 0; s < kSpecials.size(); ++s) {
        if (text.substr(i, kSpecials[s].size()) == kSpecials[s]) {
          ids.push_back(256 + static_cast<int32_t>(s));
          i += kSpecials[s].size();
          special = true;
          break;
        }
      }
      if (!special) ids.push_back(static_cast<unsigned char>(text[i++]));
    }
    return ids;
  }
  std::string decode(const std::vector<int32_t>& ids, bool) const override {
    std::string out;
    for (int32_t id : ids) out += id < 256 ? std::string(1, static_cast<char>(id)) : kSpecials.at(id - 256);
    return out;
  }
  int64_t vocab_size() const override { return 256 + static_cast<int64_t>(kSpecials.size()); }
  std::optional<int32_t> token_to_id(std::string_view t) const override {
    for (size_t s = 0; s < kSpecials.size(); ++s) {
      if (kSpecials[s] == t) return 256 + static_cast<int32_t>(s);
    }
    return std::nullopt;
  }
  std::optional<int32_t> bos_id() const override { return bos_; }
  std::optional<int32_t> eos_id() const override { return eos_; }
  std::string kind() const override { return "toy"; }
  std::string fingerprint() const override {
    return "toy" + std::to_string(bos_.value_or(-1)) + "/" + std::to_string(eos_.value_or(-1));
  }

 private:
  std::optional<int32_t> bos_, eos_;
};

int32_t special(const char* text) { return *ToyTokenizer().token_to_id(text); }

std::string joined(const std::vector<Piece>& pieces, bool trained_only = false) {
  std::string s;
  for (const Piece& p : pieces) {
    if (!trained_only || p.trained) s += p.text;
  }
  return s;
}

const std::vector<Turn> kChat = {{Role::System, "Be brief."},
                                 {Role::User, " Hi? "},
                                 {Role::Assistant, "Hello."},
                                 {Role::User, "More"},
                                 {Role::Assistant, "Sure."}};
const std::vector<Turn> kNoSystem(kChat.begin() + 1, kChat.end());

// Expects a ConfigError whose message holds `part`.
template <class F>
void expect_config_error(F&& f, const std::string& part) {
  try {
    f();
    ADD_FAILURE() << "expected a ConfigError holding '" << part << "'";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

void write(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

// ---- chat templates, expected strings written by hand from each template --------------

TEST(ChatTemplate, Llama3) {
  const auto p = render_chat(ChatTemplateKind::Llama3, kChat, "t");
  EXPECT_EQ(joined(p),
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nHi?<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nMore<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\nSure.<|eot_id|>");
  EXPECT_EQ(joined(p, true), "Hello.<|eot_id|>Sure.<|eot_id|>");
}

// Generation prompts: the conversation so far, then the opening of the
// assistant's reply (add_generation_prompt), and the token that ends it.
TEST(ChatTemplate, GenerationPromptOpensTheReply) {
  const std::vector<Turn> ask(kChat.begin(), kChat.begin() + 4);  // ends with the user's "More"
  EXPECT_EQ(render_generation_prompt(ChatTemplateKind::Llama3, ask),
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nHi?<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nMore<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
  EXPECT_EQ(render_generation_prompt(ChatTemplateKind::Chatml, {{Role::User, "Hi"}}),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(render_generation_prompt(ChatTemplateKind::Llama2, {{Role::User, "Hi"}}), "<s>[INST] Hi [/INST]");
  EXPECT_EQ(end_of_turn(ChatTemplateKind::Llama3), "<|eot_id|>");
  EXPECT_EQ(end_of_turn(ChatTemplateKind::Qwen3), "<|im_end|>");
  EXPECT_EQ(end_of_turn(ChatTemplateKind::Mistral), "</s>");
  expect_config_error([] { render_generation_prompt(ChatTemplateKind::Llama3, kChat); }, "ends with the user");
}

TEST(ChatTemplate, ChatmlAndQwen3) {
  const std::string chatml =
      "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n Hi? <|im_end|>\n"
      "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nMore<|im_end|>\n"
      "<|im_start|>assistant\n";
  EXPECT_EQ(joined(render_chat(ChatTemplateKind::Chatml, kChat, "t")),
            chatml + "Sure.<|im_end|>\n");
  // Qwen3: only the last reply after the last user turn gets the empty
  // thinking block (the template's loop.last branch).
  const auto q = render_chat(ChatTemplateKind::Qwen3, kChat, "t");
  EXPECT_EQ(joined(q), chatml + "<think>\n\n</think>\n\nSure.<|im_end|>\n");
  EXPECT_EQ(joined(q, true), "Hello.<|im_end|><think>\n\n</think>\n\nSure.<|im_end|>");
}

TEST(ChatTemplate, Llama2) {
  const auto p = render_chat(ChatTemplateKind::Llama2, kChat, "t");
  EXPECT_EQ(joined(p),
            "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\n Hi? [/INST] Hello. </s>"
            "<s>[INST] More [/INST] Sure. </s>");
  EXPECT_EQ(joined(p, true), " Hello. </s> Sure. </s>");
  EXPECT_EQ(joined(render_chat(ChatTemplateKind::Llama2, kNoSystem, "t")),
            "<s>[INST] Hi? [/INST] Hello. </s><s>[INST] More [/INST] Sure. </s>");
}

TEST(ChatTemplate, Mistral) {
  const auto p = render_chat(ChatTemplateKind::Mistral, kNoSystem, "t");
  EXPECT_EQ(joined(p), "<s>[INST]  Hi?  [/INST]Hello.</s>[INST] More [/INST]Sure.</s>");
  EXPECT_EQ(joined(p, true), "Hello.</s>Sure.</s>");
  expect_config_error([] { render_chat(ChatTemplateKind::Mistral, kChat, "f.jsonl:3"); },
                      "f.jsonl:3: chat template mistral knows only the roles user and assistant");
  expect_config_error(
      [] {
        render_chat(ChatTemplateKind::Llama2, {{Role::User, "a"}, {Role::User, "b"}}, "f.jsonl:4");
      },
      "f.jsonl:4: chat template llama2 needs the roles to alternate");
}

TEST(ChatTemplate, RecognisedByMarkersOrRefusedNamingTheBuiltIns) {
  EXPECT_EQ(recognise_chat_template("{{ '<|start_header_id|>' + r }}<|eot_id|>", "x"),
            ChatTemplateKind::Llama3);
  EXPECT_EQ(recognise_chat_template("'<|im_start|>' ... <think>", "x"), ChatTemplateKind::Qwen3);
  EXPECT_EQ(recognise_chat_template("'<|im_start|>' + role", "x"), ChatTemplateKind::Chatml);
  EXPECT_EQ(recognise_chat_template("<<SYS>> [INST]", "x"), ChatTemplateKind::Llama2);
  EXPECT_EQ(recognise_chat_template("'[INST] ' + content", "x"), ChatTemplateKind::Mistral);
  expect_config_error([] { recognise_chat_template("<start_of_turn>", "dir/tokenizer_config.json"); },
                      "llama3, chatml, qwen3, mistral, llama2");
  TempDir dir;
  write(dir / "tokenizer_config.json", R"({"chat_template": "{{'<|im_start|>'}}"})");
  EXPECT_EQ(resolve_chat_template(ChatTemplateKind::Auto, dir.path()), ChatTemplateKind::Chatml);
  EXPECT_EQ(resolve_chat_template(ChatTemplateKind::Llama2, ""), ChatTemplateKind::Llama2);
  expect_config_error([] { resolve_chat_template(ChatTemplateKind::Auto, ""); },
                      "data.chat_template");
}

// ---- records and masking --------------------------------------------------------------

// The (input, target) pairs of one sample, as the rows hold them.
Rows one_row(const Sample& s, int64_t block) {
  return build_rows({s}, {0}, block, false, Overlong::Truncate, 0);
}

TEST(Masking, TextTrainsEveryTargetIncludingEos) {
  ToyTokenizer tok(300, 301);
  const Sample s = tokenize_record(parse_record(R"({"text": "ab"})", "f:1"), tok, {});
  EXPECT_EQ(s.ids, (std::vector<int32_t>{300, 'a', 'b', 301}));
  const Rows r = one_row(s, 4);
  EXPECT_EQ(r.input, (std::vector<int64_t>{300, 'a', 'b', 0}));
  EXPECT_EQ(r.target, (std::vector<int64_t>{'a', 'b', 301, -100}));
  EXPECT_EQ(r.segment, (std::vector<int64_t>{0, 0, 0, kPadSegment}));
}

TEST(Masking, PromptCompletionMasksThePrompt) {
  ToyTokenizer tok(300, 301);
  const Record rec = parse_record(R"({"prompt": "ab", "completion": "cd"})", "f:1");
  const Rows r = one_row(tokenize_record(rec, tok, {}), 5);
  EXPECT_EQ(r.input, (std::vector<int64_t>{300, 'a', 'b', 'c', 'd'}));
  EXPECT_EQ(r.target, (std::vector<int64_t>{-100, -100, 'c', 'd', 301}));
  SampleOptions all;
  all.train_on_inputs = true;
  EXPECT_EQ(one_row(tokenize_record(rec, tok, all), 5).target,
            (std::vector<int64_t>{'a', 'b', 'c', 'd', 301}));
}

TEST(Masking, AlpacaMasksTheRenderedPrompt) {
  ToyTokenizer tok;  // no BOS, no EOS: nothing added
  const Record rec = parse_record(R"({"instruction": "Add", "input": "1+1", "output": "2"})", "f:1");
  EXPECT_EQ(rec.prompt, alpaca_prompt("Add", "1+1"));
  EXPECT_NE(rec.prompt.find("### Input:\n1+1\n\n### Response:\n"), std::string::npos);
  const Sample s = tokenize_record(rec, tok, {});
  const Rows r = one_row(s, static_cast<int64_t>(s.ids.size()) - 1);
  std::vector<int64_t> want(r.target.size(), -100);
  want.back() = '2';
  EXPECT_EQ(r.target, want);
  EXPECT_EQ(parse_record(R"({"instruction": "Add", "output": "2"})", "f:1").prompt,
            alpaca_prompt("Add", ""));
}

TEST(Masking, ChatTrainsAssistantRepliesAndTheirEndOfTurn) {
  ToyTokenizer tok;
  SampleOptions o;
  o.chat_template = ChatTemplateKind::Llama3;
  const Record rec = parse_record(
      R"({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
                       {"role": "assistant", "content": "AB"}]})",
      "f:1");
  const Sample s = tokenize_record(rec, tok, o);
  // Special tokens are single ids.
  EXPECT_EQ(s.ids.front(), special("<|begin_of_text|>"));
  const Rows r = one_row(s, static_cast<int64_t>(s.ids.size()) - 1);
  std::vector<int64_t> trained;
  for (int64_t t : r.target) {
    if (t != -100) trained.push_back(t);
  }
  EXPECT_EQ(trained, (std::vector<int64_t>{'A', 'B', special("<|eot_id|>")}));
  o.train_on_inputs = true;
  const Rows all = one_row(tokenize_record(rec, tok, o), r.block_size);
  EXPECT_EQ(std::count(all.target.begin(), all.target.end(), -100), 0);
}

TEST(Records, ErrorsNameFileAndLine) {
  expect_config_error([] { parse_record("{\"text\": ", "d.jsonl:7"); }, "d.jsonl:7: not valid JSON");
  expect_config_error([] { parse_record(R"({"prompt": "a"})", "d.jsonl:2"); },
                      "d.jsonl:2: the record has no \"completion\" field");
  expect_config_error([] { parse_record(R"({"instruction": "a"})", "d.jsonl:2"); },
                      "no \"output\" field");
  expect_config_error([] { parse_record(R"({"other": 1})", "d.jsonl:5"); }, "d.jsonl:5: the record has none");
  expect_config_error([] { parse_record(R"({"text": 3})", "d.jsonl:1"); }, "must be a string");
  expect_config_error(
      [] { parse_record(R"({"messages": [{"role": "tool", "content": "x"}]})", "d.jsonl:9"); },
      "d.jsonl:9: messages[0]: role 'tool'");
  expect_config_error([] { parse_record(R"({"messages": []})", "d.jsonl:1"); }, "non-empty list");
  TempDir dir;
  write(dir / "empty.jsonl", "\n  \n");
  expect_config_error([&] { read_jsonl(dir / "empty.jsonl"); }, "holds no records");
  write(dir / "bad.jsonl", "{\"text\": \"a\"}\n\n{\"text\": \"b\"\n");
  expect_config_error([&] { read_jsonl(dir / "bad.jsonl"); }, "bad.jsonl:3: not valid JSON");
}

// ---- packing ----------------------------------------------------------------------------

Sample plain(int n, int32_t first) {  // n ids, all trained
  Sample s;
  for (int i = 0; i < n; ++i) s.ids.push_back(first + i);
  s.trained.assign(static_cast<size_t>(n), 1);
  return s;
}

TEST(Packing, GreedyNextFitWithSegmentsAndPositions) {
  // Pairs: 3, 2, 4, 1 in a block of 5 -> rows [3+2], [4+1].
  const std::vector<Sample> s = {plain(4, 10), plain(3, 20), plain(5, 30), plain(2, 40)};
  const Rows r = build_rows(s, {0, 1, 2, 3}, 5, true, Overlong::Truncate, 0);
  EXPECT_EQ(r.count, 2);
  EXPECT_EQ(r.input, (std::vector<int64_t>{10, 11, 12, 20, 21, 30, 31, 32, 33, 40}));
  EXPECT_EQ(r.target, (std::vector<int64_t>{11, 12, 13, 21, 22, 31, 32, 33, 34, 41}));
  EXPECT_EQ(r.position, (std::vector<int64_t>{0, 1, 2, 0, 1, 0, 1, 2, 3, 0}));
  EXPECT_EQ(r.segment, (std::vector<int64_t>{0, 0, 0, 1, 1, 0, 0, 0, 0, 1}));
  EXPECT_DOUBLE_EQ(r.efficiency(), 1.0);
  // Order matters: 3, 4 do not share a row.
  const Rows o = build_rows(s, {0, 2, 1, 3}, 5, true, Overlong::Truncate, 0);
  EXPECT_EQ(o.count, 3);
  EXPECT_EQ(o.segment, (std::vector<int64_t>{0, 0, 0, -1, -1, 0, 0, 0, 0, -1, 0, 0, 1, -1, -1}));
  EXPECT_DOUBLE_EQ(o.efficiency(), 10.0 / 15.0);
}

TEST(Packing, UnpackedRowsArePaddedAndMasked) {
  const Rows r = build_rows({plain(3, 10)}, {0}, 4, false, Overlong::Truncate, 99);
  EXPECT_EQ(r.input, (std::vector<int64_t>{10, 11, 99, 99}));
  EXPECT_EQ(r.target, (std::vector<int64_t>{11, 12, -100, -100}));
  EXPECT_EQ(r.segment, (std::vector<int64_t>{0, 0, -1, -1}));
}

TEST(Packing, OverlongTruncatedOrDroppedAndCounted) {
  const std::vector<Sample> s = {plain(9, 0), plain(3, 50), plain(1, 70), plain(5, 80)};
  const Rows t = build_rows(s, {0, 1, 2, 3}, 4, false, Overlong::Truncate, 0);
  EXPECT_EQ(t.truncated, 1);
  EXPECT_EQ(t.dropped, 1);  // the one-id sample has no pair
  EXPECT_EQ(t.count, 3);
  EXPECT_EQ(std::vector<int64_t>(t.target.begin(), t.target.begin() + 4),
            (std::vector<int64_t>{1, 2, 3, 4}));
  const Rows d = build_rows(s, {0, 1, 2, 3}, 4, true, Overlong::Drop, 0);
  EXPECT_EQ(d.truncated, 0);
  EXPECT_EQ(d.dropped, 2);
  EXPECT_EQ(d.count, 2);  // [2 pairs], [4 pairs]: 2 + 4 > 4
  EXPECT_EQ(d.samples, 2);
}

TEST(Packing, ZeroAndOneSample) {
  const Rows none = build_rows({}, {}, 4, true, Overlong::Truncate, 0);
  EXPECT_EQ(none.count, 0);
  EXPECT_DOUBLE_EQ(none.efficiency(), 0.0);
  const Rows one = build_rows({plain(2, 5)}, {0}, 4, true, Overlong::Truncate, 0);
  EXPECT_EQ(one.count, 1);
  EXPECT_DOUBLE_EQ(one.efficiency(), 0.25);
}

// ---- the row sampler's global order --------------------------------------------------

TEST(RowSampler, GlobalBatchIndependentOfWorldAndSplit) {
  std::vector<Sample> s;
  std::vector<int64_t> order;
  for (int i = 0; i < 13; ++i) {  // 13 rows, G = 6: not divisible by 4 or 5
    s.push_back(plain(3, 100 * i));
    order.push_back(i);
  }
  const Rows rows = build_rows(s, order, 4, false, Overlong::Truncate, 0);
  const RowSampler sampler(rows, 6, 7, true, "test");
  EXPECT_EQ(sampler.steps_per_epoch(), 2);
  // (world, micro): the rows of step s in order of (micro-step, rank, row).
  const auto step_rows = [&](int64_t step, int world, int64_t micro) {
    std::vector<int64_t> first;
    for (int64_t j = 0; j < 6 / (world * micro); ++j) {
      for (int k = 0; k < world; ++k) {
        const Batch b = sampler.micro_batch(step, j, micro, k, world);
        for (int64_t r = 0; r < micro; ++r) first.push_back(b.input[r][0].item<int64_t>());
      }
    }
    return first;
  };
  for (int64_t step : {0, 1, 2, 5}) {
    const auto ref = step_rows(step, 1, 6);
    EXPECT_EQ(step_rows(step, 1, 1), ref);
    EXPECT_EQ(step_rows(step, 2, 3), ref);
    EXPECT_EQ(step_rows(step, 3, 1), ref);
    EXPECT_EQ(step_rows(step, 6, 1), ref);
    EXPECT_EQ(std::set<int64_t>(ref.begin(), ref.end()).size(), 6u);
  }
  EXPECT_NE(step_rows(0, 1, 6), step_rows(2, 1, 6));  // a new epoch, a new order
  expect_config_error([&] { RowSampler(rows, 14, 7, true, "data.train 'x'"); },
                      "data.train 'x' gives 13 rows");
}

// ---- make_lm_data end to end -------------------------------------------------------------

shardtrain::config::DataConfig jsonl_config(const std::string& path, double val) {
  shardtrain::config::DataConfig c;
  c.train = path;
  c.val_fraction = val;
  c.chat_template = ChatTemplateKind::Chatml;
  return c;
}

std::string records(int n) {
  std::string text;
  for (int i = 0; i < n; ++i) {
    text += "{\"prompt\": \"q" + std::to_string(i) + "\", \"completion\": \"" +
            std::string(static_cast<size_t>(1 + i % 5), 'a') + "\"}\n";
  }
  return text;
}

TEST(LmData, JsonlHoldsOutWholeRecordsAndCachesTheSamples) {
  TempDir dir;
  const std::string path = dir / "d.jsonl";
  write(path, records(20));
  ToyTokenizer tok(300, 301);
  const auto c = jsonl_config(path, 0.2);
  const LmData d = make_lm_data(c, tok, 12, 4, 2, 3);
  EXPECT_EQ(d.stats.format, "jsonl");
  EXPECT_EQ(d.stats.train_samples, 16);
  EXPECT_EQ(d.stats.val_samples, 4);
  EXPECT_EQ(d.stats.max_token, 301);
  EXPECT_NE(d.stats.summary().find("16 training samples"), std::string::npos);
  ASSERT_TRUE(d.eval_batch);
  // The held-out records are the last four: prompts q16..q19.
  std::set<std::string> seen;
  for (int64_t i = 0; i < 2; ++i) {
    for (int k = 0; k < 2; ++k) {
      const Batch b = d.eval_batch(i, 1, k, 2);
      seen.insert(std::string(1, static_cast<char>(b.input[0][2].item<int64_t>())) +
                  static_cast<char>(b.input[0][3].item<int64_t>()));
    }
  }
  EXPECT_EQ(seen, (std::set<std::string>{"16", "17", "18", "19"}));
  // Training rows never hold a held-out prompt.
  for (int64_t step = 0; step < d.stats.train_rows / 4; ++step) {
    const Batch b = d.train_batch(step, 0, 4, 0, 1);
    for (int64_t r = 0; r < 4; ++r) {
      const int64_t tens = b.input[r][2].item<int64_t>(), ones = b.input[r][3].item<int64_t>();
      EXPECT_FALSE(tens == '1' && ones >= '6' && ones <= '9');
    }
  }
  // The cache is written beside the data and read back to the same batches.
  SampleOptions o;
  o.chat_template = ChatTemplateKind::Chatml;
  EXPECT_TRUE(fs::exists(samples_cache_path(path, tok, o)));
  const LmData again = make_lm_data(c, tok, 12, 4, 2, 3);
  EXPECT_TRUE(torch::equal(again.train_batch(1, 0, 4, 0, 1).target, d.train_batch(1, 0, 4, 0, 1).target));
  // A different tokenizer does not read it.
  EXPECT_NE(samples_cache_path(path, ToyTokenizer(), o), samples_cache_path(path, tok, o));
}

// Records with no token to train on (here chats without an assistant turn,
// whose every token is masked) are left out at load and counted; only a
// dataset of nothing else is refused (issue 47, item 3). 17 of 20 records
// are such chats, so 3 train; with a held-out fifth, 1 of them is held out.
TEST(LmData, RecordsWithNothingToTrainOnAreLeftOutAndCounted) {
  TempDir dir;
  ToyTokenizer tok(300, 301);
  const std::string masked = R"({"messages": [{"role": "user", "content": "x"}]})" "\n";
  std::string text;
  for (int i = 0; i < 20; ++i) text += i % 7 == 3 ? records(1) : masked;
  write(dir / "mostly.jsonl", text);
  const LmData d = make_lm_data(jsonl_config(dir / "mostly.jsonl", 0), tok, 12, 1, 1, 0);
  EXPECT_EQ(d.stats.train_samples, 3);
  EXPECT_EQ(d.stats.untrained, 17);
  EXPECT_NE(d.stats.summary().find("17 records with no token to train on left out"), std::string::npos)
      << d.stats.summary();
  // Every training row has a target to divide by.
  for (int64_t step = 0; step < d.stats.train_rows; ++step) {
    EXPECT_GT((d.train_batch(step, 0, 1, 0, 1).target != -100).sum().item<int64_t>(), 0) << step;
  }
  // The held-out split is of trainable records too: no 0/0 evaluation.
  const LmData held = make_lm_data(jsonl_config(dir / "mostly.jsonl", 0.34), tok, 12, 1, 1, 0);
  EXPECT_EQ(held.stats.train_samples + held.stats.val_samples, 3);
  ASSERT_TRUE(held.eval_batch);
  EXPECT_GT((held.eval_batch(0, 1, 0, 1).target != -100).sum().item<int64_t>(), 0);
  std::string none;
  for (int i = 0; i < 4; ++i) none += masked;
  write(dir / "none.jsonl", none);
  expect_config_error([&] { make_lm_data(jsonl_config(dir / "none.jsonl", 0), tok, 12, 1, 1, 0); },
                      "none of the 4 records of");
}

TEST(LmData, Errors) {
  TempDir dir;
  ToyTokenizer tok;
  write(dir / "bad.jsonl", records(3) + "{\"prompt\": \"x\"}\n");
  expect_config_error([&] { make_lm_data(jsonl_config(dir / "bad.jsonl", 0), tok, 8, 1, 1, 0); },
                      "bad.jsonl:4: the record has no \"completion\" field");
  EXPECT_FALSE(fs::exists(samples_cache_path(dir / "bad.jsonl", tok, {})));
  // chat_template auto without a model directory: only a chat record fails.
  write(dir / "chat.jsonl", records(3) + R"({"messages": [{"role": "user", "content": "x"}]})" "\n");
  auto chat = jsonl_config(dir / "chat.jsonl", 0);
  chat.chat_template = ChatTemplateKind::Auto;
  expect_config_error([&] { make_lm_data(chat, tok, 8, 1, 1, 0); },
                      "chat.jsonl:4: a chat record needs a chat template");
  write(dir / "empty.jsonl", "");
  expect_config_error([&] { make_lm_data(jsonl_config(dir / "empty.jsonl", 0), tok, 8, 1, 1, 0); },
                      "holds no records");
  write(dir / "few.jsonl", records(3));
  expect_config_error([&] { make_lm_data(jsonl_config(dir / "few.jsonl", 0), tok, 8, 4, 1, 0); },
                      "fewer than one global batch");
  expect_config_error([&] { make_lm_data(jsonl_config(dir / "few.jsonl", 0.9), tok, 8, 1, 1, 0); },
                      "leaves none to train on");
  // A token file of an unknown version is refused by name.
  std::vector<int32_t> header(256, 0);
  header[0] = kTokenFileMagic;
  header[1] = 7;
  header[2] = 4;
  std::ofstream(dir / "wide.bin", std::ios::binary)
      .write(reinterpret_cast<const char*>(header.data()), 1024)
      .write("\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0", 16);
  auto tc = jsonl_config(dir / "wide.bin", 0);
  expect_config_error([&] { make_lm_data(tc, tok, 2, 1, 1, 0); }, "has version 7");
  tc.format = DataFormat::Tokens;
  tc.train = dir / "few.jsonl";
  expect_config_error([&] { make_lm_data(tc, tok, 2, 1, 1, 0); }, "is not a token file");
}

// Token data: the last val_fraction of the tokens is held out, and no
// training window may read one of them. Token p of the file is p, so a batch
// says which positions it read. 2000 tokens, val_fraction 0.11: positions
// 1780..1999 are held out (220 > one evaluation batch, 6 x 8 + 1). The
// training part, 1780 tokens, holds 222 windows of 8 + 1 (one every 8
// tokens), the last 1768..1776; the held-out part 27, the first at 1780.
TEST(LmData, TokenTrainingWindowsNeverReadTheHeldOutTokens) {
  TempDir dir;
  std::vector<uint16_t> tokens(2000);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint16_t>(i);
  const std::string path = dir / "positions.bin";
  write_token_file(path, tokens);
  shardtrain::config::DataConfig c;
  c.train = path;
  c.format = DataFormat::Tokens;
  c.val_fraction = 0.11;
  c.shuffle = true;
  ToyTokenizer tok;
  constexpr int64_t kHeldOutFrom = 1780, kBlock = 8, kGlobal = 6, kMicro = 2;
  for (const int world : {1, 3}) {
    SCOPED_TRACE("world " + std::to_string(world));
    const LmData d = make_lm_data(c, tok, kBlock, kGlobal, kMicro * world, 7);
    ASSERT_TRUE(d.eval_batch);
    EXPECT_EQ(d.stats.train_samples, 222);
    EXPECT_EQ(d.stats.val_samples, 27);
    const int64_t accumulate = kGlobal / (kMicro * world);
    int64_t train_min = 1 << 30, train_max = -1;
    // Three shuffled epochs of 37 steps, every micro-batch of every rank.
    for (int64_t step = 0; step < 3 * 37; ++step) {
      for (int64_t j = 0; j < accumulate; ++j) {
        for (int rank = 0; rank < world; ++rank) {
          const Batch b = d.train_batch(step, j, kMicro, rank, world);
          train_min = std::min({train_min, b.input.min().item<int64_t>(), b.target.min().item<int64_t>()});
          train_max = std::max({train_max, b.input.max().item<int64_t>(), b.target.max().item<int64_t>()});
        }
      }
    }
    EXPECT_LT(train_max, kHeldOutFrom) << "a training window read held-out tokens";
    EXPECT_EQ(train_max, 1776);  // and the training part is used to its end
    EXPECT_EQ(train_min, 0);
    int64_t val_min = 1 << 30, val_max = -1;
    for (int64_t i = 0; i < 27 / (kMicro * world); ++i) {
      for (int rank = 0; rank < world; ++rank) {
        const Batch b = d.eval_batch(i, kMicro, rank, world);
        val_min = std::min({val_min, b.input.min().item<int64_t>(), b.target.min().item<int64_t>()});
        val_max = std::max({val_max, b.input.max().item<int64_t>(), b.target.max().item<int64_t>()});
      }
    }
    EXPECT_EQ(val_min, kHeldOutFrom) << "validation read a training token";
    EXPECT_LT(val_max, 2000);
  }
}

// ---- masked-loss exactness -----------------------------------------------------------
// The trainer divides the summed loss of every micro-batch by the number of
// non-ignored targets of the whole global batch (Trainer::run_step). With
// answers of very different lengths, any split of the global batch into
// micro-batches must then give the mean over all trained targets.
TEST(MaskedLoss, AnySplitGivesTheGlobalMeanOverTrainedTargets) {
  TempDir dir;
  std::string text;
  for (int i = 0; i < 12; ++i) {
    text += "{\"prompt\": \"question " + std::to_string(i) + "\", \"completion\": \"" +
            std::string(static_cast<size_t>(i == 3 ? 20 : 1 + i % 3), 'x') + "\"}\n";
  }
  write(dir / "d.jsonl", text);
  ToyTokenizer tok(300, 301);
  const LmData d = make_lm_data(jsonl_config(dir / "d.jsonl", 0), tok, 40, 12, 1, 5);
  torch::manual_seed(0);
  const auto logits_table = torch::randn({310, 310});
  const auto loss_sum = [&](const Batch& b) {
    return torch::nn::functional::cross_entropy(
        logits_table.index_select(0, b.input.reshape(-1)), b.target.reshape(-1),
        torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum).ignore_index(-100));
  };
  const Batch whole = d.train_batch(0, 0, 12, 0, 1);
  const auto mask = whole.target.ne(-100);
  const double mean = torch::nn::functional::cross_entropy(
                          logits_table.index_select(0, whole.input.reshape(-1)).index({mask.reshape(-1)}),
                          whole.target.reshape(-1).index({mask.reshape(-1)}))
                          .item<double>();
  for (const auto& [world, micro] : std::vector<std::pair<int, int64_t>>{{1, 12}, {2, 3}, {3, 2}, {4, 1}}) {
    double sum = 0;
    int64_t count = 0;
    for (int64_t j = 0; j < 12 / (world * micro); ++j) {
      for (int k = 0; k < world; ++k) {
        const Batch b = d.train_batch(0, j, micro, k, world);
        sum += loss_sum(b).item<double>();
        count += b.target.ne(-100).sum().item<int64_t>();
      }
    }
    EXPECT_NEAR(sum / static_cast<double>(count), mean, 1e-5) << world << "x" << micro;
  }
}

// ---- packing equivalence --------------------------------------------------------------
// Each sample's summed loss in packed rows equals its loss run alone in an
// unpacked (padded) row, for every language-model family: attention never
// crosses a sample and positions restart. Samples are told apart by their
// tokens (every prompt is distinct).
std::map<std::vector<int64_t>, double> loss_per_sample(shardtrain::models::CausalLMImpl& model,
                                                       const LmData& d, int64_t rows) {
  std::map<std::vector<int64_t>, double> out;
  for (int64_t step = 0; step < rows; ++step) {
    const Batch b = d.train_batch(step, 0, 1, 0, 1);
    const at::Tensor loss = torch::nn::functional::cross_entropy(
        model.forward(b.input, b.position, b.segment).flatten(0, 1), b.target.flatten(),
        torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-100).reduction(torch::kNone));
    const at::Tensor seg = b.segment[0];
    for (int64_t s = 0; s <= seg.max().item<int64_t>(); ++s) {
      const at::Tensor in = seg.eq(s);
      const at::Tensor ids = b.input[0].masked_select(in).contiguous();
      std::vector<int64_t> key(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + ids.numel());
      EXPECT_TRUE(out.emplace(key, loss.masked_select(in).sum().item<double>()).second) << "a sample twice";
    }
  }
  return out;
}

TEST(Packing, EverySampleLosesWhatItLosesAlone) {
  TempDir dir;
  std::string text;
  for (int i = 0; i < 24; ++i) {
    text += "{\"prompt\": \"q" + std::to_string(i) + "\", \"completion\": \"" +
            std::string(static_cast<size_t>(1 + (i * 7) % 13), static_cast<char>('a' + i % 5)) + "\"}\n";
  }
  write(dir / "d.jsonl", text);
  const ToyTokenizer tok(std::nullopt, 300);
  auto c = jsonl_config(dir / "d.jsonl", 0);
  c.shuffle = false;
  const LmData alone = make_lm_data(c, tok, 24, 1, 1, 0);
  c.packing = true;
  const LmData packed = make_lm_data(c, tok, 24, 1, 1, 0);
  ASSERT_EQ(alone.stats.train_rows, 24);
  ASSERT_LE(packed.stats.train_rows, 12);  // two or more samples share each row
  for (const auto type : {shardtrain::train::ModelType::Gpt, shardtrain::train::ModelType::Llama}) {
    shardtrain::config::ModelConfig m;
    m.type = type;
    m.n_layer = 2;
    m.n_head = 2;
    m.n_embd = 32;
    m.block_size = 24;
    m.vocab_size = 320;
    torch::manual_seed(0);
    auto model = std::dynamic_pointer_cast<shardtrain::models::CausalLMImpl>(
        shardtrain::models::family_of(type).build(m));
    torch::NoGradGuard no_grad;
    const auto a = loss_per_sample(*model, alone, alone.stats.train_rows);
    const auto p = loss_per_sample(*model, packed, packed.stats.train_rows);
    ASSERT_EQ(a.size(), 24u);
    ASSERT_EQ(p.size(), a.size());
    for (const auto& [key, loss] : a) {
      ASSERT_TRUE(p.count(key));
      EXPECT_NEAR(p.at(key), loss, 1e-5 * std::max(1.0, std::abs(loss)))
          << shardtrain::enum_name(type) << ", a sample of " << key.size() << " tokens";
    }
  }
}

// ---- through make_task and the Trainer ------------------------------------------------
// A JSON-lines config trains the GPT (prompt masked, padded rows), and the
// accumulation split does not change the run: micro 12 x 1 and micro 4 x 3
// end with the same weights (the loss is normalised over the global batch).
shardtrain::config::Config tiny_gpt(const std::string& data, const std::string& dir, int64_t micro) {
  shardtrain::config::Config c;
  c.run.dir = dir + "/run" + std::to_string(micro);
  c.model.n_layer = 1;
  c.model.n_head = 2;
  c.model.n_embd = 16;
  c.model.block_size = 24;
  c.data.train = data;
  c.data.val_fraction = 0.2;  // 12 held-out rows: one evaluation batch at micro 12
  c.batch.global = 12;
  c.batch.micro = micro;
  c.batch.accumulate.reset();
  c.trainer.max_steps = 3;
  c.trainer.eval_every = 3;
  c.trainer.eval_batches = 1;
  c.trainer.progress = shardtrain::train::ProgressMode::None;
  c.trainer.sample_tokens = 0;
  c.distributed.threads_per_rank(1);
  return c;
}

TEST(LmData, JsonlTrainsThroughMakeTaskAndAccumulationDoesNotMatter) {
  TempDir dir;
  std::string text;
  for (int i = 0; i < 60; ++i) {
    text += "{\"prompt\": \"q" + std::to_string(i) + ": \", \"completion\": \"" +
            std::string(static_cast<size_t>(i % 7 == 0 ? 30 : 1 + i % 4), 'z') + "\"}\n";
  }
  write(dir / "d.jsonl", text);
  std::vector<std::map<std::string, at::Tensor>> finals;
  for (const int64_t micro : {12, 4}) {
    const auto c = tiny_gpt(dir / "d.jsonl", dir.path(), micro);
    shardtrain::train::Trainer t(c, shardtrain::train::make_task(c, 1),
                                 shardtrain::comm::Communicator::create(shardtrain::comm::CommOptions()));
    t.fit();
    std::map<std::string, at::Tensor> params;
    for (const auto& p : t.model()->named_parameters()) params[p.key()] = p.value().detach().clone();
    finals.push_back(std::move(params));
  }
  ASSERT_EQ(finals[0].size(), finals[1].size());
  for (const auto& [name, value] : finals[0]) {
    EXPECT_TRUE(torch::allclose(value, finals[1].at(name), 1e-4, 2e-5)) << name;
  }
  // Packed rows train too (the segments reach the attention mask).
  auto packed = tiny_gpt(dir / "d.jsonl", dir.path(), 4);
  packed.data.packing = true;
  packed.data.val_fraction = 0;
  packed.trainer.eval_every = 0;
  shardtrain::train::Trainer t(packed, shardtrain::train::make_task(packed, 1),
                               shardtrain::comm::Communicator::create(shardtrain::comm::CommOptions()));
  t.fit();
  for (const auto& p : t.model()->parameters()) EXPECT_TRUE(torch::isfinite(p).all().item<bool>());
}

}  // namespace
