// GPT and MLP: parameter names and shapes, causality, tied weights,
// generation, config validation and a short training run.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <utility>
#include <vector>

#include "models/activation_kernels.h"
#include "models/activations.h"
#include "models/attention.h"
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

// ---- the fused GELU (models/activation_kernels.h) against LibTorch's ----------------------------

namespace gk = shardtrain::models::detail;

// Inputs across GELU's range: both tails, where tanh saturates, the bend
// around zero, tiny and exact zeros, and random values.
at::Tensor gelu_inputs() {
  torch::manual_seed(7);
  const std::vector<float> fixed = {0.0f, -0.0f, 1e-30f, -1e-30f, 1e-4f, -1e-4f, 0.01f, -0.01f, 0.5f, -0.5f,
                                    1.0f, -1.0f, 2.0f, -2.0f, 3.0f, -3.0f, 4.5f, -4.5f, 5.7f, -5.7f,
                                    8.9f, -8.9f, 9.1f, -9.1f, 12.0f, -12.0f, 30.0f, -30.0f, 1e4f, -1e4f};
  return torch::cat({torch::tensor(fixed), torch::randn({4096}) * 3.0f, torch::randn({1000})});
}

// fp32: within a few ulps of LibTorch's, forward and backward (its tanh is
// another approximation; what the two agree to is what either is worth).
TEST(FusedGelu, Fp32MatchesLibTorchForwardAndBackward) {
  const at::Tensor x = gelu_inputs();
  const at::Tensor dy = torch::randn(x.sizes());
  const int64_t n = x.numel();
  at::Tensor y = torch::empty_like(x), dx = torch::empty_like(x);
  gk::gelu_tanh_forward(x.data_ptr<float>(), y.data_ptr<float>(), n);
  gk::gelu_tanh_backward(x.data_ptr<float>(), dy.data_ptr<float>(), dx.data_ptr<float>(), n);
  const at::Tensor xr = x.clone().requires_grad_(true);
  const at::Tensor want = torch::gelu(xr, "tanh");
  want.backward(dy);
  const at::Tensor scale = torch::clamp_min(x.abs(), 1.0);
  EXPECT_LE(((y - want.detach()).abs() / scale).max().item<float>(), 4e-7f);
  EXPECT_LE(((dx - xr.grad()).abs() / (scale * torch::clamp_min(dy.abs(), 1.0))).max().item<float>(), 1e-6f);
  // Not finite in, not finite out (LibTorch: NaN for -inf, its -inf * 0).
  const at::Tensor odd = torch::tensor({std::nanf(""), INFINITY, -INFINITY});
  at::Tensor odd_y = torch::empty_like(odd);
  gk::gelu_tanh_forward(odd.data_ptr<float>(), odd_y.data_ptr<float>(), 3);
  EXPECT_TRUE(std::isnan(odd_y[0].item<float>()));
  EXPECT_EQ(odd_y[1].item<float>(), INFINITY);
  EXPECT_FALSE(std::isfinite(odd_y[2].item<float>()));
  EXPECT_STRNE(gk::activation_kernel_variant(), "");
}

// bf16: computed in fp32 and rounded once, so the exact value rounded to
// bf16, but where the fp32 value straddles a rounding boundary: one bf16 ulp. (LibTorch's own bf16 GELU rounds its intermediates: 45% of
// its results differ from the exact value rounded once, some by 100%.)
TEST(FusedGelu, Bf16IsTheExactValueRoundedOnce) {
  const at::Tensor x = gelu_inputs().to(at::kBFloat16);
  const at::Tensor dy = torch::randn(x.sizes()).to(at::kBFloat16);
  const int64_t n = x.numel();
  at::Tensor y = torch::empty_like(x), dx = torch::empty_like(x);
  const auto bits = [](const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); };
  gk::gelu_tanh_forward(bits(x), bits(y), n);
  gk::gelu_tanh_backward(bits(x), bits(dy), bits(dx), n);
  // The exact values in fp64, with 1 + tanh(u) as 2 / (1 + e^(-2u)): the
  // plain form cancels in the left tail, where GELU is 1e-15 and less.
  const at::Tensor xd = x.to(at::kDouble);
  const double c = std::sqrt(2.0 / M_PI), k = 0.044715;
  const at::Tensor u = c * (xd + k * xd.pow(3));
  const at::Tensor one_plus_tanh = 2.0 / (1.0 + torch::exp(-2.0 * u));
  const at::Tensor slope = 0.5 * one_plus_tanh +
                           0.5 * xd * one_plus_tanh * (2.0 - one_plus_tanh) * c * (1.0 + 3.0 * k * xd * xd);
  const at::Tensor want_y = (0.5 * xd * one_plus_tanh).to(at::kBFloat16);
  const at::Tensor want_dx = (dy.to(at::kDouble) * slope).to(at::kBFloat16);
  // Within one bf16 ulp, plus for the gradient what fp32 arithmetic loses
  // near the slope's zero (x about -0.75), where two O(1) terms cancel.
  const auto close = [](const at::Tensor& got, const at::Tensor& ref, const at::Tensor& slack) {
    const at::Tensor g = got.to(at::kDouble), r = ref.to(at::kDouble);
    const at::Tensor ulp = torch::clamp_min(r.abs(), 1e-30) * std::ldexp(1.0, -7);
    return ((g - r).abs() <= ulp + slack).all().item<bool>();
  };
  EXPECT_TRUE(close(y, want_y, torch::zeros_like(xd)));
  EXPECT_TRUE(close(dx, want_dx, 1e-6 * dy.to(at::kDouble).abs() * torch::clamp_min(xd.abs(), 1.0)));
  EXPECT_GT(torch::eq(y, want_y).to(at::kFloat).mean().item<float>(), 0.99f);
  EXPECT_GT(torch::eq(dx, want_dx).to(at::kFloat).mean().item<float>(), 0.99f);
}

// SwiGLU's gate silu(g) * u, fp32: within a few ulps of LibTorch's ops,
// forward and backward; bf16: the exact value rounded once (one ulp, plus
// what fp32 loses where silu' crosses zero, g about -1.28).
TEST(FusedSwiGlu, MatchesLibTorchInFp32AndTheExactValueInBf16) {
  const at::Tensor g = gelu_inputs(), u = torch::randn(g.sizes()) * 2.0, dy = torch::randn(g.sizes());
  const int64_t n = g.numel();
  {
    at::Tensor y = torch::empty_like(g), dg = torch::empty_like(g), du = torch::empty_like(g);
    gk::swiglu_forward(g.data_ptr<float>(), u.data_ptr<float>(), y.data_ptr<float>(), n);
    gk::swiglu_backward(g.data_ptr<float>(), u.data_ptr<float>(), dy.data_ptr<float>(), dg.data_ptr<float>(),
                        du.data_ptr<float>(), n);
    const at::Tensor gr = g.clone().requires_grad_(true), ur = u.clone().requires_grad_(true);
    const at::Tensor want = torch::silu(gr) * ur;
    want.backward(dy);
    const at::Tensor scale = torch::clamp_min(g.abs(), 1.0) * torch::clamp_min(u.abs(), 1.0);
    const at::Tensor dscale = scale * torch::clamp_min(dy.abs(), 1.0);
    EXPECT_LE(((y - want.detach()).abs() / scale).max().item<float>(), 4e-7f);
    EXPECT_LE(((dg - gr.grad()).abs() / dscale).max().item<float>(), 1e-6f);
    EXPECT_LE(((du - ur.grad()).abs() / dscale).max().item<float>(), 1e-6f);
  }
  const at::Tensor gb = g.to(at::kBFloat16), ub = u.to(at::kBFloat16), dyb = dy.to(at::kBFloat16);
  at::Tensor y = torch::empty_like(gb), dg = torch::empty_like(gb), du = torch::empty_like(gb);
  const auto bits = [](const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); };
  gk::swiglu_forward(bits(gb), bits(ub), bits(y), n);
  gk::swiglu_backward(bits(gb), bits(ub), bits(dyb), bits(dg), bits(du), n);
  const at::Tensor gd = gb.to(at::kDouble), ud = ub.to(at::kDouble), dd = dyb.to(at::kDouble);
  const at::Tensor sig = torch::sigmoid(gd);
  const auto close = [](const at::Tensor& got, const at::Tensor& exact, const at::Tensor& slack) {
    const at::Tensor r = exact.to(at::kBFloat16).to(at::kDouble), d = got.to(at::kDouble);
    const at::Tensor ulp = torch::clamp_min(r.abs(), 1e-30) * std::ldexp(1.0, -7);
    return ((d - r).abs() <= ulp + slack).all().item<bool>();
  };
  const at::Tensor none = torch::zeros_like(gd);
  EXPECT_TRUE(close(y, gd * sig * ud, none));
  EXPECT_TRUE(close(du, dd * gd * sig, none));
  EXPECT_TRUE(close(dg, dd * ud * sig * (1.0 + gd * (1.0 - sig)),
                    1e-6 * (dd * ud).abs() * torch::clamp_min(gd.abs(), 1.0)));
}

// ---- attention's fused softmax ----------------------------------------------------

// The softmax kernel on one row: y[lo, hi) as LibTorch's softmax of that
// slice (scaled), 0 elsewhere; the backward as LibTorch's autograd of it;
// the row computed again from the forward's maximum and 1 / sum the same
// bits as the forward.
// Every row length to 40 (the lanes of 16 and their tails), ranges
// starting at 0 and inside.
TEST(FusedSoftmax, RowMatchesLibTorchOnItsRangeAndZeroElsewhere) {
  const float scale = 0.37f;
  for (int64_t cols = 1; cols <= 40; ++cols) {
    for (const int64_t lo : {int64_t{0}, cols / 3}) {
      for (const int64_t hi : {lo + 1, (lo + cols + 1) / 2, cols}) {
        if (hi <= lo) continue;
        const at::Tensor x = torch::randn({cols}) * 4.0, dy = torch::randn({cols});
        at::Tensor y = torch::full({cols}, 7.0f), dx = torch::full({cols}, 7.0f), again = torch::full({cols}, 7.0f);
        float stats[2];
        gk::softmax_row_forward(x.data_ptr<float>(), y.data_ptr<float>(), cols, lo, hi, scale, stats);
        gk::softmax_row_again(x.data_ptr<float>(), again.data_ptr<float>(), cols, lo, hi, scale, stats);
        gk::softmax_row_backward(y.data_ptr<float>(), dy.data_ptr<float>(), dx.data_ptr<float>(), cols, lo, hi,
                                 scale);
        const at::Tensor xr = x.slice(0, lo, hi).to(at::kDouble).requires_grad_(true);
        const at::Tensor want = torch::softmax(xr * scale, 0);
        want.backward(dy.slice(0, lo, hi).to(at::kDouble));
        const at::Tensor want_y = torch::zeros({cols}, at::kDouble), want_dx = torch::zeros({cols}, at::kDouble);
        want_y.slice(0, lo, hi).copy_(want.detach());
        want_dx.slice(0, lo, hi).copy_(xr.grad());
        SCOPED_TRACE("cols " + std::to_string(cols) + " [" + std::to_string(lo) + ", " + std::to_string(hi) + ")");
        EXPECT_LE((y.to(at::kDouble) - want_y).abs().max().item<double>(), 3e-7);
        EXPECT_LE((dx.to(at::kDouble) - want_dx).abs().max().item<double>(), 1e-6);
        EXPECT_TRUE(torch::equal(again, y));
        EXPECT_EQ(stats[0], x.slice(0, lo, hi).max().item<float>());
        EXPECT_NEAR(stats[1], 1.0 / torch::exp((xr.detach() - stats[0]) * scale).sum().item<double>(), 1e-6 * stats[1]);
      }
    }
  }
  // A NaN score makes its row NaN; scores far below the row's maximum give 0.
  const at::Tensor x = torch::tensor({1.0f, std::nanf(""), 2.0f}), far = torch::tensor({0.0f, -1e4f, -100.0f});
  at::Tensor y = torch::empty_like(x);
  float stats[2];
  gk::softmax_row_forward(x.data_ptr<float>(), y.data_ptr<float>(), 3, 0, 3, 1.0f, stats);
  EXPECT_TRUE(torch::isnan(y).all().item<bool>());
  gk::softmax_row_forward(far.data_ptr<float>(), y.data_ptr<float>(), 3, 0, 3, 1.0f, stats);
  EXPECT_EQ(y[0].item<float>(), 1.0f);
  EXPECT_EQ(y[1].item<float>(), 0.0f);
  EXPECT_EQ(y[2].item<float>(), 0.0f);
}

// softmax(q k^T / sqrt(d) masked) v written out independently: fp64, the
// key/value heads repeated as Hugging Face's repeat_kv, the mask from its
// definition (key j visible to query i when j <= i + S - T and, with
// segments, both lie in one segment), the whole square computed.
at::Tensor reference_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& segment) {
  const int64_t b = q.size(0), h = q.size(1), t = q.size(2), d = q.size(3), s = k.size(2);
  const int64_t groups = h / k.size(1);
  const at::Tensor kk = k.to(at::kDouble).repeat_interleave(groups, 1);
  const at::Tensor vv = v.to(at::kDouble).repeat_interleave(groups, 1);
  const at::Tensor i = torch::arange(t).view({t, 1}), j = torch::arange(s).view({1, s});
  at::Tensor visible = (j <= i + (s - t)).view({1, 1, t, s});
  if (segment.defined()) visible = visible.logical_and(segment.view({b, 1, t, 1}) == segment.view({b, 1, 1, s}));
  const at::Tensor scores = torch::matmul(q.to(at::kDouble), kk.transpose(2, 3)) / std::sqrt(double(d));
  return torch::matmul(torch::softmax(scores.masked_fill(visible.logical_not(), -INFINITY), -1), vv);
}

struct AttentionCase {
  std::string name;
  int64_t b, h, kv, t, s, d;
  at::Tensor segment;
};

// causal_attention against the reference, output and the gradients of q,
// k and v, in fp32 and bf16: plain rows of 1, 5 and 37 positions, grouped
// heads, queries after a cache (T < S), packed rows with trailing padding,
// and segment ids that come back (the masked path); and rows of 300 (panels
// of 128, 128 and 44 queries), 150 queries after a cache of 140, and packed
// rows whose segments cross panels. Each with q, k and v of their own and
// as the models pass them: [B, H, T, d] views of [B, T, H, d] tensors (the
// heads of a projection's output), which the fused path reads in place.
TEST(FusedSoftmax, AttentionMatchesAnIndependentReference) {
  const std::vector<AttentionCase> cases = {
      {"one position", 1, 2, 2, 1, 1, 4, {}},
      {"five positions, grouped heads", 2, 4, 2, 5, 5, 8, {}},
      {"37 positions", 1, 2, 1, 37, 37, 16, {}},
      {"after a cache", 2, 2, 2, 3, 10, 8, {}},
      {"packed", 2, 2, 1, 7, 7, 8, torch::tensor({0, 0, 0, 1, 1, -1, -1, 0, 1, 1, 1, 1, 2, 3}).view({2, 7})},
      {"ids that come back, grouped heads", 1, 4, 2, 6, 6, 8, torch::tensor({0, 0, 1, 1, 0, 0}).view({1, 6})},
      {"300 positions, grouped heads", 2, 4, 2, 300, 300, 8, {}},
      {"150 after a cache of 140", 1, 2, 2, 150, 290, 8, {}},
      {"packed across panels", 1, 2, 2, 260, 260, 8,
       torch::cat({torch::full({100}, 0), torch::full({90}, 1), torch::full({50}, 2), torch::full({20}, -1)})
           .view({1, 260})},
  };
  for (const auto dtype : {at::kFloat, at::kBFloat16}) {
    for (const bool interleaved : {false, true}) {
      for (const auto& c : cases) {
        SCOPED_TRACE(c.name + (dtype == at::kFloat ? " fp32" : " bf16") + (interleaved ? " interleaved" : ""));
        // A leaf [B, heads, n, d], or [B, n, heads, d] seen as [B, heads, n, d].
        const auto leaf = [&](int64_t heads, int64_t n) {
          return (interleaved ? torch::randn({c.b, n, heads, c.d}) : torch::randn({c.b, heads, n, c.d}))
              .to(dtype)
              .requires_grad_(true);
        };
        const auto as_heads = [&](const at::Tensor& x) { return interleaved ? x.transpose(1, 2) : x; };
        const at::Tensor ql = leaf(c.h, c.t), kl = leaf(c.kv, c.s), vl = leaf(c.kv, c.s);
        const at::Tensor q = as_heads(ql), k = as_heads(kl), v = as_heads(vl);
        const at::Tensor dy = torch::randn({c.b, c.h, c.t, c.d}).to(dtype);
        const at::Tensor y = shardtrain::models::detail::causal_attention(q, k, v, c.segment, 0.0, true);
        EXPECT_EQ(y.scalar_type(), dtype);
        y.backward(dy);
        const at::Tensor qd = q.detach().to(at::kDouble).requires_grad_(true);
        const at::Tensor kd = k.detach().to(at::kDouble).requires_grad_(true);
        const at::Tensor vd = v.detach().to(at::kDouble).requires_grad_(true);
        const at::Tensor want = reference_attention(qd, kd, vd, c.segment);
        want.backward(dy.to(at::kDouble));
        // fp32: rounding of the GEMMs; bf16: the result rounded to bf16
        // (8 bits) once, except on the masked path, whose GEMMs are bf16.
        const bool masked = c.name == "ids that come back, grouped heads";
        const double tol = dtype == at::kFloat ? 2e-5 : masked ? 6e-2 : 8e-3;
        const auto err = [](const at::Tensor& got, const at::Tensor& ref) {
          return ((got.to(at::kDouble) - ref).abs() / torch::clamp_min(ref.abs(), 1.0)).max().item<double>();
        };
        EXPECT_LE(err(y.detach(), want.detach()), tol);
        EXPECT_LE(err(as_heads(ql.grad()), qd.grad()), tol);
        EXPECT_LE(err(as_heads(kl.grad()), kd.grad()), tol);
        EXPECT_LE(err(as_heads(vl.grad()), vd.grad()), tol);
      }
    }
  }
}

// ---- the language models' fused cross-entropy -----------------------------------------

// The summed loss written out from its definition in fp64: for each row whose
// target is not ignored, log sum_j e^x_j - x_target, the sum of exponentials
// taken from the row's maximum; its gradient by autograd.
at::Tensor reference_cross_entropy(const at::Tensor& logits, const at::Tensor& target, int64_t ignore) {
  at::Tensor total = (logits * 0.0).sum();  // 0, and a gradient of zeros
  for (int64_t r = 0; r < logits.size(0); ++r) {
    const int64_t t = target[r].item<int64_t>();
    if (t == ignore) continue;
    const at::Tensor row = logits[r];
    const at::Tensor m = row.max().detach();
    total = total + (torch::log(torch::exp(row - m).sum()) + m - row[t]);
  }
  return total;
}

// cross_entropy_sum against the reference, loss and gradient, fp32 and bf16:
// no rows, one class, rows of 7 and 300 classes with ignored targets, rows
// of 1,000 scaled to +-80 (where a sum of exponentials without the maximum
// overflows fp32), every target ignored; the gradient scaled by what comes
// from above (0.37).
TEST(FusedCrossEntropy, MatchesAnIndependentReference) {
  const int64_t ignore = -100;
  struct Case {
    std::string name;
    int64_t rows, vocab;
    double scale;
    bool all_ignored;
  };
  const std::vector<Case> cases = {{"no rows", 0, 5, 1.0, false},       {"one class", 3, 1, 1.0, false},
                                   {"7 classes", 5, 7, 3.0, false},     {"300 classes", 37, 300, 3.0, false},
                                   {"large logits", 4, 1000, 80.0, false}, {"every target ignored", 4, 7, 1.0, true}};
  for (const auto dtype : {at::kFloat, at::kBFloat16}) {
    for (const auto& c : cases) {
      SCOPED_TRACE(c.name + (dtype == at::kFloat ? " fp32" : " bf16"));
      at::Tensor x = (torch::rand({c.rows, c.vocab}) * 2 - 1) * c.scale;
      x = x.to(dtype).requires_grad_(true);
      at::Tensor target = torch::randint(0, c.vocab, {c.rows}, at::kLong);
      for (int64_t r = 0; r < c.rows; ++r) {
        if (c.all_ignored || r % 3 == 1) target[r] = ignore;
      }
      const at::Tensor loss = gk::cross_entropy_sum(x, target, ignore);
      EXPECT_EQ(loss.scalar_type(), at::kFloat);
      (loss * 0.37).backward();
      const at::Tensor xd = x.detach().to(at::kDouble).requires_grad_(true);
      const at::Tensor want = reference_cross_entropy(xd, target, ignore);
      (want * 0.37).backward();
      const double w = want.item<double>();
      EXPECT_LE(std::abs(loss.item<double>() - w) / std::max(std::abs(w), 1.0), 1e-6);
      if (c.rows == 0) continue;
      // Gradients of at most 0.37 in size: fp32's rounding of e^(x - lse)
      // (about 1e-7 at logits of 80), and for bf16 the result rounded once
      // (at most half of bf16's 2^-9 spacing below 0.5).
      const double tol = dtype == at::kFloat ? 2e-6 : 1.5e-3;
      EXPECT_LE((x.grad().to(at::kDouble) - xd.grad()).abs().max().item<double>(), tol);
      if (c.all_ignored) {
        EXPECT_EQ(loss.item<float>(), 0.0f);
        EXPECT_TRUE(torch::equal(x.grad(), torch::zeros_like(x)));
      }
    }
  }
}

// A NaN logit makes its row's loss NaN; a target outside the vocabulary that
// is not the ignore index is an InvalidArgument naming it.
TEST(FusedCrossEntropy, NanRowsAndTargetsOutsideTheVocabulary) {
  const at::Tensor x = torch::zeros({2, 4});
  x[1][2] = std::nanf("");
  EXPECT_TRUE(std::isnan(gk::cross_entropy_sum(x, torch::tensor({0, 1}), -100).item<float>()));
  EXPECT_FALSE(std::isnan(gk::cross_entropy_sum(x, torch::tensor({0, -100}), -100).item<float>()));
  for (const int64_t bad : {int64_t{4}, int64_t{-1}}) {
    try {
      gk::cross_entropy_sum(x, torch::tensor({int64_t{0}, bad}), -100);
      ADD_FAILURE() << "target " << bad << " accepted";
    } catch (const shardtrain::InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("target " + std::to_string(bad) + " of row 1"), std::string::npos)
          << e.what();
    }
  }
}

}  // namespace
