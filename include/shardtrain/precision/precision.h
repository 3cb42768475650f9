// Precision plugins: how forward and backward run (fp32, bf16 autocast, fp16
// autocast with dynamic loss scaling, or everything in bf16), chosen by name
// at setup. The trainer drives one like this:
//
//   precision->prepare_model(model);               // once (bf16-true casts)
//   per micro-step:
//     { auto scope = precision->autocast();  loss = forward(batch); }
//     precision->scale_loss(loss).backward();
//   strategy->finish_gradient_sync();
//   bool skip = precision->unscale_and_check(grads, comm);   // agreed by all ranks
//   if (!skip) { clip; optimizer step; }
//   precision->update(skip);
//
// Which ops run in which dtype:
//   fp32        everything in float32.
//   bf16-mixed  LibTorch CPU autocast (bfloat16): matmul, linear, addmm, bmm,
//               conv run in bfloat16; layer_norm, softmax, cross_entropy,
//               log_softmax, sums and everything autocast does not list stay
//               float32. Parameters, gradients and optimizer state stay
//               float32 (the master weights). The built-in models' fused
//               causal attention computes in float32 on the CPU whatever
//               its inputs (docs/performance.md).
//   fp16-mixed  the same with float16 and CUDA autocast, plus a dynamic loss
//               scaler. LibTorch 1.13 cannot compute fp16 on CPU, so on a
//               machine without CUDA it is a ConfigError.
//   bf16-true   parameters, gradients, activations and optimizer state all in
//               bfloat16; no master weights.
//   auto        bf16-mixed where bf16 is native and fast (a CUDA device, or a
//               CPU with avx512_bf16 or amx_bf16 whose bf16 GEMMs, measured,
//               outrun its fp32 ones), else fp32: resolve_precision() decides
//               once, before anything is built.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "shardtrain/core/enum_names.h"
#include "shardtrain/core/options.h"

namespace at {
class Tensor;
}
namespace torch::nn {
class Module;
}
namespace shardtrain::comm {
class Communicator;
}

namespace shardtrain::precision {

/// How forward and backward compute (the table at the top of this file).
enum class PrecisionKind { Fp32, Bf16Mixed, Fp16Mixed, Bf16True, Auto };
ST_ENUM_NAMES(PrecisionKind, {PrecisionKind::Fp32, "fp32"}, {PrecisionKind::Bf16Mixed, "bf16-mixed"},
              {PrecisionKind::Fp16Mixed, "fp16-mixed"}, {PrecisionKind::Bf16True, "bf16-true"},
              {PrecisionKind::Auto, "auto"});

/// Whether this CPU computes bf16 natively (avx512_bf16 or amx_bf16 in
/// /proc/cpuinfo). Without it LibTorch emulates bf16 GEMMs, about 20x slower
/// than fp32 ones.
bool cpu_has_native_bf16();

/// A precision as it will run, and why: `auto` becomes bf16-mixed or fp32;
/// any other kind stays as given, with an empty reason.
struct ResolvedPrecision {
  PrecisionKind kind = PrecisionKind::Fp32;
  std::string reason;  // for `auto`: what decided, e.g. "auto: a CUDA device"
};
/// This CPU's GEMM rates in GFLOP/s, fp32 and bf16, on the calling thread's
/// settings (intra-op and BLAS threads): the best of five 512-square
/// at::mm calls each, some milliseconds in all.
struct GemmRates {
  double fp32_gflops = 0.0;
  double bf16_gflops = 0.0;
};
GemmRates measure_gemm_rates();

/// With `cpu_rates` (what measure_gemm_rates() found, agreed by every rank),
/// `auto` on a CPU with native bf16 takes bf16-mixed only when bf16 GEMMs
/// run faster than fp32 ones there: native bf16 does not make them fast
/// everywhere (some Xeons run OpenBLAS's bf16 kernels at half their fp32
/// rate). Without it the CPU flags alone decide.
ResolvedPrecision resolve_precision(PrecisionKind kind, bool cuda_available,
                                    const GemmRates* cpu_rates = nullptr);

/// resolve_precision as a run decides it: where `auto` meets a CPU with
/// native bf16, measure_gemm_rates() runs here and, with `comm`, on every
/// rank, whose figures are averaged so that all ranks decide alike (a
/// collective then: every rank of `comm` calls it). Elsewhere nothing is
/// measured.
ResolvedPrecision resolve_precision_measured(PrecisionKind kind, bool cuda_available,
                                             comm::Communicator* comm = nullptr);

/// Dynamic loss scaling, with DeepSpeed's semantics and defaults. This struct
/// is also the `loss_scaler` section of the YAML config (docs/config.md).
struct LossScalerOptions {
  /// The first scale is 2^initial_scale_power.
  ST_ARG(int, initial_scale_power) = 16;
  /// The scale doubles after this many consecutive steps without overflow.
  ST_ARG(int64_t, loss_scale_window) = 1000;
  /// Overflows tolerated before the scale backs off; refilled by a clean step.
  ST_ARG(int, hysteresis) = 2;
  ST_ARG(double, min_loss_scale) = 1.0;
  /// Consecutive skipped steps at the minimum scale before training fails
  /// with an Error (0: never). Every such skip warns.
  ST_ARG(int64_t, max_skips_at_min) = 50;
};

/// The scaler's state, part of the training state (checkpoints).
struct LossScalerState {
  double scale = 65536.0;
  int64_t iteration = 0;
  int64_t last_overflow_iteration = -1;
  int hysteresis_left = 2;
  int64_t skips_at_min = 0;
  int64_t skipped_steps = 0;
};

/// The state machine of dynamic loss scaling; no tensors, no communication.
///   overflow: the step is skipped. If hysteresis_left > 1 it is decremented
///             and the scale kept; otherwise the scale halves (not below
///             min_loss_scale).
///   clean:    hysteresis_left is refilled; when loss_scale_window steps have
///             passed since the last overflow (or the start), the scale doubles.
class DynamicLossScaler {
 public:
  explicit DynamicLossScaler(const LossScalerOptions& options = {});
  double scale() const { return state_.scale; }
  /// Records one optimizer step's outcome. Warns (stderr) when a step is
  /// skipped at the minimum scale; throws shardtrain::Error once
  /// max_skips_at_min such skips happened in a row.
  void update(bool found_inf);
  const LossScalerState& state() const { return state_; }
  void load_state(const LossScalerState& state) { state_ = state; }

 private:
  LossScalerOptions options_;
  LossScalerState state_;
};

/// Multiplies every defined gradient by inv_scale in place and reports
/// whether any element of any gradient is inf or NaN (before scaling): one
/// pass per tensor, one flag for all. Works for float32, bfloat16 and float16.
bool unscale_and_find_inf(const std::vector<at::Tensor>& grads, double inv_scale);

/// Restores the autocast state it found when destroyed.
class AutocastScope {
 public:
  AutocastScope(bool enabled, bool cuda, bool bf16);
  ~AutocastScope();
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  bool active_ = false;
  bool cuda_ = false;
  bool prev_enabled_ = false;
  int prev_dtype_ = 0;
};

class Precision {
 public:
  virtual ~Precision() = default;

  /// The plugin for `kind` (`auto` resolved by resolve_precision). ConfigError
  /// for fp16-mixed when `cuda_available` is false (with a hint to use
  /// bf16-mixed).
  static std::unique_ptr<Precision> create(PrecisionKind kind, const LossScalerOptions& scaler = {},
                                           bool cuda_available = false);
  /// The same by name ("fp32", "bf16-mixed", "fp16-mixed", "bf16-true" or
  /// "auto"); ConfigError naming them for any other name.
  static std::unique_ptr<Precision> create(const std::string& name,
                                           const LossScalerOptions& scaler = {},
                                           bool cuda_available = false);

  virtual std::string name() const = 0;
  /// Called once before the strategy's setup: bf16-true casts parameters
  /// and buffers to bfloat16; the others leave the model alone.
  virtual void prepare_model(torch::nn::Module& model) = 0;
  /// Autocast for one forward (and the loss computed inside it).
  virtual std::unique_ptr<AutocastScope> autocast() const = 0;
  /// The loss to call backward() on: loss x scale for fp16-mixed, else loss.
  virtual at::Tensor scale_loss(const at::Tensor& loss) const = 0;
  /// After gradients are final: unscales them and returns whether this step
  /// must be skipped because some rank found inf/NaN. Agreed across ranks
  /// with one MAX all-reduce, so every rank skips the same step.
  virtual bool unscale_and_check(const std::vector<at::Tensor>& grads,
                                 comm::Communicator& comm) = 0;
  /// Records the step's outcome (the loss scaler's state machine).
  virtual void update(bool skipped) = 0;
  /// The current loss scale; 1 when there is no scaler.
  virtual double loss_scale() const = 0;
  /// Steps skipped so far.
  virtual int64_t skipped_steps() const = 0;
  /// The loss scaler, or null when this precision has none.
  virtual DynamicLossScaler* scaler() = 0;
};

}  // namespace shardtrain::precision
