// Activation checkpointing on a custom autograd Function: run without a graph,
// keep the input, recompute with a graph during backward.
#include "shardtrain/models/checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/Generator.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/torch.h>

#include <mutex>
#include <utility>

#include "shardtrain/core/error.h"

namespace shardtrain::models {

namespace detail {

// fn travels to backward in ctx->saved_data, which holds IValues; a capsule
// is the IValue for an arbitrary C++ object.
struct FnHolder : torch::CustomClassHolder {
  explicit FnHolder(CheckpointFn f) : fn(std::move(f)) {}
  CheckpointFn fn;
};

// The autocast state that decides which dtype each op computes in. 1.13 has
// no RAII guard for it, so this is one: apply() installs a state, the
// destructor puts back what it replaced.
struct AutocastState {
  bool cpu_enabled = false;
  at::ScalarType cpu_dtype = at::kBFloat16;
  bool gpu_enabled = false;
  at::ScalarType gpu_dtype = at::kHalf;
  bool cache_enabled = true;

  static AutocastState current() {
    AutocastState s;
    s.cpu_enabled = at::autocast::is_cpu_enabled();
    s.cpu_dtype = at::autocast::get_autocast_cpu_dtype();
    s.gpu_enabled = at::autocast::is_enabled();
    s.gpu_dtype = at::autocast::get_autocast_gpu_dtype();
    s.cache_enabled = at::autocast::is_autocast_cache_enabled();
    return s;
  }
  void apply() const {
    at::autocast::set_cpu_enabled(cpu_enabled);
    at::autocast::set_autocast_cpu_dtype(cpu_dtype);
    at::autocast::set_enabled(gpu_enabled);
    at::autocast::set_autocast_gpu_dtype(gpu_dtype);
    at::autocast::set_autocast_cache_enabled(cache_enabled);
  }
};

class AutocastScope {
 public:
  explicit AutocastScope(const AutocastState& state) : previous_(AutocastState::current()) {
    state.apply();
  }
  ~AutocastScope() { previous_.apply(); }
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  AutocastState previous_;
};

// The autocast cache keeps the low-precision copy of a leaf that requires grad
// for the rest of the autocast region. Filled under the checkpoint's no-grad
// forward, it would hand a graph-less copy to later, non-checkpointed uses in
// the same region, and their gradients would be lost; filled during the
// recomputation, it would outlive the recomputed graph. So the cache is off
// inside a checkpoint (casts are recomputed per use; values are the same).
AutocastState without_cache(AutocastState s) {
  s.cache_enabled = false;
  return s;
}

at::Tensor cpu_rng_state() {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_cpu_rng_state(const at::Tensor& state) {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

// Installs a saved generator state for a scope and puts the previous one
// back afterwards (also when fn throws). An undefined state does nothing.
class RngRestorer {
 public:
  explicit RngRestorer(const at::Tensor& state) {
    if (!state.defined()) return;
    previous_ = cpu_rng_state();
    set_cpu_rng_state(state);
  }
  ~RngRestorer() {
    if (previous_.defined()) set_cpu_rng_state(previous_);
  }
  RngRestorer(const RngRestorer&) = delete;
  RngRestorer& operator=(const RngRestorer&) = delete;

 private:
  at::Tensor previous_;
};

// Keys of ctx->saved_data.
constexpr const char* kFn = "fn";
constexpr const char* kRngState = "rng_state";
constexpr const char* kCpuAutocast = "cpu_autocast";
constexpr const char* kCpuDtype = "cpu_dtype";
constexpr const char* kGpuAutocast = "gpu_autocast";
constexpr const char* kGpuDtype = "gpu_dtype";

// Arguments of apply, in order: the function (not a tensor), the input, every
// parameter, preserve_rng_state (not a tensor). backward returns one gradient
// per argument, undefined where there is none. Saved for backward: the input
// and the parameters (references, not copies; the version check catches an
// optimizer step between forward and backward), the RNG state, the autocast
// state and fn; no activation of fn.
class CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx,
                               const c10::intrusive_ptr<FnHolder>& holder,
                               const torch::Tensor& input, at::TensorList params,
                               bool preserve_rng_state) {
    const auto autocast = AutocastState::current();
    ctx->saved_data[kFn] = at::IValue::make_capsule(holder);
    ctx->saved_data[kCpuAutocast] = autocast.cpu_enabled;
    ctx->saved_data[kCpuDtype] = autocast.cpu_dtype;
    ctx->saved_data[kGpuAutocast] = autocast.gpu_enabled;
    ctx->saved_data[kGpuDtype] = autocast.gpu_dtype;
    if (preserve_rng_state) ctx->saved_data[kRngState] = cpu_rng_state();
    std::vector<torch::Tensor> to_save{input};
    to_save.insert(to_save.end(), params.begin(), params.end());
    ctx->save_for_backward(std::move(to_save));

    // Function::apply already turned grad mode off; the guard says so here.
    torch::NoGradGuard no_grad;
    AutocastScope scope(without_cache(autocast));
    return holder->fn(input);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const auto& saved = ctx->saved_data;
    const auto holder = c10::static_intrusive_pointer_cast<FnHolder>(saved.at(kFn).toCapsule());
    const auto tensors = ctx->get_saved_variables();  // input, then every parameter
    const size_t n_params = tensors.size() - 1;

    // Differentiate only what this backward needs: a frozen parameter or an
    // input without grad has no edge, and a partial backward may skip others.
    // needs_input_grad counts tensor inputs: 0 is the input, 1.. the params.
    const bool input_needs_grad = ctx->needs_input_grad(0);
    auto x = tensors[0].detach();
    x.requires_grad_(input_needs_grad);
    std::vector<torch::Tensor> wrt;
    std::vector<size_t> wrt_slot;  // index into tensors of each entry of wrt
    if (input_needs_grad) {
      wrt.push_back(x);
      wrt_slot.push_back(0);
    }
    for (size_t i = 0; i < n_params; ++i) {
      if (!ctx->needs_input_grad(i + 1)) continue;
      wrt.push_back(tensors[i + 1]);
      wrt_slot.push_back(i + 1);
    }

    // Recompute with a graph, under the forward's autocast state and random
    // numbers; the caller's RNG state is restored afterwards.
    torch::Tensor y;
    {
      RngRestorer restore_rng(saved.count(kRngState) ? saved.at(kRngState).toTensor()
                                                     : torch::Tensor());
      torch::AutoGradMode enable_grad(true);
      AutocastState autocast;
      autocast.cpu_enabled = saved.at(kCpuAutocast).toBool();
      autocast.cpu_dtype = saved.at(kCpuDtype).toScalarType();
      autocast.gpu_enabled = saved.at(kGpuAutocast).toBool();
      autocast.gpu_dtype = saved.at(kGpuDtype).toScalarType();
      AutocastScope scope(without_cache(autocast));
      y = holder->fn(x);
    }

    // Slots: fn, input, params..., preserve_rng_state.
    torch::autograd::variable_list grads(n_params + 3);
    if (wrt.empty() || !y.requires_grad()) return grads;
    // Outside the autocast scope: the recomputed graph's backward runs under
    // the outer backward's state, as it would without checkpointing.
    const auto computed = torch::autograd::grad({y}, wrt, {grad_outputs.at(0)},
                                                /*retain_graph=*/false, /*create_graph=*/false,
                                                /*allow_unused=*/true);
    for (size_t k = 0; k < wrt.size(); ++k) grads[wrt_slot[k] + 1] = computed[k];
    return grads;
  }
};

}  // namespace detail

torch::Tensor checkpoint(const CheckpointFn& fn, const torch::Tensor& input,
                         const std::vector<torch::Tensor>& params,
                         const CheckpointOptions& options) {
  ST_CHECK(static_cast<bool>(fn), InvalidArgument,
           "checkpoint got an empty function; hint: pass the block's forward, e.g. "
           "[block](const torch::Tensor& x) { return block->forward(x); }");
  ST_CHECK(input.defined(), InvalidArgument,
           "checkpoint got an undefined input tensor; hint: pass the block's input activation");
  for (size_t i = 0; i < params.size(); ++i) {
    ST_CHECK(params[i].defined(), InvalidArgument,
             "checkpoint got an undefined parameter at index ", i,
             "; hint: pass module->parameters()");
  }

  // Nothing to differentiate: no graph would be kept anyway.
  bool any_requires_grad = input.requires_grad();
  for (const auto& p : params) any_requires_grad = any_requires_grad || p.requires_grad();
  if (!torch::GradMode::is_enabled() || !any_requires_grad) return fn(input);

  return detail::CheckpointFunction::apply(c10::make_intrusive<detail::FnHolder>(fn), input,
                                           at::TensorList(params), options.preserve_rng_state());
}

CheckpointedImpl::CheckpointedImpl(torch::nn::AnyModule module, CheckpointOptions options)
    : module_(std::move(module)), options_(options) {
  ST_CHECK(!module_.is_empty(), InvalidArgument,
           "Checkpointed got an empty AnyModule; hint: wrap a module, "
           "Checkpointed(torch::nn::AnyModule(MyBlock(...)))");
  register_module("module", module_.ptr());
}

torch::Tensor CheckpointedImpl::forward(const torch::Tensor& x) {
  if (!is_training() || !torch::GradMode::is_enabled()) return module_.forward(x);
  // The copy of module_ inside the closure shares the module, keeping it alive
  // until backward.
  auto module = module_;
  return checkpoint([module](const torch::Tensor& in) mutable { return module.forward(in); }, x,
                    parameters(), options_);
}

}  // namespace shardtrain::models
