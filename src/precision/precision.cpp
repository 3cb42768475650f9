// The precision plugins (fp32, bf16-mixed, fp16-mixed, bf16-true), the
// autocast scope and the fused unscale + found-inf pass.
#include "shardtrain/precision/precision.h"

#include <torch/torch.h>

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <sstream>
#include <iterator>
#include <utility>

#include "core/file.h"
#include "precision/detail.h"
#include "shardtrain/comm/communicator.h"
#include "shardtrain/core/deferred.h"
#include "shardtrain/core/error.h"

namespace shardtrain::precision {

// ---- unscale + found-inf ---------------------------------------------------------

namespace {

// Elements per parallel chunk: large enough that thread start-up is noise.
constexpr int64_t kUnscaleGrain = int64_t{1} << 15;

// One pass over a contiguous CPU tensor: checks every element (before
// scaling) and multiplies it by inv_scale in place, in the op-math type
// (float for half/bfloat16), as at::mul_ would. Returns whether an element
// was inf or NaN.
bool unscale_contiguous_cpu(const at::Tensor& g, double inv_scale) {
  std::atomic<bool> found{false};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g.scalar_type(), "unscale_and_find_inf", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    scalar_t* data = g.data_ptr<scalar_t>();
    const opmath_t s = static_cast<opmath_t>(inv_scale);
    at::parallel_for(0, g.numel(), kUnscaleGrain, [&](int64_t begin, int64_t end) {
      bool bad = false;
      for (int64_t i = begin; i < end; ++i) {
        const opmath_t v = static_cast<opmath_t>(data[i]);
        bad |= !std::isfinite(v);
        data[i] = static_cast<scalar_t>(v * s);
      }
      if (bad) found.store(true, std::memory_order_relaxed);
    });
  });
  return found.load();
}

}  // namespace

bool unscale_and_find_inf(const std::vector<at::Tensor>& grads, double inv_scale) {
  bool found = false;
  // Non-finite flags of tensors off the fast path, read once at the end (one
  // device sync, not one per tensor).
  at::Tensor found_other;
  // CUDA gradients go through the fused kernel GradScaler uses, grouped by device.
  std::vector<std::pair<at::Device, std::vector<at::Tensor>>> cuda_groups;
  for (const at::Tensor& g : grads) {
    if (!g.defined()) continue;
    ST_CHECK(at::isFloatingType(g.scalar_type()), InvalidArgument,
             "unscale_and_find_inf: gradients must be floating point, got ", g.scalar_type());
    ST_CHECK(g.layout() == at::kStrided, InvalidArgument,
             "unscale_and_find_inf: sparse gradients are not supported");
    if (g.numel() == 0) continue;
    if (g.device().is_cpu() && g.is_contiguous()) {
      found |= unscale_contiguous_cpu(g, inv_scale);
    } else if (g.device().is_cuda()) {
      auto it = std::find_if(cuda_groups.begin(), cuda_groups.end(),
                             [&](const auto& e) { return e.first == g.device(); });
      if (it == cuda_groups.end()) {
        cuda_groups.emplace_back(g.device(), std::vector<at::Tensor>{});
        it = std::prev(cuda_groups.end());
      }
      it->second.push_back(g);
    } else {
      // Strided CPU views: check before scaling, then scale (two passes).
      at::Tensor bad = at::logical_not(at::isfinite(g).all());
      found_other = found_other.defined() ? at::logical_or(found_other, bad) : bad;
      g.mul_(inv_scale);
    }
  }
  for (auto& [device, tensors] : cuda_groups) {
    auto opts = at::TensorOptions().dtype(at::kFloat).device(device);
    at::Tensor found_inf = at::zeros({1}, opts);
    at::Tensor inv = at::full({1}, inv_scale, opts);
    at::_amp_foreach_non_finite_check_and_unscale_(tensors, found_inf, inv);
    found |= found_inf.item<float>() > 0;
  }
  if (found_other.defined()) found |= found_other.item<bool>();
  return found;
}

// ---- autocast --------------------------------------------------------------------

AutocastScope::AutocastScope(bool enabled, bool cuda, bool bf16) {
  if (!enabled) return;  // leaves the current autocast state alone
  const at::ScalarType dtype = bf16 ? at::kBFloat16 : at::kHalf;
  if (cuda) {
    prev_enabled_ = at::autocast::is_enabled();
    prev_dtype_ = static_cast<int>(at::autocast::get_autocast_gpu_dtype());
    at::autocast::set_enabled(true);
    at::autocast::set_autocast_gpu_dtype(dtype);
  } else {
    ST_CHECK(bf16, InvalidArgument,
             "CPU autocast supports only bfloat16 in LibTorch 1.13; use precision: bf16-mixed");
    prev_enabled_ = at::autocast::is_cpu_enabled();
    prev_dtype_ = static_cast<int>(at::autocast::get_autocast_cpu_dtype());
    at::autocast::set_cpu_enabled(true);
    at::autocast::set_autocast_cpu_dtype(dtype);
  }
  at::autocast::increment_nesting();
  active_ = true;
  cuda_ = cuda;
}

AutocastScope::~AutocastScope() {
  if (!active_) return;
  // As torch.autocast.__exit__: the cast cache lives as long as the
  // outermost scope.
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  const auto dtype = static_cast<at::ScalarType>(prev_dtype_);
  if (cuda_) {
    at::autocast::set_enabled(prev_enabled_);
    at::autocast::set_autocast_gpu_dtype(dtype);
  } else {
    at::autocast::set_cpu_enabled(prev_enabled_);
    at::autocast::set_autocast_cpu_dtype(dtype);
  }
}

// ---- the plugins -----------------------------------------------------------------

namespace {

// fp32, bf16-mixed and bf16-true: no loss scaling, so nothing to agree on
// across ranks and unscale_and_check never communicates.
class UnscaledPrecision : public Precision {
 public:
  UnscaledPrecision(PrecisionKind kind, bool cuda) : kind_(kind), cuda_(cuda) {}

  std::string name() const override { return enum_name(kind_); }

  void prepare_model(torch::nn::Module& model) override {
    if (kind_ != PrecisionKind::Bf16True) return;
    // Not Module::to(kBFloat16): LibTorch's version also casts integer and
    // bool buffers (masks, counters); only floating point tensors change.
    torch::NoGradGuard no_grad;
    for (auto& p : model.parameters(/*recurse=*/true)) {
      if (!p.is_floating_point() || p.scalar_type() == torch::kBFloat16) continue;
      // Weights still in their files stay there, read as bf16.
      p.set_data(is_deferred(p) ? deferred_as(p, torch::kBFloat16) : p.to(torch::kBFloat16));
    }
    for (auto& b : model.buffers(/*recurse=*/true)) {
      if (b.is_floating_point()) b.set_data(b.to(torch::kBFloat16));
    }
  }

  std::unique_ptr<AutocastScope> autocast() const override {
    return std::make_unique<AutocastScope>(kind_ == PrecisionKind::Bf16Mixed, cuda_, /*bf16=*/true);
  }

  at::Tensor scale_loss(const at::Tensor& loss) const override { return loss; }

  bool unscale_and_check(const std::vector<at::Tensor>&, comm::Communicator&) override {
    return false;
  }

  void update(bool skipped) override {
    if (skipped) ++skipped_steps_;
  }
  double loss_scale() const override { return 1.0; }
  int64_t skipped_steps() const override { return skipped_steps_; }
  DynamicLossScaler* scaler() override { return nullptr; }

 private:
  PrecisionKind kind_;  // any but Fp16Mixed
  bool cuda_;
  int64_t skipped_steps_ = 0;
};

// fp16-mixed: CUDA autocast to float16 and dynamic loss scaling. The test
// construction (detail::make_fp16_mixed_for_tests) is this class with
// autocast off; everything else is shared.
class FP16MixedPrecision : public Precision {
 public:
  FP16MixedPrecision(const LossScalerOptions& options, bool autocast)
      : scaler_(options), autocast_(autocast) {}

  std::string name() const override { return enum_name(PrecisionKind::Fp16Mixed); }
  void prepare_model(torch::nn::Module&) override {}

  std::unique_ptr<AutocastScope> autocast() const override {
    return std::make_unique<AutocastScope>(autocast_, /*cuda=*/true, /*bf16=*/false);
  }

  at::Tensor scale_loss(const at::Tensor& loss) const override { return loss * scaler_.scale(); }

  bool unscale_and_check(const std::vector<at::Tensor>& grads, comm::Communicator& comm) override {
    const bool local = unscale_and_find_inf(grads, 1.0 / scaler_.scale());
    // One MAX all-reduce of one flag: every rank skips the same steps, so the
    // scalers stay identical without ever exchanging scales.
    flag_.fill_(local ? 1.0f : 0.0f);
    comm.all_reduce(flag_, comm::AllReduceOptions().op(comm::ReduceOp::Max)).wait();
    return flag_.item<float>() > 0.0f;
  }

  void update(bool skipped) override { scaler_.update(skipped); }
  double loss_scale() const override { return scaler_.scale(); }
  int64_t skipped_steps() const override { return scaler_.state().skipped_steps; }
  DynamicLossScaler* scaler() override { return &scaler_; }

 private:
  DynamicLossScaler scaler_;
  bool autocast_;
  at::Tensor flag_ = at::zeros({1}, at::kFloat);  // allocated once, reused every step
};

}  // namespace

bool cpu_has_native_bf16() {
  static const bool native = [] {
    // /proc/cpuinfo: about 1.5 KB a core; unreadable reads as no native bf16.
    std::string text, why;
    if (!::shardtrain::detail::read_regular_file("/proc/cpuinfo", int64_t{64} << 20, &text, &why)) {
      return false;
    }
    std::istringstream cpuinfo(text);
    std::string line;
    while (std::getline(cpuinfo, line)) {
      if (line.rfind("flags", 0) != 0) continue;
      std::istringstream flags(line.substr(line.find(':') + 1));
      std::string flag;
      while (flags >> flag) {
        if (flag == "avx512_bf16" || flag == "amx_bf16") return true;
      }
      return false;  // every core lists the same flags
    }
    return false;
  }();
  return native;
}

GemmRates measure_gemm_rates() {
  constexpr int64_t kSide = 512;
  constexpr double kFlops = 2.0 * kSide * kSide * kSide;
  struct Operands {
    at::Tensor a, b, c;
    double best = 0.0;
  };
  const auto operands = [](at::ScalarType dtype) {
    Operands o{at::rand({kSide, kSide}).to(dtype), at::rand({kSide, kSide}).to(dtype), {}};
    o.c = at::mm(o.a, o.b);  // warm-up: the kernels' buffers
    return o;
  };
  Operands fp32 = operands(at::kFloat), bf16 = operands(at::kBFloat16);
  // Alternately, so that a busy moment of the machine slows both alike; the
  // best of five each.
  for (int i = 0; i < 5; ++i) {
    for (Operands* o : {&fp32, &bf16}) {
      const auto start = std::chrono::steady_clock::now();
      at::mm_out(o->c, o->a, o->b);
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      o->best = std::max(o->best, kFlops / std::max(seconds, 1e-9) / 1e9);
    }
  }
  return {fp32.best, bf16.best};
}

ResolvedPrecision detail::auto_on_cpu(bool native_bf16, const GemmRates* rates) {
  if (!native_bf16) {
    return {PrecisionKind::Fp32,
            "auto: this CPU has no native bf16 (avx512_bf16/amx_bf16), where bf16 GEMMs run far "
            "slower than fp32"};
  }
  if (rates == nullptr) {
    return {PrecisionKind::Bf16Mixed, "auto: this CPU computes bf16 natively (avx512_bf16/amx_bf16)"};
  }
  const std::string measured =
      ::shardtrain::detail::str_cat(std::lround(rates->bf16_gflops), " against ",
                                    std::lround(rates->fp32_gflops), " GFLOP/s");
  if (rates->bf16_gflops > rates->fp32_gflops) {
    return {PrecisionKind::Bf16Mixed,
            "auto: this CPU computes bf16 natively, and its bf16 GEMMs outrun fp32 ones (" + measured + ")"};
  }
  return {PrecisionKind::Fp32,
          "auto: this CPU computes bf16 natively (avx512_bf16/amx_bf16), but its bf16 GEMMs run "
          "slower than fp32 ones here (" + measured + "); set precision: bf16-mixed to use it anyway"};
}

ResolvedPrecision resolve_precision(PrecisionKind kind, bool cuda_available, const GemmRates* cpu_rates) {
  if (kind != PrecisionKind::Auto) return {kind, ""};
  if (cuda_available) return {PrecisionKind::Bf16Mixed, "auto: a CUDA device"};
  return detail::auto_on_cpu(cpu_has_native_bf16(), cpu_rates);
}

ResolvedPrecision resolve_precision_measured(PrecisionKind kind, bool cuda_available,
                                             comm::Communicator* comm) {
  if (kind != PrecisionKind::Auto || cuda_available || !cpu_has_native_bf16()) {
    return resolve_precision(kind, cuda_available);
  }
  GemmRates rates = measure_gemm_rates();
  if (comm != nullptr) {
    at::Tensor both = at::tensor({rates.fp32_gflops, rates.bf16_gflops}, at::kDouble);
    comm->all_reduce(both, comm::AllReduceOptions().op(comm::ReduceOp::Avg));
    rates = {both[0].item<double>(), both[1].item<double>()};
  }
  return resolve_precision(kind, cuda_available, &rates);
}

std::unique_ptr<Precision> Precision::create(PrecisionKind kind, const LossScalerOptions& scaler,
                                             bool cuda_available) {
  kind = resolve_precision(kind, cuda_available).kind;
  if (kind != PrecisionKind::Fp16Mixed) return std::make_unique<UnscaledPrecision>(kind, cuda_available);
  ST_CHECK(cuda_available, ConfigError,
           "precision 'fp16-mixed' needs a CUDA device: LibTorch cannot compute float16 on CPU "
           "(no CPU fp16 matmul, and CPU autocast supports only bfloat16). Use "
           "`precision: bf16-mixed` instead");
  return std::make_unique<FP16MixedPrecision>(scaler, /*autocast=*/true);
}

std::unique_ptr<Precision> Precision::create(const std::string& name,
                                             const LossScalerOptions& scaler,
                                             bool cuda_available) {
  return create(enum_from_name<PrecisionKind>(name, "precision"), scaler, cuda_available);
}

namespace detail {

std::unique_ptr<Precision> make_fp16_mixed_for_tests(const LossScalerOptions& options) {
  return std::make_unique<FP16MixedPrecision>(options, /*autocast=*/false);
}

}  // namespace detail

}  // namespace shardtrain::precision
