// Activation checkpointing for the LibTorch C++ frontend, which has none.
//
// checkpoint(fn, x, params) runs fn(x) without recording a graph and keeps
// only x; backward runs fn again with grad enabled and differentiates that
// recomputation. Memory for a stack of checkpointed blocks drops from "every
// activation of every block" to "each block's input", for about one extra
// forward pass of compute.
//
// Gradients are bit-identical to running fn directly (same kernels, same
// inputs, same order), in fp32 and under CPU autocast. One autocast caveat: a
// parameter used both inside and outside a checkpoint in the same autocast
// region matches a plain run with the autocast cache off bit-for-bit, and the
// cache-on run only up to bf16 rounding (see checkpoint()). The parameters are
// inputs of the autograd node, so their gradients are accumulated by the
// outer backward through their usual AccumulateGrad nodes: gradient-
// accumulator post hooks (DDP's bucket hooks) fire once per parameter per
// backward, and callbacks queued from them run at the end of the outer
// backward, as without checkpointing.
//
// Not supported: double backward (create_graph through a checkpoint) and
// torch::autograd::grad calls that ask for the gradient of a tensor created
// inside fn.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <functional>
#include <vector>

#include "shardtrain/core/options.h"

namespace shardtrain::models {

struct CheckpointOptions {
  /// Save the default CPU generator's state before the forward and restore it
  /// around the recomputation, so fn draws the same random numbers both times
  /// (dropout masks match) and backward leaves the global generator as it
  /// found it. Costs one ~5 KB copy of the Mersenne Twister state per call.
  /// CUDA generators are not saved: shardtrain's models run on the CPU.
  ST_ARG(bool, preserve_rng_state) = true;
};

/// The function a checkpoint recomputes: one tensor in, one tensor out.
using CheckpointFn = std::function<torch::Tensor(const torch::Tensor&)>;

/// Returns fn(input), keeping only `input` (and the RNG and autocast state)
/// for backward instead of fn's intermediate activations.
///
/// `params` are the tensors fn reads besides `input` and must differentiate
/// (usually module->parameters()); a parameter fn uses but that is missing
/// here gets no gradient. Frozen parameters (requires_grad false) and an
/// input without grad are fine. fn is copied and called again during
/// backward, so what it captures must still be alive then; fn must be
/// deterministic given the same input, parameters and RNG state, and must not
/// modify its input or parameters in place.
///
/// Autocast: the CPU (and GPU) autocast state active in the forward is
/// re-established for the recomputation, whatever is active when backward
/// runs. The autocast weight cache is bypassed inside the checkpoint (a cast
/// cached under no-grad would carry no gradient to the rest of the region).
///
/// With grad mode off, or when neither input nor any parameter requires grad,
/// this is just fn(input).
torch::Tensor checkpoint(const CheckpointFn& fn, const torch::Tensor& input,
                         const std::vector<torch::Tensor>& params,
                         const CheckpointOptions& options = {});

/// checkpoint() for a module with forward(Tensor) -> Tensor, taking
/// module->parameters() as the parameters. `module` is a ModuleHolder
/// (e.g. torch::nn::Linear) or a std::shared_ptr to a module; it is kept
/// alive until backward.
template <typename ModuleType>
torch::Tensor checkpoint_module(const ModuleType& module, const torch::Tensor& input,
                                const CheckpointOptions& options = {}) {
  return checkpoint([held = module](const torch::Tensor& x) mutable { return held->forward(x); },
                    input, module->parameters(), options);
}

/// Marks any module with forward(Tensor) -> Tensor for checkpointing:
/// Checkpointed(torch::nn::AnyModule(MyBlock(...))). In training mode with
/// grad enabled, forward goes through checkpoint(); otherwise it calls the
/// module directly. The wrapped module is registered as "module", so its
/// parameters are named module.<name>. train()/eval() propagate to it.
class CheckpointedImpl : public torch::nn::Module {
 public:
  explicit CheckpointedImpl(torch::nn::AnyModule module, CheckpointOptions options = {});

  torch::Tensor forward(const torch::Tensor& x);

  /// The wrapped module.
  const torch::nn::AnyModule& module() const { return module_; }

 private:
  torch::nn::AnyModule module_;
  CheckpointOptions options_;
};
TORCH_MODULE(Checkpointed);

}  // namespace shardtrain::models
