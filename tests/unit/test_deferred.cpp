// Deferred tensors (core/deferred.h): placeholders that keep shape, dtype and
// autograd identity, hold one element, refuse writes, and read any element
// range through their reader; materialize() and the strategies read them.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "shardtrain/core/deferred.h"
#include "shardtrain/core/error.h"
#include "shardtrain/models/lora.h"
#include "shardtrain/models/quantize.h"

namespace st = shardtrain;

namespace {

// Values 0, 1, 2, ... in row-major order, as a file would hold them.
st::DeferredReader counting_reader(int* calls = nullptr) {
  return [calls](int64_t first, const at::Tensor& out) {
    if (calls != nullptr) ++*calls;
    out.copy_(torch::arange(first, first + out.numel(), torch::kDouble));
  };
}

}  // namespace

TEST(Deferred, PlaceholderKeepsShapeDtypeAndIdentityButNotTheStorage) {
  torch::nn::Linear layer(torch::nn::LinearOptions(300, 200));
  const at::Tensor weight = layer->weight;  // the same TensorImpl as the module's
  st::defer(layer->weight, counting_reader());
  EXPECT_TRUE(st::is_deferred(weight));
  EXPECT_TRUE(st::is_deferred(layer->named_parameters()["weight"]));
  EXPECT_EQ(weight.sizes(), (std::vector<int64_t>{200, 300}));
  EXPECT_EQ(weight.scalar_type(), torch::kFloat);
  EXPECT_TRUE(weight.requires_grad());
  EXPECT_LE(weight.storage().nbytes(), 4u);
  EXPECT_FALSE(st::is_deferred(torch::zeros({3})));
  EXPECT_FALSE(st::is_deferred(at::Tensor()));
  {
    torch::NoGradGuard no_grad;
    // One element stands for all: writes are refused.
    EXPECT_ANY_THROW(weight.copy_(torch::ones({200, 300})));
    EXPECT_ANY_THROW(weight.normal_());
  }
}

TEST(Deferred, RangesAndMaterializeReadTheReadersValues) {
  torch::nn::Linear layer(torch::nn::LinearOptions(7, 5));
  int calls = 0;
  st::defer(layer->weight, counting_reader(&calls));
  const at::Tensor part = torch::empty({10});
  st::read_deferred(layer->weight, 13, part, "w");
  EXPECT_TRUE(torch::equal(part, torch::arange(13, 23, torch::kFloat)));
  // Ranges past the end, wrong dtypes and 2-D buffers are refused.
  EXPECT_THROW(st::read_deferred(layer->weight, 30, torch::empty({10}), "w"), st::InvalidArgument);
  EXPECT_THROW(st::read_deferred(layer->weight, 0, torch::empty({10}, torch::kDouble), "w"),
               st::InvalidArgument);
  st::read_deferred(layer->weight, 35, torch::empty({0}), "w");  // empty: nothing read
  EXPECT_EQ(calls, 1);

  st::materialize(*layer.ptr());
  EXPECT_FALSE(st::is_deferred(layer->weight));
  EXPECT_TRUE(torch::equal(layer->weight, torch::arange(35, torch::kFloat).view({5, 7})));
  EXPECT_TRUE(layer->weight.requires_grad());
  EXPECT_FALSE(st::is_deferred(layer->bias));  // never deferred: untouched
}

TEST(Deferred, CastPlaceholderReadsInItsOwnDtype) {
  const at::Tensor t = st::deferred_tensor({2, 3}, torch::kFloat, counting_reader());
  const at::Tensor bf = st::deferred_as(t, torch::kBFloat16);
  EXPECT_TRUE(st::is_deferred(bf));
  EXPECT_EQ(bf.scalar_type(), torch::kBFloat16);
  const at::Tensor out = torch::empty({6}, torch::kBFloat16);
  st::read_deferred(bf, 0, out, "t");
  EXPECT_TRUE(torch::equal(out, torch::arange(6, torch::kBFloat16)));
}

TEST(Deferred, ValuesNobodyProvidedAreAnErrorNamingTheTensor) {
  torch::nn::Linear layer(torch::nn::LinearOptions(4, 4));
  st::defer_parameters(*layer.ptr());
  EXPECT_TRUE(st::is_deferred(layer->weight) && st::is_deferred(layer->bias));
  try {
    st::materialize(*layer.ptr());
    FAIL() << "no error";
  } catch (const st::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("'weight' is deferred"), std::string::npos) << e.what();
  }
}

// A deferred base under nf4: every quantized tensor reads any range, one that
// starts or ends inside a 64-element block included (a shard boundary may
// fall anywhere), exactly as the whole weight quantized at once gives it.
TEST(Deferred, QuantizedBaseReadsAnyRangeAsTheWholeQuantization) {
  for (const bool double_quant : {false, true}) {
    torch::manual_seed(3);
    const at::Tensor values = torch::randn({96, 640});  // 960 blocks, 4 scale groups
    torch::nn::Sequential model(torch::nn::Linear(torch::nn::LinearOptions(640, 96).bias(false)));
    auto layer = model->ptr<torch::nn::LinearImpl>(0);
    st::defer(layer->weight, [values](int64_t first, const at::Tensor& out) {
      out.copy_(values.view({-1}).narrow(0, first, out.numel()));
    });
    st::models::LoraOptions o;
    o.r(4).target_modules({"0"}).quantize(st::models::LoraQuantize::Nf4).double_quant(double_quant);
    st::models::apply_lora(*model, o);
    const st::models::QuantizedWeight whole = st::models::quantize_nf4(values, double_quant);
    const auto params = layer->named_parameters(/*recurse=*/false);
    const std::vector<std::pair<std::string, at::Tensor>> parts =
        double_quant ? std::vector<std::pair<std::string, at::Tensor>>{{"qweight", whole.codes},
                                                                        {"qscale_q", whole.scales_q},
                                                                        {"qscale_scale", whole.scales_scale},
                                                                        {"qscale_mean", whole.scales_mean}}
                     : std::vector<std::pair<std::string, at::Tensor>>{{"qweight", whole.codes},
                                                                        {"qscale", whole.scales}};
    for (const auto& [name, want] : parts) {
      const at::Tensor& p = params[name];
      ASSERT_TRUE(st::is_deferred(p)) << name;
      const int64_t n = p.numel();
      // Ranges inside one block, across blocks, across chunks, and the whole.
      for (const auto& [first, count] : std::vector<std::pair<int64_t, int64_t>>{
               {0, n}, {5, std::min<int64_t>(n - 5, 77)}, {n / 3, n - n / 3}, {n - 1, 1}, {0, 1}}) {
        if (count <= 0) continue;
        const at::Tensor got = torch::empty({count}, p.options().requires_grad(false));
        st::read_deferred(p, first, got, name.c_str());
        EXPECT_TRUE(torch::equal(got, want.reshape({-1}).narrow(0, first, count)))
            << name << " [" << first << ", +" << count << ") double_quant=" << double_quant;
      }
    }
  }
}
