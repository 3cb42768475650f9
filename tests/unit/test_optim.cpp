// The trainer's fused AdamW against LibTorch's torch::optim::AdamW: the same
// parameters, gradients and options must give bit-identical parameters and
// state, step after step, for every size the fused loop's vector body and
// tail see, and for the parameters that fall back to tensor ops. Also when a
// forced OpenBLAS kernel set is below the CPU (core/blas.h).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "shardtrain/core/blas.h"
#include "train/adamw_kernel.h"
#include "train/fused_adamw.h"

namespace shardtrain {
namespace {

using train::detail::FusedAdamW;

struct Pair {
  std::vector<torch::Tensor> fused, reference;
};

// Two groups (decay and none), as the trainer builds them.
template <typename Opt>
std::unique_ptr<Opt> make(const std::vector<torch::Tensor>& decay, const std::vector<torch::Tensor>& plain) {
  auto options = [](double wd) {
    return std::make_unique<torch::optim::AdamWOptions>(
        torch::optim::AdamWOptions(3e-3).betas({0.9, 0.95}).eps(1e-8).weight_decay(wd));
  };
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay, options(0.1));
  groups.emplace_back(plain, options(0.0));
  return std::make_unique<Opt>(groups, torch::optim::AdamWOptions(3e-3));
}

void expect_identical(const torch::Tensor& a, const torch::Tensor& b, const std::string& what) {
  ASSERT_EQ(a.sizes(), b.sizes()) << what;
  const int64_t differing = a.ne(b).sum().item<int64_t>();
  EXPECT_EQ(differing, 0) << what << ": " << differing << " of " << a.numel()
                          << " elements differ; max |diff| "
                          << (a.numel() ? (a.to(torch::kDouble) - b.to(torch::kDouble)).abs().max().item<double>() : 0.0);
}

TEST(FusedAdamW, BitIdenticalToLibTorchAdamW) {
  torch::manual_seed(7);
  // Sizes: empty, one element, a tail only, vector body + tail, large.
  const std::vector<int64_t> sizes = {0, 1, 7, 1000003};
  std::vector<torch::Tensor> fd, fp, rd, rp;
  for (int64_t n : sizes) {
    const auto w = torch::randn({n});
    fd.push_back(w.clone().requires_grad_());
    rd.push_back(w.clone().requires_grad_());
    const auto b = torch::randn({n}) * 0.1;
    fp.push_back(b.clone().requires_grad_());
    rp.push_back(b.clone().requires_grad_());
  }
  // Fallbacks: a non-contiguous parameter and a bf16 one.
  const auto t = torch::randn({33, 17});
  fd.push_back(t.clone().t().requires_grad_());
  rd.push_back(t.clone().t().requires_grad_());
  const auto h = torch::randn({100}).to(torch::kBFloat16);
  fp.push_back(h.clone().requires_grad_());
  rp.push_back(h.clone().requires_grad_());

  auto fused = make<FusedAdamW>(fd, fp);
  auto reference = make<torch::optim::AdamW>(rd, rp);
  std::vector<torch::Tensor> all_f = fd, all_r = rd;
  all_f.insert(all_f.end(), fp.begin(), fp.end());
  all_r.insert(all_r.end(), rp.begin(), rp.end());
  for (int step = 1; step <= 5; ++step) {
    for (size_t i = 0; i < all_f.size(); ++i) {
      // Gradients with a spread of magnitudes, some exactly zero.
      auto g = torch::randn(all_f[i].sizes()).to(all_f[i].scalar_type()) * std::pow(10.0, step - 3);
      if (g.numel() > 0) g.view(-1).slice(0, 0, g.numel() / 3 + 1).zero_();
      all_f[i].mutable_grad() = g.clone();
      all_r[i].mutable_grad() = g.clone();
    }
    fused->step();
    reference->step();
    for (size_t i = 0; i < all_f.size(); ++i) {
      const std::string what = "parameter " + std::to_string(i) + " after step " + std::to_string(step);
      expect_identical(all_f[i], all_r[i], what);
      const auto key_f = c10::guts::to_string(all_f[i].unsafeGetTensorImpl());
      const auto key_r = c10::guts::to_string(all_r[i].unsafeGetTensorImpl());
      const auto& sf = static_cast<torch::optim::AdamWParamState&>(*fused->state().at(key_f));
      const auto& sr = static_cast<torch::optim::AdamWParamState&>(*reference->state().at(key_r));
      EXPECT_EQ(sf.step(), sr.step());
      expect_identical(sf.exp_avg(), sr.exp_avg(), what + " exp_avg");
      expect_identical(sf.exp_avg_sq(), sr.exp_avg_sq(), what + " exp_avg_sq");
    }
  }
}

// Each variant of the loop this CPU can run (the trainer uses the first)
// against LibTorch's tensor ops, over a size with a vector body and a tail.
TEST(FusedAdamW, EveryKernelVariantMatchesLibTorch) {
  const auto variants = train::detail::adamw_update_variants();
  ASSERT_FALSE(variants.empty());
  EXPECT_EQ(variants.back(), "baseline");
  torch::manual_seed(3);
  const int64_t n = 1037;
  for (const std::string& name : variants) {
    auto p = torch::randn({n}), m = torch::randn({n}) * 0.01, v = torch::rand({n}) * 1e-4;
    auto rp = p.clone(), rm = m.clone(), rv = v.clone();
    const auto g = torch::randn({n});
    const double lr = 3e-3, wd = 0.1, b1 = 0.9, b2 = 0.95, eps = 1e-8;
    const int64_t step = 3;
    const double bc1 = 1 - std::pow(b1, step), bc2 = 1 - std::pow(b2, step);
    const auto s = train::detail::adamw_scalars(lr, wd, b1, b2, eps, step);
    train::detail::adamw_update_variant(name, p.data_ptr<float>(), g.data_ptr<float>(), m.data_ptr<float>(),
                                        v.data_ptr<float>(), n, s);
    rp.mul_(1 - lr * wd);
    rm.mul_(b1).add_(g, 1 - b1);
    rv.mul_(b2).addcmul_(g, g, 1 - b2);
    rp.addcdiv_(rm, (rv.sqrt() / std::sqrt(bc2)).add_(eps), -lr / bc1);
    expect_identical(p, rp, name + " param");
    expect_identical(m, rm, name + " exp_avg");
    expect_identical(v, rv, name + " exp_avg_sq");
  }
}

TEST(FusedAdamW, SkipsParametersWithoutGradients) {
  auto p = torch::ones({4}).requires_grad_();
  auto q = torch::ones({4}).requires_grad_();
  FusedAdamW opt({p, q}, torch::optim::AdamWOptions(0.1));
  p.mutable_grad() = torch::ones({4});
  opt.step();
  EXPECT_FALSE(torch::equal(p, torch::ones({4})));
  EXPECT_TRUE(torch::equal(q, torch::ones({4})));
  EXPECT_EQ(opt.state().count(c10::guts::to_string(q.unsafeGetTensorImpl())), 0u);
}

TEST(BlasCore, AvxTwoKernelsOnAnAvx512CpuAreBelowIt) {
  using detail::blas_core_below_cpu;
  EXPECT_TRUE(blas_core_below_cpu("Haswell", true));
  EXPECT_TRUE(blas_core_below_cpu("Zen", true));
  EXPECT_TRUE(blas_core_below_cpu("Prescott", true));
  EXPECT_FALSE(blas_core_below_cpu("SkylakeX", true));
  EXPECT_FALSE(blas_core_below_cpu("Cooperlake", true));
  EXPECT_FALSE(blas_core_below_cpu("SapphireRapids", true));
  EXPECT_FALSE(blas_core_below_cpu("Haswell", false));  // AVX2 is this CPU's best
  EXPECT_FALSE(blas_core_below_cpu("", true));          // not OpenBLAS
}

TEST(BlasCore, KernelsBelowTheCpuAreNamedForARestartUnlessSomeoneChose) {
  using detail::blas_coretype_to_set;
  // Debian's OpenBLAS 0.3.21 on a Xeon with AVX-512 FP16 picks Prescott.
  EXPECT_EQ(blas_coretype_to_set("Prescott", true, true, false), "COOPERLAKE");
  EXPECT_EQ(blas_coretype_to_set("Haswell", true, false, false), "SKYLAKEX");
  EXPECT_EQ(blas_coretype_to_set("Cooperlake", true, true, false), "");
  EXPECT_EQ(blas_coretype_to_set("SkylakeX", true, false, false), "");
  EXPECT_EQ(blas_coretype_to_set("Haswell", false, false, false), "");  // AVX2 is the best
  EXPECT_EQ(blas_coretype_to_set("", true, true, false), "");            // not OpenBLAS
  // OPENBLAS_CORETYPE set (by the user, or by the first run): no second
  // restart; blas_coretype_warning says what it costs.
  EXPECT_EQ(blas_coretype_to_set("Prescott", true, true, true), "");
}

}  // namespace
}  // namespace shardtrain
