// AdamW whose step makes one pass over each float32 parameter (see
// adamw_kernel.h) instead of LibTorch's eight tensor ops. It is a
// torch::optim::AdamW: the same options, parameter groups and per-parameter
// state (so checkpoints and the learning-rate schedule treat it alike), and
// the same results, bit for bit. Parameters it cannot take (other dtypes,
// non-contiguous, amsgrad) go through the tensor-op step.
#pragma once

#include <torch/optim/adamw.h>

namespace shardtrain::train::detail {

class FusedAdamW : public torch::optim::AdamW {
 public:
  using torch::optim::AdamW::AdamW;
  torch::Tensor step(LossClosure closure = nullptr) override;
};

}  // namespace shardtrain::train::detail
