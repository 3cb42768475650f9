// How gradients (and later parameters and optimizer state) are shared
// between ranks. The trainer, or a hand-written loop, drives a Strategy:
//
//   strategy->setup(model, comm);                 // once, on every rank
//   for each optimizer step:
//     for each micro-step j of k:
//       strategy->set_gradient_sync(j == k - 1);  // communicate on the last only
//       loss.backward();                          // reductions start from hooks
//     strategy->finish_gradient_sync();           // gradients are final here
//     norm = strategy->clip_grad_norm(max_norm);
//     strategy->optimizer_step(optimizer);
//     optimizer.zero_grad();
#pragma once

#include <cstdint>
#include <memory>
#include <string>

namespace torch {
namespace nn {
class Module;
}
namespace optim {
class Optimizer;
}
}  // namespace torch

namespace shardtrain::comm {
class Communicator;
}

namespace shardtrain::strategy {

struct StrategyOptions {
  /// "single" or "ddp".
  std::string name = "ddp";
  /// Largest gradient bucket, and the first (smaller, so the first
  /// reduction starts early in backward), in bytes.
  int64_t bucket_cap_bytes = int64_t{25} << 20;
  int64_t first_bucket_bytes = int64_t{1} << 20;
  /// true: parameters without a gradient in a step are reduced as zeros;
  /// false: such a parameter is an error that names it.
  bool find_unused_parameters = false;
  /// dtype gradients are reduced in: "fp32" (default), "bf16", "fp16", or
  /// "" for each parameter's own dtype.
  std::string reduce_dtype = "fp32";
};

class Strategy {
 public:
  virtual ~Strategy() = default;

  /// Called once on every rank before training, after the model is built and
  /// before the optimizer sees its parameters. DDP broadcasts parameters and
  /// buffers from rank 0, plans its buckets and installs its autograd hooks.
  virtual void setup(torch::nn::Module& model, std::shared_ptr<comm::Communicator> comm) = 0;

  /// Whether the next backward synchronises gradients. Off on accumulation
  /// micro-steps, on for the last one; on by default.
  virtual void set_gradient_sync(bool enabled) = 0;

  /// After the backward of a synchronising micro-step: blocks until every
  /// gradient is reduced (averaged over ranks) and in place in param.grad().
  virtual void finish_gradient_sync() = 0;

  /// The global L2 norm of all gradients before clipping; scales them so the
  /// norm is at most max_norm when max_norm > 0. Same value on every rank.
  virtual double clip_grad_norm(double max_norm) = 0;

  /// Applies the optimizer (sharded strategies step only their shard).
  virtual void optimizer_step(torch::optim::Optimizer& optimizer) = 0;

  /// "single" or "ddp".
  virtual std::string name() const = 0;

  /// Gradient collectives launched so far; tests count communication with it.
  virtual int64_t gradient_collectives() const = 0;
};

/// Builds the strategy named in `options`; ConfigError for an unknown name.
std::unique_ptr<Strategy> make_strategy(const StrategyOptions& options);

}  // namespace shardtrain::strategy
