// Units: the submodules a sharded strategy gathers and frees as a whole.
//
// The LibTorch C++ frontend has no forward hooks, so a model tells the
// strategy where a unit's forward begins and ends by calling it through
// unit_forward():
//
//   x = shardtrain::strategy::unit_forward(block, [&] { return block->forward(x); });
//
// Without a sharded strategy (or for a module that is not a unit) this is
// just the call. Under fsdp, the unit's parameters are gathered before the
// call, may be freed after it, and are gathered again before the backward
// through the returned tensor. Put activation checkpointing inside the
// lambda, not around unit_forward, so the recomputation finds the
// parameters gathered. Under fsdp, a unit chosen by the wrap policy whose
// forward is not called this way is an error after the first step that
// names it. The built-in GPT calls every block, attention and MLP this way.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <utility>

namespace torch::nn {
class Module;
}

namespace shardtrain::strategy {

/// What a sharded strategy does around the forward of one of its units.
class UnitHooks {
 public:
  virtual ~UnitHooks() = default;
  /// Before the unit's forward: afterwards its parameters are whole.
  virtual void pre_forward() = 0;
  /// After it, with its output: may free the parameters, and arranges for
  /// them to be gathered again before the backward through `output`.
  /// Returns the tensor the caller should use in place of `output`.
  virtual at::Tensor post_forward(const at::Tensor& output) = 0;
};

/// Attaches `hooks` to `module` (nullptr detaches). Strategies call this;
/// models only call unit_forward.
void attach_unit_hooks(const torch::nn::Module& module, std::shared_ptr<UnitHooks> hooks);

/// The hooks attached to `module`, or null.
std::shared_ptr<UnitHooks> find_unit_hooks(const torch::nn::Module& module);

/// Calls fn() (the unit's forward, returning a tensor) between the hooks a
/// strategy attached to `module`, if any. `module` is a ModuleHolder, a
/// std::shared_ptr to a module, or a module pointer.
template <typename ModulePtr, typename Fn>
at::Tensor unit_forward(const ModulePtr& module, Fn&& fn) {
  const auto hooks = find_unit_hooks(*module);
  if (!hooks) return std::forward<Fn>(fn)();
  hooks->pre_forward();
  return hooks->post_forward(std::forward<Fn>(fn)());
}

}  // namespace shardtrain::strategy
