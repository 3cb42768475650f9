// Deferred tensors (core/deferred.h): placeholders that keep shape, dtype and
// autograd identity, hold one element, refuse writes, and read any element
// range through their reader; materialize() and the strategies read them.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "shardtrain/core/deferred.h"
#include "shardtrain/core/error.h"

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
