// Internals of the strategies, shared by single and ddp and visible to tests
// (tests add src/ to their include path). Not installed, not public API.
#pragma once

#include <torch/torch.h>

#include <atomic>
#include <cstdint>
#include <istream>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "shardtrain/comm/communicator.h"
#include "shardtrain/strategy/strategy.h"

namespace shardtrain::strategy::detail {

/// The global L2 norm of `grads` and clipping as
/// torch::nn::utils::clip_grad_norm_ does: each gradient's norm in its own
/// dtype, squares summed in double (and over `sum_over`'s ranks when given:
/// each rank passes its shards); the gradients are multiplied by
/// max_norm / (norm + 1e-6) only when max_norm > 0 and that is below 1.
double clip_grad_norm(const std::vector<at::Tensor>& grads, double max_norm,
                      comm::Communicator* sum_over = nullptr);
/// The same where the norm's terms and the gradients it scales differ: the
/// squares of `counted` summed over each group of `sum_over` in turn (null
/// or single-rank groups skipped), `scaled` multiplied by the coefficient.
/// Tensor parallelism counts a replicated parameter on one rank of its
/// group but scales every rank's copy.
double clip_grad_norm(const std::vector<at::Tensor>& counted, const std::vector<at::Tensor>& scaled,
                      double max_norm, const std::vector<comm::Communicator*>& sum_over);

/// The dtype `dtype` names, or `own` for DType::Auto.
at::ScalarType scalar_type(DType dtype, at::ScalarType own);

/// default_memory_budget_bytes() from `meminfo`, text in /proc/meminfo's
/// format: its MemAvailable divided by local_world_size, in bytes.
/// ConfigError without a MemAvailable line; InvalidArgument for
/// local_world_size < 1.
double memory_budget_bytes(std::istream& meminfo, int local_world_size);

/// MiB (config units) to bytes.
int64_t mib_to_bytes(double mib);

/// The parameters of `model` that require a gradient, in registration order,
/// each once (tied parameters are listed under their first name).
struct NamedParams {
  std::vector<std::string> names;
  std::vector<at::Tensor> tensors;
};
NamedParams trainable_parameters(torch::nn::Module& model);

/// One gradient bucket: a flat buffer that holds a view per parameter.
struct Bucket {
  at::Tensor flat;                  // contiguous, one dtype
  std::vector<size_t> params;       // indices into the reducer's parameter list
  int64_t bytes = 0;
};

/// The buckets for `tensors` (one dtype per bucket): parameters in reverse
/// order, packed greedily; the first bucket holds at most first_bucket_bytes,
/// the others at most bucket_cap_bytes; a parameter larger than the cap gets
/// a bucket of its own. Returns, per bucket, the parameter indices in it.
/// Pure planning, so unit tests check it without a communicator.
std::vector<std::vector<size_t>> plan_buckets(const std::vector<at::Tensor>& tensors,
                                              int64_t first_bucket_bytes,
                                              int64_t bucket_cap_bytes);

/// The model's parameters (each once) and buffers as whole tensors, for
/// strategies where every rank holds the whole model: primary on rank 0.
std::vector<ShardedTensor> whole_model_state(torch::nn::Module& model, int rank);

/// The trainable parameters as optimizer_parameters() of a whole-model
/// strategy (primary on rank 0).
std::vector<ShardedTensor> whole_optimizer_parameters(torch::nn::Module& model, int rank);

/// full_state_dict() of a whole-model strategy: the tensors themselves on
/// rank 0, nothing elsewhere.
std::vector<std::pair<std::string, at::Tensor>> whole_state_dict(torch::nn::Module& model,
                                                                 int rank);

/// The defined .grad() of `params`.
std::vector<at::Tensor> defined_grads(const std::vector<at::Tensor>& params);

/// Broadcasts `tensors` (named by `names`, for errors) from rank 0 in place:
/// every rank starts from rank 0's parameters and buffers.
void broadcast_from_rank0(comm::Communicator& comm, const std::vector<at::Tensor>& tensors,
                          const std::vector<std::string>& names);

/// The model's parameters (each once) and defined buffers, with names.
void model_tensors(torch::nn::Module& model, std::vector<at::Tensor>& tensors,
                   std::vector<std::string>& names);

class Reducer;
struct HookHandle;

/// Distributed data parallel: every rank holds the whole model, gradients are
/// averaged over ranks in buckets whose all-reduces start from autograd hooks
/// while backward still runs.
///
/// Gradients are COPIED into the bucket views (in the hook) and copied back
/// into param.grad() after the reduction (in finish_gradient_sync), rather
/// than making param.grad() a view of the bucket: a view would be silently
/// lost whenever user code or an optimizer replaces a gradient (zero_grad
/// with set_to_none, assigning grad()), whereas copies keep param.grad() an
/// ordinary tensor the user owns. The cost is one extra memcpy per gradient,
/// cheap next to the all-reduce.
class DDPStrategy final : public Strategy {
 public:
  explicit DDPStrategy(StrategyOptions options);
  ~DDPStrategy() override;

  void setup(torch::nn::Module& model, std::shared_ptr<comm::Communicator> comm) override;
  void set_gradient_sync(bool enabled) override;
  void finish_gradient_sync() override;
  /// After finish_gradient_sync the gradients are identical on every rank,
  /// so the local norm is already the global norm: no communication.
  double clip_grad_norm(double max_norm) override;
  void optimizer_step(torch::optim::Optimizer& optimizer) override;
  std::vector<ShardedTensor> optimizer_parameters() override;
  std::vector<at::Tensor> gradients() override { return defined_grads(params_); }
  std::vector<ShardedTensor> sharded_state_dict() override;
  std::vector<std::pair<std::string, at::Tensor>> full_state_dict() override;
  void reload_parameters() override {}
  std::string name() const override { return "ddp"; }
  int64_t gradient_collectives() const override;
  CommStats comm_stats() const override { return stats_; }

  // ---- for tests and diagnostics ----
  /// Number of buckets planned in setup.
  size_t num_buckets() const;
  /// named_parameters() names of the parameters in bucket `b`, in bucket order.
  std::vector<std::string> bucket_parameter_names(size_t b) const;
  /// Bucket all-reduces launched from an autograd hook, i.e. while backward
  /// was still running (the rest were launched by finish_gradient_sync).
  int64_t buckets_launched_in_backward() const;

 private:
  StrategyOptions options_;
  std::shared_ptr<comm::Communicator> comm_;
  torch::nn::Module* model_ = nullptr;
  std::shared_ptr<Reducer> reducer_;  // hooks hold it weakly
  std::vector<at::Tensor> params_;
  std::vector<HookHandle> hooks_;  // one post-hook per parameter
  CommStats stats_;
  double busy_at_finish_ = 0.0;
  int64_t bytes_at_finish_ = 0;
  comm::Communicator::PathCounts paths_at_finish_;

  void remove_hooks();
};

}  // namespace shardtrain::strategy::detail
