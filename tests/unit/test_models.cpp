// GPT and MLP: parameter names and shapes, causality, tied weights,
// generation, config validation and a short training run.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <utility>
#include <vector>

#include "shardtrain/core/error.h"
#include "shardtrain/models/causal_lm.h"
#include "shardtrain/models/gpt.h"
#include "shardtrain/models/mlp.h"

namespace {

using shardtrain::ConfigError;
using shardtrain::models::GPT;
using shardtrain::models::GPTConfig;
using shardtrain::models::MLP;

GPTConfig tiny_config() {
  GPTConfig config;
  config.n_layer = 2;
  config.n_head = 2;
  config.n_embd = 16;
  config.block_size = 8;
  config.vocab_size = 11;
  return config;
}

std::vector<std::pair<std::string, std::vector<int64_t>>> named_shapes(torch::nn::Module& module) {
  std::vector<std::pair<std::string, std::vector<int64_t>>> out;
  for (const auto& item : module.named_parameters()) {
    out.emplace_back(item.key(), item.value().sizes().vec());
  }
  return out;
}

// ---- structure ----------------------------------------------------------------------

TEST(GPT, ParameterNamesAndShapesFollowGpt2) {
  const auto c = tiny_config();
  GPT model(c);
  const int64_t C = c.n_embd;
  std::vector<std::pair<std::string, std::vector<int64_t>>> expected = {
      {"wte.weight", {c.vocab_size, C}}, {"wpe.weight", {c.block_size, C}}};
  for (int i = 0; i < 2; ++i) {
    const std::string p = "h." + std::to_string(i) + ".";
    std::vector<std::pair<std::string, std::vector<int64_t>>> block = {
        {p + "ln_1.weight", {C}},
        {p + "ln_1.bias", {C}},
        {p + "attn.c_attn.weight", {3 * C, C}},
        {p + "attn.c_attn.bias", {3 * C}},
        {p + "attn.c_proj.weight", {C, C}},
        {p + "attn.c_proj.bias", {C}},
        {p + "ln_2.weight", {C}},
        {p + "ln_2.bias", {C}},
        {p + "mlp.c_fc.weight", {4 * C, C}},
        {p + "mlp.c_fc.bias", {4 * C}},
        {p + "mlp.c_proj.weight", {C, 4 * C}},
        {p + "mlp.c_proj.bias", {C}},
    };
    expected.insert(expected.end(), block.begin(), block.end());
  }
  expected.push_back({"ln_f.weight", {C}});
  expected.push_back({"ln_f.bias", {C}});
  EXPECT_EQ(named_shapes(*model), expected);
  // No mask or other buffers: nothing for a strategy to broadcast.
  EXPECT_EQ(model->buffers().size(), 0u);
}

TEST(GPT, NumParametersMatchesTheModel) {
  for (const auto& c : {tiny_config(), GPTConfig{}}) {
    GPT model(c);
    int64_t count = 0;
    for (const auto& p : model->parameters()) count += p.numel();
    EXPECT_EQ(c.num_parameters(), count);
  }
}

TEST(GPT, InitialisationFollowsGpt2) {
  torch::manual_seed(0);
  GPTConfig c = tiny_config();
  c.n_embd = 64;
  c.vocab_size = 256;
  c.n_layer = 8;
  GPT model(c);
  const auto params = model->named_parameters();
  const double proj_std = 0.02 / std::sqrt(2.0 * c.n_layer);
  EXPECT_NEAR(params["wte.weight"].std().item<double>(), 0.02, 0.002);
  EXPECT_NEAR(params["h.0.attn.c_attn.weight"].std().item<double>(), 0.02, 0.002);
  EXPECT_NEAR(params["h.3.mlp.c_fc.weight"].std().item<double>(), 0.02, 0.002);
  EXPECT_NEAR(params["h.0.attn.c_proj.weight"].std().item<double>(), proj_std, proj_std * 0.1);
  EXPECT_NEAR(params["h.7.mlp.c_proj.weight"].std().item<double>(), proj_std, proj_std * 0.1);
  EXPECT_EQ(params["h.1.attn.c_attn.bias"].abs().max().item<float>(), 0.0f);
  EXPECT_EQ(params["h.1.mlp.c_proj.bias"].abs().max().item<float>(), 0.0f);
  EXPECT_TRUE(params["ln_f.weight"].eq(1).all().item<bool>());
  EXPECT_TRUE(params["h.2.ln_1.bias"].eq(0).all().item<bool>());
}

TEST(GPT, ForwardShape) {
  GPT model(tiny_config());
  const auto idx = torch::randint(0, 11, {3, 5}, torch::kLong);
  const auto logits = model->forward(idx);
  EXPECT_EQ(logits.sizes().vec(), (std::vector<int64_t>{3, 5, 11}));
  // A full block works, one token more is an error.
  EXPECT_NO_THROW(model->forward(torch::zeros({1, 8}, torch::kLong)));
  EXPECT_THROW(model->forward(torch::zeros({1, 9}, torch::kLong)), shardtrain::InvalidArgument);
}

TEST(GPT, AttentionIsCausal) {
  torch::manual_seed(1);
  GPT model(tiny_config());
  const auto idx = torch::randint(0, 11, {2, 8}, torch::kLong);
  const auto base = model->forward(idx);
  for (int64_t t = 0; t < 7; ++t) {
    auto changed = idx.clone();
    changed.slice(1, t + 1) = (changed.slice(1, t + 1) + 3) % 11;
    const auto out = model->forward(changed);
    EXPECT_TRUE(torch::allclose(out.slice(1, 0, t + 1), base.slice(1, 0, t + 1), 1e-5, 1e-6))
        << "position <= " << t << " saw the future";
    EXPECT_FALSE(torch::allclose(out.slice(1, t + 1), base.slice(1, t + 1), 1e-5, 1e-6));
  }
}

TEST(GPT, OutputProjectionIsTiedToWte) {
  torch::manual_seed(2);
  GPT model(tiny_config());
  for (const auto& item : model->named_parameters()) {
    EXPECT_EQ(item.key().find("lm_head"), std::string::npos) << item.key();
  }
  // Changing wte.weight changes the logits through the output projection:
  // with a fixed final hidden state, logits = h @ wte^T.
  const auto idx = torch::randint(0, 11, {2, 4}, torch::kLong);
  auto x = model->wte(idx) + model->wpe(torch::arange(4, torch::kLong));
  for (const auto& m : *model->h) x = m->as<shardtrain::models::BlockImpl>()->forward(x);
  const auto expected = torch::matmul(model->ln_f(x), model->wte->weight.t());
  EXPECT_TRUE(torch::allclose(model->forward(idx), expected, 1e-5, 1e-6));

  // The gradient reaches rows of wte that were never used as inputs, which
  // only the output projection can do.
  const auto only_zero = torch::zeros({1, 4}, torch::kLong);
  model->zero_grad();
  model->forward(only_zero).sum().backward();
  const auto grad = model->wte->weight.grad();
  ASSERT_TRUE(grad.defined());
  EXPECT_GT(grad.slice(0, 1).abs().sum().item<double>(), 0.0);
}

// ---- generation -----------------------------------------------------------------------

// Sampling through models::generate (causal_lm.h), which every family shares.
shardtrain::models::GenerateOptions sampling(int64_t n, double temperature, int64_t top_k, uint64_t seed) {
  return shardtrain::models::GenerateOptions().max_new_tokens(n).temperature(temperature).top_k(top_k).seed(seed);
}

TEST(GPT, GenerateIsDeterministicForASeed) {
  torch::manual_seed(3);
  GPT model(tiny_config());
  const auto prompt = torch::tensor({{1, 2, 3}}, torch::kLong);
  const auto a = shardtrain::models::generate(*model, prompt, sampling(12, 1.0, 0, 42));
  torch::manual_seed(999);  // the global generator must not matter
  const auto b = shardtrain::models::generate(*model, prompt, sampling(12, 1.0, 0, 42));
  const auto c = shardtrain::models::generate(*model, prompt, sampling(12, 1.0, 0, 43));
  EXPECT_EQ(a.sizes().vec(), (std::vector<int64_t>{1, 15}));
  EXPECT_TRUE(torch::equal(a, b));
  EXPECT_FALSE(torch::equal(a, c));
  EXPECT_TRUE(torch::equal(a.slice(1, 0, 3), prompt));
  EXPECT_FALSE(a.requires_grad());
}

TEST(GPT, GenerateRespectsTopK) {
  torch::manual_seed(4);
  GPT model(tiny_config());
  const auto prompt = torch::tensor({{5}}, torch::kLong);
  // top_k = 1 is greedy: every step picks the arg-max of the logits.
  const auto out = shardtrain::models::generate(*model, prompt, sampling(6, 1.0, 1, 7));
  for (int64_t t = 1; t < out.size(1); ++t) {
    const auto logits = model->forward(out.slice(1, 0, t)).select(1, -1);
    EXPECT_EQ(out[0][t].item<int64_t>(), logits.argmax(-1)[0].item<int64_t>());
  }
  // top_k = 3: every sampled token is among the 3 most likely ones.
  const auto batch = torch::randint(0, 11, {16, 2}, torch::kLong);
  const auto logits = model->forward(batch).select(1, -1);
  const auto top3 = std::get<1>(logits.topk(3, -1));
  for (int64_t b = 0; b < 16; ++b) {
    const auto sampled = shardtrain::models::generate(*model, batch.slice(0, b, b + 1), sampling(1, 2.0, 3, 11 + b));
    const auto tok = sampled[0][2].item<int64_t>();
    EXPECT_TRUE(top3[b].eq(tok).any().item<bool>()) << "row " << b << " token " << tok;
  }
}

TEST(GPT, GenerateCropsTheContextToBlockSize) {
  torch::manual_seed(5);
  GPT model(tiny_config());  // block_size 8
  const auto prompt = torch::randint(0, 11, {1, 20}, torch::kLong);
  for (const bool cache : {true, false}) {
    const auto out = shardtrain::models::generate(*model, prompt, sampling(10, 1.0, 1, 0).use_cache(cache));
    EXPECT_EQ(out.sizes().vec(), (std::vector<int64_t>{1, 30}));
    // With greedy decoding the first new token depends only on the last 8.
    const auto expected = model->forward(prompt.slice(1, 12)).select(1, -1).argmax(-1);
    EXPECT_TRUE(torch::equal(out.select(1, 20), expected));
  }
}

// Dropout acts in training mode only, with masks from the global generator;
// evaluation and sampling see the whole model, even from training mode.
TEST(GPT, DropoutOnlyWhileTraining) {
  GPTConfig c = tiny_config();
  c.dropout = 0.5;
  torch::manual_seed(6);
  GPT with(c);
  c.dropout = 0.0;
  torch::manual_seed(6);
  GPT without(c);
  const auto idx = torch::randint(0, 11, {2, 8}, torch::kLong);

  const auto y0 = without->forward(idx);
  torch::manual_seed(1);
  const auto y1 = with->forward(idx);
  const auto y2 = with->forward(idx);
  torch::manual_seed(1);
  const auto y1_again = with->forward(idx);
  EXPECT_FALSE(torch::allclose(y1, y0));
  EXPECT_FALSE(torch::equal(y1, y2));      // new masks each call
  EXPECT_TRUE(torch::equal(y1, y1_again));  // the same generator state, the same masks

  const auto prompt = torch::tensor({{1, 2, 3}}, torch::kLong);
  EXPECT_TRUE(torch::equal(shardtrain::models::generate(*with, prompt, sampling(6, 1.0, 0, 9)),
                           shardtrain::models::generate(*without, prompt, sampling(6, 1.0, 0, 9))));
  EXPECT_TRUE(with->is_training());  // generate leaves the mode as it found it
  with->eval();
  without->eval();
  EXPECT_TRUE(torch::equal(with->forward(idx), without->forward(idx)));
}

// ---- validation -------------------------------------------------------------------------

TEST(GPTConfig, ValidateNamesTheKey) {
  auto expect_error = [](GPTConfig c, const std::string& key) {
    try {
      c.validate();
      ADD_FAILURE() << "no error for " << key;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(key), std::string::npos) << e.what();
    }
    EXPECT_THROW(GPT{c}, ConfigError);
  };
  GPTConfig c = tiny_config();
  EXPECT_NO_THROW(c.validate());
  c = tiny_config(); c.n_layer = 0; expect_error(c, "model.n_layer");
  c = tiny_config(); c.n_head = -1; expect_error(c, "model.n_head");
  c = tiny_config(); c.n_embd = 0; expect_error(c, "model.n_embd");
  c = tiny_config(); c.n_embd = 18; c.n_head = 4; expect_error(c, "model.n_head=4");
  c = tiny_config(); c.block_size = 0; expect_error(c, "model.block_size");
  c = tiny_config(); c.vocab_size = 0; expect_error(c, "model.vocab_size");
  c = tiny_config(); c.dropout = 1.0; expect_error(c, "model.dropout");
  c = tiny_config(); c.dropout = -0.1; expect_error(c, "model.dropout");
}

// ---- MLP ----------------------------------------------------------------------------------

TEST(MLP, NamesShapesAndForward) {
  MLP mlp(std::vector<int64_t>{5, 7, 3});
  const std::vector<std::pair<std::string, std::vector<int64_t>>> expected = {
      {"layers.0.weight", {7, 5}},
      {"layers.0.bias", {7}},
      {"layers.1.weight", {3, 7}},
      {"layers.1.bias", {3}}};
  EXPECT_EQ(named_shapes(*mlp), expected);
  EXPECT_EQ(mlp->forward(torch::randn({4, 5})).sizes().vec(), (std::vector<int64_t>{4, 3}));
  EXPECT_EQ(mlp->forward(torch::randn({2, 4, 5})).sizes().vec(), (std::vector<int64_t>{2, 4, 3}));
  // One layer: no activation at all.
  MLP linear(std::vector<int64_t>{3, 2});
  const auto x = torch::randn({6, 3});
  const auto p = linear->named_parameters();
  const auto affine = torch::addmm(p["layers.0.bias"], x, p["layers.0.weight"].t());
  EXPECT_TRUE(torch::allclose(linear->forward(x), affine));
  EXPECT_THROW(MLP(std::vector<int64_t>{4}), shardtrain::InvalidArgument);
  EXPECT_THROW(MLP(std::vector<int64_t>{4, 0, 2}), shardtrain::InvalidArgument);
}

// ---- training -------------------------------------------------------------------------------

TEST(GPT, AFewStepsReduceTheLossOnARepeatedPattern) {
  torch::manual_seed(6);
  GPTConfig c = tiny_config();
  c.n_embd = 32;
  c.block_size = 16;
  GPT model(c);
  // 0 1 2 ... 10 0 1 2 ...: every next token is determined by the current one.
  const auto seq = torch::arange(0, 4 * 17, torch::kLong).remainder(11).view({4, 17});
  const auto input = seq.slice(1, 0, 16);
  const auto target = seq.slice(1, 1, 17);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(3e-3).weight_decay(0.0));
  auto loss_of = [&] {
    const auto logits = model->forward(input);
    return torch::cross_entropy_loss(logits.reshape({-1, c.vocab_size}), target.reshape({-1}));
  };
  const double first = loss_of().item<double>();
  for (int step = 0; step < 60; ++step) {
    opt.zero_grad();
    auto loss = loss_of();
    loss.backward();
    opt.step();
  }
  const double last = loss_of().item<double>();
  EXPECT_NEAR(first, std::log(11.0), 0.3);  // small init: close to uniform
  EXPECT_LT(last, 0.25 * first) << "first " << first << " last " << last;
}

}  // namespace
