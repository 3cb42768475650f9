// LoRA adapters (models/lora.h) and the quantized frozen base
// (models/quantize.h): step-0 equality, frozen tensors, the adapter's scale,
// bad input, and int8/nf4 against reference quantizers written here.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <cstdio>
#include <set>
#include <string>
#include <vector>

#include "shardtrain/checkpoint/checkpoint.h"
#include "shardtrain/checkpoint/safetensors.h"
#include "shardtrain/comm/communicator.h"
#include "shardtrain/config/config.h"
#include "shardtrain/core/error.h"
#include "shardtrain/models/gpt.h"
#include "shardtrain/models/lora.h"
#include "shardtrain/models/family.h"
#include "shardtrain/models/hf_dir.h"
#include "shardtrain/models/lora_peft.h"
#include "shardtrain/models/mlp.h"
#include "shardtrain/models/quantize.h"
#include "shardtrain/precision/precision.h"
#include "shardtrain/strategy/strategy.h"
#include "shardtrain/train/task.h"
#include "shardtrain/train/trainer.h"
#include "temp_dir.h"
#include "test_helpers.h"
#include "strategy/flat_param.h"
#include "train/lora.h"

namespace {

using shardtrain::ConfigError;
using shardtrain::models::apply_lora;
using shardtrain::models::GPT;
using shardtrain::models::GPTConfig;
using shardtrain::models::LoraBias;
using shardtrain::models::LoraOptions;
using shardtrain::models::LoraQuantize;
namespace m = shardtrain::models;

GPTConfig tiny_gpt(int64_t n_embd = 16) {
  GPTConfig c;
  c.n_layer = 2;
  c.n_head = 2;
  c.n_embd = n_embd;
  c.block_size = 8;
  c.vocab_size = 11;
  return c;
}

torch::Tensor tokens() { return torch::randint(0, 11, {3, 8}, torch::kLong); }

template <typename Fn>
std::string config_error(Fn&& fn) {
  try {
    fn();
  } catch (const ConfigError& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected a ConfigError, got: " << e.what();
    return {};
  }
  ADD_FAILURE() << "expected a ConfigError, nothing was thrown";
  return {};
}

// ---- step 0 and structure -----------------------------------------------------------

TEST(Lora, StepZeroEqualsTheBaseExactly) {
  for (const bool checkpointing : {false, true}) {
    torch::manual_seed(1);
    auto c = tiny_gpt();
    c.activation_checkpointing = checkpointing;
    GPT model(c);
    const auto idx = tokens();
    const auto before = model->forward(idx).detach();
    apply_lora(*model, LoraOptions().r(4).alpha(8).dropout(0.1));
    model->eval();
    EXPECT_TRUE(torch::equal(model->forward(idx), before));
    model->train();  // dropout on, but B is zero
    EXPECT_TRUE(torch::equal(model->forward(idx).detach(), before));
  }
}

// With lora.dropout > 0, evaluation is deterministic and is the merged
// model's: every adapted weight W replaced by W + (alpha / r) B A, computed
// here by hand on a second copy of the base (issue 47, third pass).
TEST(Lora, DropoutIsOffInEvaluationWhichIsTheMergedModel) {
  torch::manual_seed(2);
  GPT model(tiny_gpt());
  torch::manual_seed(2);
  GPT merged(tiny_gpt());
  apply_lora(*model, LoraOptions().r(4).alpha(8).dropout(0.5));
  {
    torch::NoGradGuard ng;
    auto mine = merged->named_parameters();
    int adapted = 0;
    for (const auto& p : model->named_parameters()) {
      const std::string suffix = ".lora_A.weight";
      const auto at = p.key().rfind(suffix);
      if (at == std::string::npos || at + suffix.size() != p.key().size()) continue;
      const std::string layer = p.key().substr(0, at);
      auto b = model->named_parameters()[layer + ".lora_B.weight"];
      b.normal_();
      mine[layer + ".weight"].add_(b.matmul(p.value()), /*alpha=*/8.0 / 4.0);
      ++adapted;
    }
    ASSERT_GT(adapted, 0);
  }
  const auto idx = tokens();
  model->eval();
  merged->eval();
  const auto first = model->forward(idx);
  EXPECT_TRUE(torch::equal(model->forward(idx), first));
  EXPECT_TRUE(torch::allclose(first, merged->forward(idx), 1e-4, 1e-5));
  // Training mode does drop (otherwise this test would prove nothing).
  model->train();
  EXPECT_FALSE(torch::allclose(model->forward(idx).detach(), first, 1e-4, 1e-5));
}

TEST(Lora, AdaptersAreNamedAfterTheirLayerAndTheRestIsFrozen) {
  torch::manual_seed(2);
  GPT model(tiny_gpt());
  const auto s = apply_lora(*model, LoraOptions().r(4));
  EXPECT_EQ(s.adapted.size(), 8u);  // 2 blocks x (c_attn, attn.c_proj, c_fc, mlp.c_proj)
  std::set<std::string> trainable;
  for (const auto& p : model->named_parameters()) {
    if (p.value().requires_grad()) trainable.insert(p.key());
  }
  EXPECT_EQ(trainable.size(), 16u);
  for (const auto& name : trainable) {
    EXPECT_TRUE(name.find(".lora_A.weight") != std::string::npos ||
                name.find(".lora_B.weight") != std::string::npos)
        << name;
  }
  const auto params = model->named_parameters();
  EXPECT_EQ(params["h.0.attn.c_attn.lora_A.weight"].sizes(), (std::vector<int64_t>{4, 16}));
  EXPECT_EQ(params["h.0.attn.c_attn.lora_B.weight"].sizes(), (std::vector<int64_t>{48, 4}));
  EXPECT_EQ(params["h.1.mlp.c_proj.lora_A.weight"].sizes(), (std::vector<int64_t>{4, 64}));
  // The base weight keeps its name, so base checkpoints still load by name.
  EXPECT_TRUE(params.contains("h.0.attn.c_attn.weight"));
  // PEFT init: A within 1/sqrt(in), not all zero; B zero.
  const auto a = params["h.0.attn.c_attn.lora_A.weight"];
  EXPECT_LE(a.abs().max().item<double>(), 1.0 / std::sqrt(16.0));
  EXPECT_GT(a.abs().max().item<double>(), 0.0);
  EXPECT_EQ(params["h.0.attn.c_attn.lora_B.weight"].abs().max().item<double>(), 0.0);
  EXPECT_EQ(s.trainable, 2 * (4 * 16 + 48 * 4 + 4 * 16 + 16 * 4 + 4 * 16 + 64 * 4 + 4 * 64 + 16 * 4));
}

TEST(Lora, FrozenTensorsGetNoGradient) {
  for (const auto q : {LoraQuantize::None, LoraQuantize::Int8, LoraQuantize::Nf4}) {
    torch::manual_seed(3);
    GPT model(tiny_gpt(64));
    apply_lora(*model, LoraOptions().r(2).quantize(q).train_bias(LoraBias::All));
    model->forward(tokens()).pow(2).sum().backward();
    for (const auto& p : model->named_parameters()) {
      const std::string& n = p.key();
      const bool bias = n.size() >= 4 && n.substr(n.size() - 4) == "bias";
      const bool adapter = n.find("lora_") != std::string::npos;
      if (adapter || bias) {
        EXPECT_TRUE(p.value().grad().defined()) << n;
      } else {
        EXPECT_FALSE(p.value().requires_grad()) << n;
        EXPECT_FALSE(p.value().grad().defined()) << n;
      }
    }
    // B is zero at step 0, so A's gradient is zero too; B's is not.
    const auto b = model->named_parameters()["h.0.attn.c_attn.lora_B.weight"];
    EXPECT_GT(b.grad().abs().sum().item<double>(), 0.0);
  }
}

TEST(Lora, OutputIsBasePlusAlphaOverRTimesBA) {
  torch::manual_seed(4);
  m::MLP mlp(std::vector<int64_t>{6, 5, 3});
  const auto x = torch::randn({7, 6});
  const auto w0 = mlp->layers[0]->as<torch::nn::LinearImpl>()->weight.detach().clone();
  const auto b0 = mlp->layers[0]->as<torch::nn::LinearImpl>()->bias.detach().clone();
  apply_lora(*mlp, LoraOptions().r(2).alpha(6).target_modules({"layers.0"}));
  auto* l0 = mlp->layers[0]->as<torch::nn::LinearImpl>();
  const auto params = mlp->named_parameters();
  const auto a = params["layers.0.lora_A.weight"];
  const auto b = params["layers.0.lora_B.weight"];
  {
    torch::NoGradGuard ng;
    b.normal_();
  }
  const auto expected = torch::addmm(b0, x, w0.t()) + 3.0 * x.matmul(a.t()).matmul(b.t());
  EXPECT_TRUE(torch::allclose(m::lora_forward(*l0, x), expected, 1e-5, 1e-6));
  // A layer without an adapter is its plain forward.
  auto* l1 = mlp->layers[1]->as<torch::nn::LinearImpl>();
  EXPECT_FALSE(m::has_lora(*l1));
  const auto h = torch::randn({2, 5});
  EXPECT_TRUE(torch::equal(m::lora_forward(*l1, h), l1->forward(h)));
}

// The user-module example of docs/lora.md and models/lora.h, compiled.
struct DocNet : torch::nn::Module {
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  DocNet() {
    fc1 = register_module("fc1", torch::nn::Linear(64, 256));
    fc2 = register_module("fc2", torch::nn::Linear(256, 10));
  }
  torch::Tensor forward(torch::Tensor x) {
    using shardtrain::models::lora_forward;
    return lora_forward(*fc2, torch::relu(lora_forward(*fc1, x)));
  }
};

TEST(Lora, UserModuleOfTheDocsIsAdaptedAndTrains) {
  torch::manual_seed(3);
  auto net = std::make_shared<DocNet>();
  const auto x = torch::randn({5, 64});
  const auto before = net->forward(x).detach();
  const auto s = apply_lora(*net, LoraOptions().r(8).alpha(16).target_modules({"fc1", "fc2"}));
  EXPECT_EQ(s.adapted, (std::vector<std::string>{"fc1", "fc2"}));
  EXPECT_TRUE(torch::equal(net->forward(x), before));
  std::vector<torch::Tensor> trainable;
  for (const auto& p : net->parameters()) {
    if (p.requires_grad()) trainable.push_back(p);
  }
  EXPECT_EQ(trainable.size(), 4u);
  torch::optim::SGD opt(trainable, 0.1);
  net->forward(x).pow(2).sum().backward();
  opt.step();
  EXPECT_FALSE(torch::equal(net->forward(x), before));
  EXPECT_FALSE(net->fc1->weight.grad().defined());
}

// ---- bad input ----------------------------------------------------------------------

TEST(Lora, TargetsThatMatchNothingAreAConfigError) {
  GPT model(tiny_gpt());
  const auto msg = config_error([&] { apply_lora(*model, LoraOptions().target_modules({"q_proj"})); });
  EXPECT_NE(msg.find("lora.target_modules [q_proj] matched no Linear layer"), std::string::npos) << msg;
  EXPECT_NE(msg.find("h.0.attn.c_attn"), std::string::npos) << msg;
  // Nothing was changed: everything still trains.
  for (const auto& p : model->parameters()) EXPECT_TRUE(p.requires_grad());
  // "attn" is a path component but not a Linear; "c_at" is no whole component.
  config_error([&] { apply_lora(*model, LoraOptions().target_modules({"c_at"})); });
}

TEST(Lora, RankLargerThanALayerIsAConfigError) {
  GPT model(tiny_gpt());
  const auto msg = config_error([&] { apply_lora(*model, LoraOptions().r(17)); });
  EXPECT_NE(msg.find("lora.r=17 exceeds the width of layer 'h.0.attn.c_attn' (48 x 16)"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("at most 16"), std::string::npos) << msg;
  // r equal to the smallest width is fine.
  apply_lora(*model, LoraOptions().r(16));
}

TEST(Lora, Nf4NeedsInputWidthsDivisibleByTheBlock) {
  GPT model(tiny_gpt(32));
  const auto msg = config_error([&] { apply_lora(*model, LoraOptions().quantize(LoraQuantize::Nf4)); });
  EXPECT_NE(msg.find("multiple of the block size 64"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'h.0.attn.c_attn' has 32"), std::string::npos) << msg;
  // int8 has no block constraint.
  apply_lora(*model, LoraOptions().quantize(LoraQuantize::Int8));
}

TEST(Lora, BadOptionsAndSecondApplicationAreConfigErrors) {
  GPT model(tiny_gpt());
  EXPECT_NE(config_error([&] { apply_lora(*model, LoraOptions().r(0)); }).find("lora.r=0"),
            std::string::npos);
  EXPECT_NE(config_error([&] { apply_lora(*model, LoraOptions().dropout(1.0)); }).find("lora.dropout"),
            std::string::npos);
  apply_lora(*model, LoraOptions());
  EXPECT_NE(config_error([&] { apply_lora(*model, LoraOptions()); }).find("already has a LoRA adapter"),
            std::string::npos);
}

TEST(Lora, ConfigSectionIsOffByDefaultAndStrict) {
  using shardtrain::config::Config;
  EXPECT_EQ(Config::parse("{}").lora.r(), 0);
  const auto c = Config::parse(
      "lora:\n  r: 4\n  alpha: 8\n  target_modules: [c_attn]\n  quantize: nf4\n  train_bias: all\n");
  EXPECT_EQ(c.lora.r(), 4);
  EXPECT_EQ(c.lora.alpha(), 8.0);
  EXPECT_EQ(c.lora.target_modules(), std::vector<std::string>{"c_attn"});
  EXPECT_EQ(c.lora.quantize(), LoraQuantize::Nf4);
  EXPECT_EQ(c.lora.train_bias(), LoraBias::All);
  EXPECT_EQ(Config::parse(c.to_yaml()).lora.quantize(), LoraQuantize::Nf4);
  EXPECT_NE(config_error([] { Config::parse("lora:\n  quantize: fp4\n"); }).find("lora.quantize"),
            std::string::npos);
  EXPECT_NE(config_error([] { Config::parse("lora:\n  r: -1\n"); }).find("lora.r"), std::string::npos);
  EXPECT_NE(config_error([] { Config::parse("lora:\n  target_modules: ['']\n"); }).find("lora.target_modules"),
            std::string::npos);
}

// ---- quantization against references written here ----------------------------------

// NF4 from its definition: 8 positive quantiles of N(0, 1) between 0.5 and
// 0.9677 (the offset of the QLoRA paper), 7 negative ones, normalised, plus 0.
std::vector<double> reference_nf4_code() {
  const double offset = 0.9677083;
  auto ppf = [](double p) { return std::sqrt(2.0) * torch::erfinv(torch::tensor(2 * p - 1, torch::kDouble)).item<double>(); };
  std::vector<double> pos, neg;
  for (int i = 0; i < 8; ++i) pos.push_back(ppf(offset + (0.5 - offset) * i / 8.0));   // 9 points, drop last
  for (int i = 0; i < 7; ++i) neg.push_back(-ppf(offset + (0.5 - offset) * i / 7.0));  // 8 points, drop last
  std::vector<double> v = pos;
  v.insert(v.end(), neg.begin(), neg.end());
  v.push_back(0.0);
  double mx = 0;
  for (double x : v) mx = std::max(mx, std::abs(x));
  for (double& x : v) x /= mx;
  std::sort(v.begin(), v.end());
  return v;
}

TEST(Quantize, Nf4CodeIsTheNormalFloatOfThePaper) {
  const auto ref = reference_nf4_code();
  const auto code = m::nf4_code();
  ASSERT_EQ(code.numel(), 16);
  for (int i = 0; i < 16; ++i) EXPECT_NEAR(code[i].item<double>(), ref[i], 2e-6) << i;
}

TEST(Quantize, Int8MatchesAReferenceLoop) {
  torch::manual_seed(5);
  auto w = torch::randn({5, 33}) * 0.02;
  w[2].zero_();  // an all-zero row stays exactly zero
  const auto q = m::quantize_int8(w);
  ASSERT_EQ(q.codes.scalar_type(), torch::kChar);
  const auto deq = m::dequantize_int8(q.codes, q.scales);
  auto wa = w.accessor<float, 2>();
  for (int64_t o = 0; o < 5; ++o) {
    double absmax = 0;
    for (int64_t i = 0; i < 33; ++i) absmax = std::max(absmax, std::abs(double(wa[o][i])));
    for (int64_t i = 0; i < 33; ++i) {
      const double code = absmax == 0 ? 0 : std::nearbyint(wa[o][i] / absmax * 127.0);
      EXPECT_EQ(q.codes[o][i].item<int>(), int(code)) << o << "," << i;
      EXPECT_NEAR(deq[o][i].item<double>(), code * absmax / 127.0, 1e-7);
    }
  }
  EXPECT_EQ(deq[2].abs().sum().item<double>(), 0.0);
}

TEST(Quantize, Nf4MatchesAReferenceLoop) {
  torch::manual_seed(6);
  for (const bool dq : {false, true}) {
    auto w = torch::randn({4, 128}) * 0.02;
    w.slice(1, 64, 128)[1].zero_();  // one all-zero block
    const auto q = m::quantize_nf4(w, dq);
    ASSERT_EQ(q.codes.scalar_type(), torch::kByte);
    ASSERT_EQ(q.codes.numel(), 4 * 128 / 2);
    const auto scales = m::nf4_scales(q);
    const auto deq = m::dequantize_nf4(q.codes, scales, {4, 128});
    const auto code = reference_nf4_code();
    const auto flat = w.reshape({-1});
    auto fa = flat.accessor<float, 1>();
    int mismatched = 0;
    for (int64_t blk = 0; blk < 8; ++blk) {
      double absmax = 0;
      for (int64_t j = 0; j < 64; ++j) absmax = std::max(absmax, std::abs(double(fa[blk * 64 + j])));
      for (int64_t j = 0; j < 64; ++j) {
        const int64_t e = blk * 64 + j;
        const double x = absmax == 0 ? 0 : fa[e] / absmax;
        int best = 0;
        for (int k = 1; k < 16; ++k) {
          if (std::abs(x - code[k]) < std::abs(x - code[best])) best = k;
        }
        const int byte = q.codes[e / 2].item<int>();
        const int got = e % 2 == 0 ? byte >> 4 : byte & 15;
        if (got != best) ++mismatched;
        // Dequantized with the (possibly double-quantized) scale of its block.
        EXPECT_NEAR(deq.reshape({-1})[e].item<double>(), code[got] * scales[blk].item<double>(), 1e-7);
        if (!dq) EXPECT_NEAR(scales[blk].item<double>(), absmax, 0);
      }
    }
    EXPECT_EQ(mismatched, 0);  // only exact midpoint ties could differ
    if (dq) {
      EXPECT_EQ(q.scales_q.scalar_type(), torch::kChar);
      EXPECT_LT((scales - m::quantize_nf4(w, false).scales).abs().max().item<double>(), 2e-4);
    }
  }
}

// Double quantization over several groups of kScaleBlock (256) scales,
// against a reference quantizer written here from the format's definition
// (quantize.h): the block absmaxes less their mean, int8 per group of 256
// with the group's own absmax, the last group partial. Blocks of each group
// get magnitudes of their own (x1, x5, x0.2), so a scale read through the
// wrong group's absmax is far off. Sizes: 1 block, exactly one group, one
// group and one scale, and 2 groups and a partial third (600 blocks).
TEST(Quantize, Nf4DoubleQuantizationMatchesAReferenceAcrossScaleGroups) {
  const auto code = reference_nf4_code();
  torch::manual_seed(8);
  for (const int64_t blocks : {1, 256, 257, 600}) {
    SCOPED_TRACE(std::to_string(blocks) + " blocks");
    const double factor[3] = {1.0, 5.0, 0.2};
    auto w = torch::randn({blocks, 64}) * 0.02;
    for (int64_t b = 0; b < blocks; ++b) w[b].mul_(factor[(b / 256) % 3]);
    const auto q = m::quantize_nf4(w, true);
    // The reference, in double from the float weights.
    auto wa = w.accessor<float, 2>();
    std::vector<double> absmax(static_cast<size_t>(blocks), 0.0);
    double mean = 0;
    for (int64_t b = 0; b < blocks; ++b) {
      for (int64_t j = 0; j < 64; ++j) absmax[b] = std::max(absmax[b], std::abs(double(wa[b][j])));
      mean += absmax[b] / double(blocks);
    }
    const int64_t groups = (blocks + 255) / 256;
    std::vector<double> group_scale(static_cast<size_t>(groups), 0.0);
    for (int64_t b = 0; b < blocks; ++b) {
      group_scale[b / 256] = std::max(group_scale[b / 256], std::abs(absmax[b] - mean));
    }
    ASSERT_EQ(q.scales_mean.numel(), 1);
    EXPECT_NEAR(q.scales_mean.item<double>(), mean, 1e-6 * mean);
    ASSERT_EQ(q.scales_scale.numel(), groups);
    ASSERT_EQ(q.scales_q.numel(), blocks);
    for (int64_t g = 0; g < groups; ++g) {
      EXPECT_NEAR(q.scales_scale[g].item<double>(), group_scale[g], 1e-6 * mean) << "group " << g;
    }
    const auto scales = m::nf4_scales(q);
    ASSERT_EQ(scales.numel(), blocks);
    const auto deq = m::dequantize_nf4(q.codes, scales, {blocks, 64});
    auto qa = q.scales_q.accessor<int8_t, 1>();
    auto sa = scales.accessor<float, 1>();
    auto ca = q.codes.accessor<uint8_t, 1>();
    auto da = deq.accessor<float, 2>();
    int wrong_codes = 0;
    for (int64_t b = 0; b < blocks; ++b) {
      const double gs = group_scale[b / 256];
      const double exact = gs == 0 ? 0 : 127.0 * (absmax[b] - mean) / gs;
      const double want_q = std::clamp(std::nearbyint(exact), -127.0, 127.0);
      // A value within rounding noise of a .5 may go either way.
      const bool tie = std::abs(std::abs(exact - std::trunc(exact)) - 0.5) < 1e-4;
      if (tie) {
        EXPECT_NEAR(qa[b], want_q, 1.0) << "block " << b;
      } else {
        EXPECT_EQ(int(qa[b]), int(want_q)) << "block " << b;
      }
      // The scale as stored: its code times its own group's step, plus the
      // mean; within half a step of the true absmax.
      const double want_scale = qa[b] * gs / 127.0 + mean;
      EXPECT_NEAR(sa[b], want_scale, 1e-6 * (mean + gs)) << "block " << b;
      EXPECT_LE(std::abs(sa[b] - absmax[b]), gs / 127.0 / 2 * (1 + 1e-4) + 1e-6 * mean)
          << "block " << b;
      for (int64_t j = 0; j < 64; ++j) {
        const double x = absmax[b] == 0 ? 0 : double(wa[b][j] / float(absmax[b]));
        int best = 0;
        for (int k = 1; k < 16; ++k) {
          if (std::abs(x - code[k]) < std::abs(x - code[best])) best = k;
        }
        const int64_t e = b * 64 + j;
        const int got = e % 2 == 0 ? ca[e / 2] >> 4 : ca[e / 2] & 15;
        // Only a value at a midpoint of two code values may take either.
        const bool midpoint = std::abs(got - best) == 1 &&
                              std::abs(x - (code[got] + code[best]) / 2) < 1e-6;
        if (got != best && !midpoint) ++wrong_codes;
        // The reference code values agree with the built-in ones to 2e-6.
        EXPECT_NEAR(da[b][j], code[got] * sa[b], 3e-6 * sa[b]) << "block " << b << " element " << j;
      }
    }
    EXPECT_EQ(wrong_codes, 0);
  }
}

// Reconstruction error on a GPT-like weight (N(0, 0.02)), printed for docs/lora.md.
TEST(Quantize, ReconstructionError) {
  torch::manual_seed(7);
  const auto w = torch::randn({768, 768}) * 0.02;
  const auto rel = [&](const torch::Tensor& d) {
    return ((d - w).pow(2).mean().sqrt() / w.pow(2).mean().sqrt()).item<double>();
  };
  const auto q8 = m::quantize_int8(w);
  const double e8 = rel(m::dequantize_int8(q8.codes, q8.scales));
  const auto q4 = m::quantize_nf4(w, false);
  const double e4 = rel(m::dequantize_nf4(q4.codes, q4.scales, {768, 768}));
  const auto q4d = m::quantize_nf4(w, true);
  const double e4d = rel(m::dequantize_nf4(q4d.codes, m::nf4_scales(q4d), {768, 768}));
  std::printf("relative RMS reconstruction error, N(0, 0.02) 768x768: int8 %.5f, nf4 %.5f, "
              "nf4+double-quant %.5f\n", e8, e4, e4d);
  EXPECT_LT(e8, 0.01);
  EXPECT_LT(e4, 0.12);
  EXPECT_LT(e4d, 0.12);
  EXPECT_LT(e8, e4);
}

// The quantized layer computes x deq(W)^T + b, and its input gradient uses deq(W).
TEST(Quantize, QuantizedLayerComputesWithTheDequantizedWeight) {
  for (const auto q : {LoraQuantize::Int8, LoraQuantize::Nf4}) {
    torch::manual_seed(8);
    m::MLP mlp(std::vector<int64_t>{64, 8});
    auto* l = mlp->layers[0]->as<torch::nn::LinearImpl>();
    const auto bias = l->bias.detach().clone();
    apply_lora(*mlp, LoraOptions().r(2).quantize(q).double_quant(true).target_modules({"layers.0"}));
    EXPECT_FALSE(l->named_parameters(false).contains("weight"));
    const auto w = m::lora_base_weight(*l);
    auto x = torch::randn({3, 64}, torch::requires_grad());
    auto y = m::lora_forward(*l, x);
    auto x_ref = x.detach().clone().requires_grad_(true);
    auto y_ref = torch::addmm(bias, x_ref, w.t());
    EXPECT_TRUE(torch::allclose(y, y_ref, 1e-5, 1e-6));
    y.pow(2).sum().backward();
    y_ref.pow(2).sum().backward();
    EXPECT_TRUE(torch::allclose(x.grad(), x_ref.grad(), 1e-5, 1e-6));
  }
}

// ---- the trainer -------------------------------------------------------------------

namespace st = shardtrain;

st::config::Config lora_job(const std::string& dir) {
  st::config::Config c;
  c.run.dir = dir;
  c.model.n_layer = 2;
  c.model.n_head = 2;
  c.model.n_embd = 64;
  c.model.block_size = 16;
  c.data.train = std::string(SHARDTRAIN_SOURCE_DIR) + "/data/corpus.txt";
  c.data.val_fraction = 0.0;
  c.batch.global = 4;
  c.batch.micro = 4;
  c.batch.accumulate.reset();
  c.optimizer.lr = 1e-2;
  c.schedule.warmup_steps = 0;
  c.trainer.max_steps = 3;
  c.trainer.eval_every = 0;
  c.trainer.sample_tokens = 0;
  c.trainer.progress = st::train::ProgressMode::None;
  c.distributed.strategy(st::strategy::StrategyKind::Single);
  c.lora.r(4);
  return c;
}

// The trainer loads model.init_from, then adapts: the frozen base ends the
// run equal to the file, the adapters moved, and only they had optimizer state.
TEST(LoraTrainer, BaseFromInitFromStaysFrozenAdaptersTrain) {
  for (const auto q : {LoraQuantize::None, LoraQuantize::Nf4}) {
    st::testing::TempDir tmp("lora_trainer");
    auto c = lora_job(tmp / "run");
    c.lora.quantize(q);
    torch::manual_seed(99);  // not run.seed: the file must win
    GPT base(st::train::gpt_config(c.model));
    std::vector<std::pair<std::string, torch::Tensor>> tensors;
    for (const auto& p : base->named_parameters()) {
      if (p.key() != "lm_head.weight") tensors.emplace_back(p.key(), p.value().detach());
    }
    st::checkpoint::save_safetensors(tmp / "base.safetensors", tensors, /*transpose_conv1d=*/true, {});
    c.model.init_from = tmp / "base.safetensors";
    st::train::Trainer trainer(c, st::train::make_task(c, 1),
                               st::comm::Communicator::create(st::comm::CommOptions()));
    trainer.fit();
    const auto got = trainer.model()->named_parameters();
    const auto want = base->named_parameters();
    int64_t trainable = 0;
    for (const auto& p : got) {
      if (p.key().find("lora_") != std::string::npos) {
        EXPECT_TRUE(p.value().requires_grad()) << p.key();
        trainable += p.value().numel();
        continue;
      }
      EXPECT_FALSE(p.value().requires_grad()) << p.key();
      if (want.contains(p.key())) {
        EXPECT_TRUE(torch::equal(p.value(), want[p.key()])) << p.key() << " changed";
      }
    }
    EXPECT_GT(got["h.1.mlp.c_fc.lora_B.weight"].abs().max().item<double>(), 0.0);
    // The optimizer holds the adapters only.
    int64_t optimized = 0;
    for (const auto& t : trainer.strategy().optimizer_parameters()) optimized += t.local.numel();
    EXPECT_EQ(optimized, trainable);
  }
}

// ---- PEFT files, init_from, merge ---------------------------------------------------

// A safetensors reader of our own: 8-byte little-endian header length, then
// the JSON header, then the data.
struct RawSafetensors {
  nlohmann::json header;
  std::string data;
};
RawSafetensors read_raw(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  uint64_t n = 0;
  in.read(reinterpret_cast<char*>(&n), 8);
  std::string h(n, '\0');
  in.read(h.data(), static_cast<std::streamsize>(n));
  RawSafetensors r;
  r.header = nlohmann::json::parse(h);
  r.data.assign(std::istreambuf_iterator<char>(in), {});
  return r;
}
torch::Tensor raw_tensor(const RawSafetensors& r, const std::string& name) {
  const auto& e = r.header.at(name);
  const auto off = e.at("data_offsets").get<std::vector<int64_t>>();
  auto t = torch::empty(e.at("shape").get<std::vector<int64_t>>(), torch::kFloat);
  EXPECT_EQ(off[1] - off[0], t.nbytes());
  std::memcpy(t.data_ptr(), r.data.data() + off[0], t.nbytes());
  return t;
}

std::vector<std::pair<std::string, torch::Tensor>> state_of(torch::nn::Module& m) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& p : m.named_parameters()) out.emplace_back(p.key(), p.value().detach());
  return out;
}

// A GPT whose adapters hold random values, as after some training.
GPT trained_lora_gpt(const LoraOptions& o, uint64_t seed = 11) {
  torch::manual_seed(seed);
  GPT model(tiny_gpt(64));
  apply_lora(*model, o);
  torch::NoGradGuard ng;
  for (auto& p : model->named_parameters()) {
    if (p.key().find("lora_B") != std::string::npos) p.value().normal_(0, 0.05);
  }
  return model;
}

TEST(LoraPeft, FilesHoldPeftNamesShapesDtypesAndConfigKeys) {
  st::testing::TempDir tmp("lora_peft");
  const auto o = LoraOptions().r(4).alpha(8).dropout(0.05);
  GPT model = trained_lora_gpt(o);
  m::save_peft_adapter(tmp / "a", state_of(*model), o, m::family_of(st::train::ModelType::Gpt), "base.safetensors");
  const auto raw = read_raw(tmp / "a/adapter_model.safetensors");
  std::set<std::string> names;
  for (auto it = raw.header.begin(); it != raw.header.end(); ++it) {
    if (it.key() != "__metadata__") names.insert(it.key());
  }
  std::set<std::string> want;
  std::map<std::string, std::vector<int64_t>> shapes = {
      {"attn.c_attn", {192, 64}}, {"attn.c_proj", {64, 64}}, {"mlp.c_fc", {256, 64}}, {"mlp.c_proj", {64, 256}}};
  for (int i = 0; i < 2; ++i) {
    for (const auto& [layer, wshape] : shapes) {
      const std::string p = "base_model.model.transformer.h." + std::to_string(i) + "." + layer;
      want.insert(p + ".lora_A.weight");
      want.insert(p + ".lora_B.weight");
      EXPECT_EQ(raw.header[p + ".lora_A.weight"]["shape"].get<std::vector<int64_t>>(),
                (std::vector<int64_t>{4, wshape[1]}));
      EXPECT_EQ(raw.header[p + ".lora_B.weight"]["shape"].get<std::vector<int64_t>>(),
                (std::vector<int64_t>{wshape[0], 4}));
      EXPECT_EQ(raw.header[p + ".lora_A.weight"]["dtype"], "F32");
    }
  }
  EXPECT_EQ(names, want);
  const auto b = raw_tensor(raw, "base_model.model.transformer.h.1.mlp.c_fc.lora_B.weight");
  EXPECT_TRUE(torch::equal(b, model->named_parameters()["h.1.mlp.c_fc.lora_B.weight"]));

  std::ifstream in(tmp / "a/adapter_config.json");
  const auto j = nlohmann::json::parse(in);
  EXPECT_EQ(j.at("peft_type"), "LORA");
  EXPECT_EQ(j.at("task_type"), "CAUSAL_LM");
  EXPECT_EQ(j.at("r"), 4);
  EXPECT_EQ(j.at("lora_alpha"), 8.0);
  EXPECT_EQ(j.at("lora_dropout"), 0.05);
  EXPECT_EQ(j.at("target_modules"), (std::vector<std::string>{"c_attn", "c_proj", "c_fc"}));
  EXPECT_EQ(j.at("fan_in_fan_out"), true);
  EXPECT_EQ(j.at("bias"), "none");
  EXPECT_EQ(j.at("base_model_name_or_path"), "base.safetensors");
}

TEST(LoraPeft, AdapterRoundTripGivesIdenticalLogits) {
  st::testing::TempDir tmp("lora_rt");
  for (const auto q : {LoraQuantize::None, LoraQuantize::Nf4}) {
    const auto o = LoraOptions().r(4).quantize(q);
    GPT model = trained_lora_gpt(o);
    m::save_peft_adapter(tmp / "a", state_of(*model), o, m::family_of(st::train::ModelType::Gpt));
    torch::manual_seed(11);  // the same base
    GPT again(tiny_gpt(64));
    apply_lora(*again, LoraOptions(o).seed(12345));  // other A init, overwritten
    m::load_peft_adapter(*again, tmp / "a", m::kPeftGptPrefix);
    const auto idx = tokens();
    EXPECT_TRUE(torch::equal(model->forward(idx), again->forward(idx)));
  }
}

// Under lora.train_bias: all the biases train, so the PEFT adapter carries them:
// the base plus the exported file, merged here by hand from the raw bytes
// (W + (alpha / r) B A for each adapted layer, each bias replaced by the
// file's), gives the trained model's logits (issue 47, third pass).
TEST(LoraPeft, TrainedBiasesAreExportedAndReproduceTheLogits) {
  st::testing::TempDir tmp("lora_bias");
  const auto o = LoraOptions().r(4).alpha(8).train_bias(LoraBias::All);
  GPT model = trained_lora_gpt(o);
  int trained = 0;
  {
    torch::NoGradGuard ng;
    for (auto& p : model->named_parameters()) {
      if (!p.value().requires_grad() || p.key().find("lora_") != std::string::npos) continue;
      p.value().add_(torch::randn_like(p.value()) * 0.1);  // as after training
      ++trained;
    }
  }
  ASSERT_GT(trained, 0);
  m::save_peft_adapter(tmp / "a", state_of(*model), o, m::family_of(st::train::ModelType::Gpt));
  const auto raw = read_raw(tmp / "a/adapter_model.safetensors");
  torch::manual_seed(11);  // the same base as trained_lora_gpt
  GPT merged(tiny_gpt(64));
  auto params = merged->named_parameters();
  const std::string prefix = m::kPeftGptPrefix;
  int biases = 0;
  {
    torch::NoGradGuard ng;
    for (auto it = raw.header.begin(); it != raw.header.end(); ++it) {
      if (it.key() == "__metadata__") continue;
      ASSERT_EQ(it.key().rfind(prefix, 0), 0u) << it.key();
      const std::string name = it.key().substr(prefix.size());
      const auto a_at = name.find(".lora_A.weight");
      if (a_at != std::string::npos) {
        const std::string layer = name.substr(0, a_at);
        const auto b = raw_tensor(raw, prefix + layer + ".lora_B.weight");
        params[layer + ".weight"].add_(b.matmul(raw_tensor(raw, it.key())), /*alpha=*/8.0 / 4.0);
      } else if (name.size() > 5 && name.compare(name.size() - 5, 5, ".bias") == 0) {
        params[name].copy_(raw_tensor(raw, it.key()));
        ++biases;
      }
    }
  }
  EXPECT_EQ(biases, trained);
  model->eval();
  merged->eval();
  const auto idx = tokens();
  EXPECT_TRUE(torch::allclose(model->forward(idx), merged->forward(idx), 1e-4, 1e-5));
}

TEST(LoraPeft, AdapterForAnotherModelIsACheckpointError) {
  st::testing::TempDir tmp("lora_bad");
  const auto o = LoraOptions().r(4);
  GPT model = trained_lora_gpt(o);
  m::save_peft_adapter(tmp / "a", state_of(*model), o, m::family_of(st::train::ModelType::Gpt));
  GPT other_r(tiny_gpt(64));
  apply_lora(*other_r, LoraOptions().r(2));
  auto msg = st::testing::checkpoint_error([&] { m::load_peft_adapter(*other_r, tmp / "a", m::kPeftGptPrefix); });
  EXPECT_NE(msg.find("shapes differ: h.0.attn.c_attn.lora_A.weight (file [4, 64], model [2, 64])"), std::string::npos) << msg;
  GPT fewer(tiny_gpt(64));
  apply_lora(*fewer, LoraOptions().r(4).target_modules({"c_attn"}));
  msg = st::testing::checkpoint_error([&] { m::load_peft_adapter(*fewer, tmp / "a", m::kPeftGptPrefix); });
  EXPECT_NE(msg.find("not in the model: base_model.model.transformer.h.0.attn.c_proj.lora_A.weight"), std::string::npos) << msg;
  // Merging into a base of another width names the layer.
  GPT narrow(tiny_gpt(32));
  st::checkpoint::save_safetensors(tmp / "narrow.safetensors", state_of(*narrow), true, {});
  msg = st::testing::checkpoint_error([&] { m::merge_peft_adapter(tmp / "narrow.safetensors", tmp / "a", tmp / "m.safetensors"); });
  EXPECT_NE(msg.find("does not fit the base weight"), std::string::npos) << msg;
}

TEST(LoraPeft, MergedWeightsGiveTheAdaptedLogits) {
  st::testing::TempDir tmp("lora_merge");
  for (const auto q : {LoraQuantize::None, LoraQuantize::Int8, LoraQuantize::Nf4}) {
    torch::manual_seed(11);
    GPT base(tiny_gpt(64));
    st::checkpoint::save_safetensors(tmp / "base.safetensors", state_of(*base), /*transpose_conv1d=*/true, {});
    const auto o = LoraOptions().r(4).alpha(12).quantize(q).double_quant(q == LoraQuantize::Nf4);
    GPT model = trained_lora_gpt(o);
    m::save_peft_adapter(tmp / "a", state_of(*model), o, m::family_of(st::train::ModelType::Gpt));
    // Through the CLI, as a user would.
    const auto run = st::testing::cli("lora merge --base " + tmp / "base.safetensors" + " --adapter " +
                                      tmp / "a" + " --out " + tmp / "merged.safetensors");
    ASSERT_EQ(run.code, 0) << run.out;
    EXPECT_NE(run.out.find("merged 8 adapted layers"), std::string::npos) << run.out;
    GPT merged(tiny_gpt(64));
    st::checkpoint::load_safetensors_into(*merged, tmp / "merged.safetensors",
                                          st::checkpoint::SafetensorsLoadOptions().transpose_conv1d(true));
    const auto idx = tokens();
    const auto want = model->forward(idx);
    const auto got = merged->forward(idx);
    EXPECT_TRUE(torch::allclose(got, want, 0, 1e-5))
        << st::enum_name(q) << ": differs by " << (got - want).abs().max().item<double>();
    // And not the base's: the adapter mattered.
    EXPECT_GT((base->forward(idx) - want).abs().max().item<double>(), 1e-3);
  }
  // Links planted at --out and its old temporary name are never written
  // through (issue 47, item 4).
  const std::string linked = tmp / "linked.safetensors";
  const st::testing::PlantedLinks planted(linked);
  const auto run = st::testing::cli("lora merge --base " + tmp / "base.safetensors" + " --adapter " + tmp / "a" +
                                    " --out " + linked);
  ASSERT_EQ(run.code, 0) << run.out;
  planted.expect_intact();
  EXPECT_EQ(st::testing::cli("lora merge --base x").code, 2);
}

// adapter_config.json is input like any other: a rank or scale that the
// tensors do not bear out, a wrong type, a FIFO or an endless file is one
// CheckpointError, and no merged file is written (issue 28, items 4 and 10).
TEST(LoraPeft, MergeChecksTheAdapterConfigAndWritesNothingOnError) {
  st::testing::TempDir tmp("lora_cfg");
  torch::manual_seed(11);
  GPT base(tiny_gpt(64));
  st::checkpoint::save_safetensors(tmp / "base.safetensors", state_of(*base), /*transpose_conv1d=*/true, {});
  const auto o = LoraOptions().r(4).alpha(8);
  GPT model = trained_lora_gpt(o);
  m::save_peft_adapter(tmp / "a", state_of(*model), o, m::family_of(st::train::ModelType::Gpt));
  const std::string config_path = tmp / "a/adapter_config.json";
  nlohmann::json good;
  {
    std::ifstream in(config_path);
    good = nlohmann::json::parse(in);
  }
  const auto write_config = [&](const std::string& key, const nlohmann::json& value) {
    nlohmann::json j = good;
    j[key] = value;
    std::ofstream(config_path, std::ios::trunc) << j.dump();
  };
  const std::string out = tmp / "merged.safetensors";
  const auto merge_error = [&] {
    const std::string msg = st::testing::checkpoint_error(
        [&] { m::merge_peft_adapter(tmp / "base.safetensors", tmp / "a", out); });
    EXPECT_FALSE(std::filesystem::exists(out)) << msg;
    EXPECT_FALSE(st::testing::temporary_left_beside(out)) << msg;
    return msg;
  };
  struct Case {
    std::string key;
    nlohmann::json value;
    std::string says;
  };
  const std::vector<Case> cases = {
      {"r", 0, "r is 0; expected a whole number in 1..1048576"},
      {"r", 1e-300, "r is 1e-300; expected a whole number"},
      {"r", -4, "r is -4; expected a whole number"},
      {"r", "4", "r is \"4\"; expected a whole number"},
      {"r", 1000000, "says r=1000000 (lora_A [r, in], lora_B [out, r])"},
      {"r", 2, "says r=2"},
      {"lora_alpha", "8", "lora_alpha is \"8\"; expected a number"},
      {"lora_alpha", 0, "give the scale 0"},
      {"lora_alpha", -8, "must be a finite number above 0"},
      {"use_rslora", "yes", "use_rslora is \"yes\"; expected true or false"},
      {"fan_in_fan_out", 1, "fan_in_fan_out is 1; expected true or false"},
      // A finite scale whose product overflows: no file holds inf.
      {"lora_alpha", 1e308, "NaN or infinite values"},
  };
  for (const Case& c : cases) {
    write_config(c.key, c.value);
    const std::string msg = merge_error();
    EXPECT_NE(msg.find(c.says), std::string::npos) << c.key << "=" << c.value.dump() << ": " << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
  // Not a regular file, or a regular file without end: refused at once.
  std::filesystem::remove(config_path);
  ASSERT_EQ(::mkfifo(config_path.c_str(), 0600), 0);
  EXPECT_NE(merge_error().find("FIFO"), std::string::npos);
  std::filesystem::remove(config_path);
  std::filesystem::create_symlink("/dev/zero", config_path);
  EXPECT_NE(merge_error().find("character device"), std::string::npos);
  std::filesystem::remove(config_path);
  std::ofstream(config_path) << std::string(2 << 20, ' ');
  EXPECT_NE(merge_error().find("larger than"), std::string::npos);
  // The good config still merges.
  write_config("r", 4);
  m::merge_peft_adapter(tmp / "base.safetensors", tmp / "a", out);
  EXPECT_TRUE(std::filesystem::exists(out));
}

// No export writes NaN or inf: the writer refuses before the file exists.
TEST(LoraPeft, NonFiniteTensorsAreNeverExported) {
  st::testing::TempDir tmp("nonfinite");
  const std::string out = tmp / "m.safetensors";
  for (const double bad : {std::nan(""), HUGE_VAL, -HUGE_VAL}) {
    torch::Tensor t = torch::ones({3, 4});
    t[1][2] = bad;
    const std::string msg = st::testing::checkpoint_error(
        [&] { st::checkpoint::save_safetensors(out, {{"ok", torch::ones({2})}, {"w", t}}, false, {}); });
    EXPECT_NE(msg.find("tensor 'w' holds 1 NaN or infinite values of 12"), std::string::npos) << msg;
    EXPECT_FALSE(std::filesystem::exists(out));
    EXPECT_FALSE(st::testing::temporary_left_beside(out));
  }
  st::checkpoint::save_safetensors(out, {{"w", torch::ones({3, 4})}}, false, {});
  EXPECT_TRUE(std::filesystem::exists(out));
  // A sharded export directory: not even the shards before the bad tensor.
  const std::string hf = tmp / "hf";
  torch::Tensor bad = torch::ones({64});
  bad[5] = std::nan("");
  const std::string msg = st::testing::checkpoint_error(
      [&] { m::save_hf_dir(hf, "{}", {{"a", torch::ones({64})}, {"b", bad}}, nullptr, 256); });
  EXPECT_NE(msg.find("tensor 'b' holds 1 NaN or infinite values of 64"), std::string::npos) << msg;
  EXPECT_FALSE(std::filesystem::exists(hf));
}

// A run writes <run.dir>/adapter; lora.init_from continues from it with the
// same logits.
TEST(LoraTrainer, RunWritesTheAdapterAndInitFromContinuesFromIt) {
  st::testing::TempDir tmp("lora_run");
  auto c = lora_job(tmp / "run");
  st::train::Trainer first(c, st::train::make_task(c, 1),
                           st::comm::Communicator::create(st::comm::CommOptions()));
  first.fit();
  const std::string adapter = st::train::detail::adapter_dir(c.run.dir);
  ASSERT_TRUE(std::filesystem::exists(adapter + "/adapter_model.safetensors"));
  ASSERT_TRUE(std::filesystem::exists(adapter + "/adapter_config.json"));
  auto c2 = c;
  c2.run.dir = tmp / "run2";
  c2.lora.init_from(adapter);
  st::train::Trainer second(c2, st::train::make_task(c2, 1),
                            st::comm::Communicator::create(st::comm::CommOptions()));
  const auto idx = torch::randint(0, 256, {2, 16}, torch::kLong);
  auto* a = dynamic_cast<m::GPTImpl*>(first.model().get());
  auto* b = dynamic_cast<m::GPTImpl*>(second.model().get());
  ASSERT_TRUE(a && b);
  a->eval();
  b->eval();
  EXPECT_TRUE(torch::equal(a->forward(idx), b->forward(idx)));
  // The exported model.safetensors is the merged model: a plain GPT.
  GPT plain(st::train::gpt_config(c.model));
  st::checkpoint::load_safetensors_into(*plain, c.run.dir + "/model.safetensors",
                                        st::checkpoint::SafetensorsLoadOptions().transpose_conv1d(true));
  plain->eval();
  EXPECT_TRUE(torch::allclose(plain->forward(idx), a->forward(idx), 0, 1e-5));
  // init_from without r is a configuration error.
  auto c3 = c2;
  c3.lora.r(0);
  EXPECT_THROW(st::train::Trainer(c3, st::train::make_task(c3, 1),
                                  st::comm::Communicator::create(st::comm::CommOptions())),
               ConfigError);
}

struct Losses : st::train::Callback {
  std::vector<double> v;
  void on_step_end(st::train::TrainerState& s, st::train::TrainerControl&) override { v.push_back(s.loss); }
};

// Continues job `c` (4 steps) from checkpoint `from` in `dir`: the last two
// losses of the uninterrupted run `whole`, bit for bit.
void expect_resumed_losses(st::config::Config c, const std::string& from, const std::string& dir,
                           const Losses& whole) {
  c.run.dir = dir;
  c.checkpoint.resume = from;
  auto resumed = std::make_shared<Losses>();
  {
    st::train::Trainer t(c, st::train::make_task(c, 1), st::comm::Communicator::create(st::comm::CommOptions()));
    t.add_callback(resumed);
    t.fit();
  }
  ASSERT_EQ(whole.v.size(), 4u);
  ASSERT_EQ(resumed->v.size(), 2u);
  EXPECT_EQ(resumed->v[0], whole.v[2]);
  EXPECT_EQ(resumed->v[1], whole.v[3]);
}

// Sharded checkpoints of a QLoRA run (uint8 codes, int8 scales, adapters and
// their optimizer state) resume bit-exactly.
TEST(LoraTrainer, QuantizedRunResumesBitExactly) {
  st::testing::TempDir tmp("lora_resume");
  auto c = lora_job(tmp / "run");
  c.lora.quantize(LoraQuantize::Nf4).double_quant(true);
  c.trainer.max_steps = 4;
  c.checkpoint.every_n_steps = 2;
  auto whole = std::make_shared<Losses>();
  {
    st::train::Trainer t(c, st::train::make_task(c, 1), st::comm::Communicator::create(st::comm::CommOptions()));
    t.add_callback(whole);
    t.fit();
  }
  expect_resumed_losses(c, st::checkpoint::checkpoint_dir(c.run.dir, 2), tmp / "resumed", *whole);
}

// A base file for lora_job(): a GPT of the job's shape from its own seed.
std::string write_base(const st::config::Config& c, const std::string& path, uint64_t seed) {
  torch::manual_seed(seed);
  GPT base(st::train::gpt_config(c.model));
  std::vector<std::pair<std::string, torch::Tensor>> tensors;
  for (const auto& p : base->named_parameters()) {
    if (p.key() != "lm_head.weight") tensors.emplace_back(p.key(), p.value().detach());
  }
  st::checkpoint::save_safetensors(path, tensors, /*transpose_conv1d=*/true, {});
  return path;
}

int64_t checkpoint_bytes(const std::string& dir) {
  int64_t n = 0;
  for (const auto& f : st::checkpoint::read_metadata(dir).files) n += f.bytes;
  return n;
}

// With model.init_from, checkpoints leave the frozen base out and record the
// file instead: they resume bit-exactly from it, are refused when the file
// changed or is not given, load for `generate`, and are not consolidated
// into a model that would lack the base. checkpoint.save_frozen_base copies it.
TEST(LoraTrainer, CheckpointsReferenceTheBaseUnlessAsked) {
  namespace ck = st::checkpoint;
  st::testing::TempDir tmp("lora_ref");
  auto c = lora_job(tmp / "run");
  c.lora.quantize(LoraQuantize::Nf4);
  c.trainer.max_steps = 4;
  c.checkpoint.every_n_steps = 2;
  c.model.init_from = write_base(c, tmp / "base.safetensors", 99);
  auto whole = std::make_shared<Losses>();
  torch::Tensor final_logits;
  const auto idx = torch::randint(0, 256, {2, 16}, torch::kLong);
  {
    st::train::Trainer t(c, st::train::make_task(c, 1), st::comm::Communicator::create(st::comm::CommOptions()));
    t.add_callback(whole);
    t.fit();
    t.model()->eval();
    final_logits = dynamic_cast<m::GPTImpl&>(*t.model()).forward(idx);
  }
  const std::string step2 = ck::checkpoint_dir(c.run.dir, 2);
  const auto md = ck::read_metadata(step2);
  EXPECT_EQ(md.find_tensor("h.0.attn.c_attn.qweight"), nullptr);
  EXPECT_EQ(md.find_tensor("wte.weight"), nullptr);
  EXPECT_NE(md.find_tensor("h.0.attn.c_attn.lora_A.weight"), nullptr);
  {
    ck::CheckpointReader reader(step2);
    const auto state = nlohmann::json::parse(reader.train_state());
    ASSERT_TRUE(state.contains("lora_base")) << state.dump();
    EXPECT_EQ(state["lora_base"]["bytes"].get<int64_t>(),
              static_cast<int64_t>(std::filesystem::file_size(c.model.init_from)));
    EXPECT_EQ(state["lora_base"]["sha256"].get<std::string>().size(), 64u);
  }

  // Resumed from the referenced checkpoint: the same losses, bit for bit.
  expect_resumed_losses(c, step2, tmp / "resumed", *whole);
  auto r = c;
  r.run.dir = tmp / "resumed";
  r.checkpoint.resume = step2;

  // The final checkpoint as `generate` loads it gives the trained model's logits.
  {
    ck::CheckpointReader reader(ck::checkpoint_dir(c.run.dir, 4));
    GPT loaded(st::train::gpt_config(c.model));
    st::train::load_trained_model(*loaded, c, reader);
    loaded->eval();
    EXPECT_TRUE(torch::equal(loaded->forward(idx), final_logits));
  }
  const auto gen = st::testing::cli("generate --checkpoint " + ck::checkpoint_dir(c.run.dir, 4) +
                                    " --max-new-tokens 4");
  EXPECT_EQ(gen.code, 0) << gen.out;
  const auto cons = st::testing::cli("checkpoint consolidate " + step2 + " --out " + tmp / "c.safetensors");
  EXPECT_NE(cons.code, 0) << cons.out;
  EXPECT_NE(cons.out.find("does not copy"), std::string::npos) << cons.out;
  EXPECT_FALSE(std::filesystem::exists(tmp / "c.safetensors"));

  // Another base under the same name, or none: a CheckpointError naming it.
  write_base(c, c.model.init_from, 100);
  auto msg = st::testing::checkpoint_error([&] {
    st::train::Trainer t(r, st::train::make_task(r, 1), st::comm::Communicator::create(st::comm::CommOptions()));
    t.fit();
  });
  EXPECT_NE(msg.find("was trained on the frozen base"), std::string::npos) << msg;
  EXPECT_NE(msg.find("save_frozen_base"), std::string::npos) << msg;
  auto no_base = r;
  no_base.model.init_from.clear();
  msg = st::testing::checkpoint_error([&] {
    st::train::Trainer t(no_base, st::train::make_task(no_base, 1),
                         st::comm::Communicator::create(st::comm::CommOptions()));
    t.fit();
  });
  EXPECT_NE(msg.find("model.init_from is not set"), std::string::npos) << msg;

  // Asked to copy: the base is in the checkpoint, which is many times larger.
  auto copy = c;
  copy.run.dir = tmp / "copy";
  copy.trainer.max_steps = 2;
  copy.checkpoint.save_frozen_base = true;
  {
    st::train::Trainer t(copy, st::train::make_task(copy, 1), st::comm::Communicator::create(st::comm::CommOptions()));
    t.fit();
  }
  const std::string copied = ck::checkpoint_dir(copy.run.dir, 2);
  EXPECT_NE(ck::read_metadata(copied).find_tensor("h.0.attn.c_attn.qweight"), nullptr);
  EXPECT_GT(checkpoint_bytes(copied), 2 * checkpoint_bytes(step2));
}

// Activation checkpointing recomputes adapted blocks: the same gradients, fp32 and nf4.
TEST(Lora, ActivationCheckpointingGivesTheSameAdapterGradients) {
  for (const auto q : {LoraQuantize::None, LoraQuantize::Nf4}) {
    std::map<std::string, torch::Tensor> grads[2];
    const auto idx = tokens();
    for (int ck = 0; ck < 2; ++ck) {
      torch::manual_seed(21);
      auto c = tiny_gpt(64);
      c.activation_checkpointing = ck == 1;
      GPT model(c);
      apply_lora(*model, LoraOptions().r(2).quantize(q).dropout(0.1));
      {
        torch::NoGradGuard ng;
        for (auto& p : model->named_parameters()) {
          if (p.key().find("lora_B") != std::string::npos) p.value().normal_(0, 0.05);
        }
      }
      torch::manual_seed(5);  // the same dropout masks
      model->forward(idx).pow(2).mean().backward();
      for (const auto& p : model->named_parameters()) {
        if (p.value().requires_grad()) grads[ck][p.key()] = p.value().grad();
      }
    }
    ASSERT_EQ(grads[0].size(), 16u);
    for (const auto& [name, g] : grads[0]) {
      EXPECT_TRUE(torch::allclose(grads[1][name], g, 1e-5, 1e-7)) << st::enum_name(q) << " " << name;
    }
  }
}

// Mixed precision applies to adapters as to any parameter: fp32 masters
// under bf16-mixed, bf16 under bf16-true, with a quantized base.
TEST(LoraTrainer, MixedPrecisionTrainsTheAdapters) {
  for (const char* precision : {"bf16-mixed", "bf16-true"}) {
    st::testing::TempDir tmp("lora_bf16");
    auto c = lora_job(tmp / "run");
    c.lora.quantize(LoraQuantize::Nf4);
    c.precision = st::enum_from_name<st::precision::PrecisionKind>(precision, "precision");
    struct Losses : st::train::Callback {
      std::vector<double> v;
      void on_step_end(st::train::TrainerState& s, st::train::TrainerControl&) override { v.push_back(s.loss); }
    };
    auto losses = std::make_shared<Losses>();
    st::train::Trainer t(c, st::train::make_task(c, 1), st::comm::Communicator::create(st::comm::CommOptions()));
    t.add_callback(losses);
    t.fit();
    ASSERT_EQ(losses->v.size(), 3u);
    for (double l : losses->v) EXPECT_TRUE(std::isfinite(l)) << precision;
    const auto b = t.model()->named_parameters()["h.0.attn.c_attn.lora_B.weight"];
    EXPECT_EQ(b.scalar_type(), std::string(precision) == "bf16-true" ? torch::kBFloat16 : torch::kFloat);
    EXPECT_GT(b.abs().max().item<double>(), 0.0) << precision;
    EXPECT_EQ(t.model()->named_parameters()["h.0.attn.c_attn.qweight"].scalar_type(), torch::kByte);
  }
}

// ---- byte flats of the sharded strategies -------------------------------------------

TEST(FlatBytes, ByteFlatsShardInWholeWordsAndTravelAsInt32) {
  using shardtrain::strategy::detail::as_words;
  using shardtrain::strategy::detail::plan_flat;
  using shardtrain::strategy::detail::word_multiple;
  EXPECT_EQ(word_multiple(torch::kByte), 4);
  EXPECT_EQ(word_multiple(torch::kChar), 4);
  EXPECT_EQ(word_multiple(torch::kFloat), 1);
  for (const std::vector<int64_t>& numels : {std::vector<int64_t>{0}, {1}, {5, 0, 2}, {64, 3}}) {
    int64_t total = 0;
    for (int64_t x : numels) total += x;
    for (int n = 1; n <= 3; ++n) {
      for (int r = 0; r < n; ++r) {
        const auto l = plan_flat(numels, n, r, 4);
        EXPECT_EQ(l.shard_numel % 4, 0);
        EXPECT_GE(l.padded, total);
        EXPECT_LT(l.padded, total + 4 * n);
        EXPECT_EQ(l.shard_offset, r * l.shard_numel);
        int64_t held = 0;
        for (const auto& s : l.slots) held += s.shard_count;
        EXPECT_LE(held, l.shard_numel);
      }
    }
  }
  auto bytes = torch::arange(16, torch::kLong).to(torch::kByte);
  const auto words = as_words(bytes.narrow(0, 4, 8));
  EXPECT_EQ(words.scalar_type(), torch::kInt);
  EXPECT_EQ(words.numel(), 2);
  EXPECT_EQ(static_cast<const char*>(words.data_ptr()), static_cast<const char*>(bytes.data_ptr()) + 4);
  const auto f = torch::ones({3});
  EXPECT_TRUE(as_words(f).is_same(f));
}

}  // namespace
