// The families' linear layers, y = x W^T + b, as one autograd function
// whose backward can add the weight's gradient where it is kept.
//
// Autograd's own path computes each weight gradient into a new tensor, and
// the parameter's accumulator then adds it to .grad() (into the DDP bucket
// the gradient lives in): a temporary as large as the weight and one more
// pass over it, twice per accumulation window. Inside an InPlaceWeightGrads
// scope the backward's GEMM adds into .grad() itself (beta = 1) and hands the
// accumulator nothing; the accumulator's hooks (DDP's bucket hooks) still run.
#pragma once

#include <ATen/core/Tensor.h>

namespace shardtrain::models::detail {

/// y = x W^T + b over the last dimension of x (b may be undefined), as
/// at::linear computes it. On the CPU in fp32 with gradients on, an autograd
/// function of its own (above); elsewhere (autocast, another dtype or
/// device, no gradients) at::linear.
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias = {});

/// While one with `enabled` is alive on this thread, linear()'s backward adds
/// a weight's gradient into the weight's .grad() when the weight is a leaf
/// whose .grad() exists as a contiguous fp32 tensor of its shape, and gives
/// autograd no gradient for it. Only around a backward() that accumulates
/// into .grad(), for parameters whose .grad() is where their gradient belongs
/// until the optimizer step (the trainer, under the single and ddp
/// strategies; a scope with enabled = false turns it off). Activation
/// checkpointing's recompute inside such a backward is no exception: its
/// torch::autograd::grad then finds no gradient for those weights and passes
/// none on, so each weight's gradient is still added once. Elsewhere never
/// around torch::autograd::grad, which returns gradients instead of adding
/// them to .grad().
class InPlaceWeightGrads {
 public:
  explicit InPlaceWeightGrads(bool enabled);
  ~InPlaceWeightGrads();
  InPlaceWeightGrads(const InPlaceWeightGrads&) = delete;
  InPlaceWeightGrads& operator=(const InPlaceWeightGrads&) = delete;

 private:
  bool previous_;
};

}  // namespace shardtrain::models::detail
