// make_strategy, the shared gradient clipping, and the `single` strategy.
#include "shardtrain/strategy/strategy.h"

#include <torch/torch.h>

#include <unordered_set>

#include "shardtrain/comm/communicator.h"
#include "shardtrain/core/error.h"
#include "strategy/detail.h"
#include "strategy/fsdp.h"

namespace shardtrain::strategy {

namespace detail {

double clip_local_grad_norm(const std::vector<at::Tensor>& params, double max_norm) {
  at::NoGradGuard no_grad;
  // Each gradient's norm in its own dtype (as torch does), summed in double
  // so that many parameters do not lose the small ones.
  double sum_sq = 0.0;
  bool any = false;
  for (const auto& p : params) {
    const auto& g = p.grad();
    if (!g.defined()) continue;
    any = true;
    const double n = g.norm(2).item<double>();
    sum_sq += n * n;
  }
  if (!any) return 0.0;
  const double total = std::sqrt(sum_sq);
  if (max_norm > 0.0) {
    const double coef = max_norm / (total + 1e-6);
    if (coef < 1.0) {
      for (const auto& p : params) {
        auto& g = p.mutable_grad();
        if (g.defined()) g.mul_(coef);
      }
    }
  }
  return total;
}

std::vector<ShardedTensor> whole_model_state(torch::nn::Module& model, int rank) {
  std::vector<ShardedTensor> out;
  std::unordered_set<const void*> seen;
  const auto add = [&](const std::string& name, const at::Tensor& t, bool is_parameter) {
    if (!t.defined() || !seen.insert(t.unsafeGetTensorImpl()).second) return;
    ShardedTensor s;
    s.name = name;
    s.global_shape = t.sizes().vec();
    s.local = t;
    s.primary = rank == 0;
    s.is_parameter = is_parameter;
    out.push_back(std::move(s));
  };
  for (const auto& p : model.named_parameters(true)) add(p.key(), p.value(), true);
  for (const auto& b : model.named_buffers(true)) add(b.key(), b.value(), false);
  return out;
}

std::vector<ShardedTensor> whole_optimizer_parameters(torch::nn::Module& model, int rank) {
  std::vector<ShardedTensor> out;
  auto named = trainable_parameters(model);
  for (size_t i = 0; i < named.tensors.size(); ++i) {
    ShardedTensor s;
    s.name = named.names[i];
    s.global_shape = named.tensors[i].sizes().vec();
    s.local = named.tensors[i];
    s.primary = rank == 0;  // every rank holds the same: rank 0 writes it
    out.push_back(std::move(s));
  }
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> whole_state_dict(torch::nn::Module& model,
                                                                 int rank) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  if (rank != 0) return out;
  for (const auto& p : model.named_parameters(true)) out.emplace_back(p.key(), p.value());
  for (const auto& b : model.named_buffers(true)) {
    if (b.value().defined()) out.emplace_back(b.key(), b.value());
  }
  return out;
}

std::vector<at::Tensor> defined_grads(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> out;
  for (const auto& p : params) {
    if (p.grad().defined()) out.push_back(p.grad());
  }
  return out;
}

}  // namespace detail

namespace {

// One process trains alone: no communication at all. Any world size works;
// every rank then trains its own copy independently.
class SingleStrategy final : public Strategy {
 public:
  void setup(torch::nn::Module& model, std::shared_ptr<comm::Communicator> comm) override {
    comm_ = std::move(comm);
    model_ = &model;
    params_.clear();
    for (auto& p : model.parameters()) {
      if (p.requires_grad()) params_.push_back(p);
    }
    setup_done_ = true;
  }

  void set_gradient_sync(bool) override {}
  void finish_gradient_sync() override {}

  double clip_grad_norm(double max_norm) override {
    ST_CHECK(setup_done_, InvalidArgument,
             "clip_grad_norm called before setup(); call strategy->setup(model, comm) first");
    return detail::clip_local_grad_norm(params_, max_norm);
  }

  void optimizer_step(torch::optim::Optimizer& optimizer) override { optimizer.step(); }
  std::vector<ShardedTensor> optimizer_parameters() override {
    check_setup("optimizer_parameters");
    return detail::whole_optimizer_parameters(*model_, comm_ ? comm_->rank() : 0);
  }
  std::vector<at::Tensor> gradients() override { return detail::defined_grads(params_); }
  std::vector<ShardedTensor> sharded_state_dict() override {
    check_setup("sharded_state_dict");
    return detail::whole_model_state(*model_, comm_ ? comm_->rank() : 0);
  }
  std::vector<std::pair<std::string, at::Tensor>> full_state_dict() override {
    check_setup("full_state_dict");
    return detail::whole_state_dict(*model_, comm_ ? comm_->rank() : 0);
  }
  void reload_parameters() override {}
  std::string name() const override { return "single"; }
  int64_t gradient_collectives() const override { return 0; }

 private:
  void check_setup(const char* what) const {
    ST_CHECK(setup_done_, InvalidArgument, what,
             " called before setup(); call strategy->setup(model, comm) first");
  }

  std::shared_ptr<comm::Communicator> comm_;
  torch::nn::Module* model_ = nullptr;
  std::vector<at::Tensor> params_;
  bool setup_done_ = false;
};

}  // namespace

std::unique_ptr<Strategy> make_strategy(const StrategyOptions& options) {
  ST_CHECK(options.bucket_cap_bytes > 0, ConfigError, "strategy bucket_cap_bytes must be > 0, got ",
           options.bucket_cap_bytes, "; the default is 25 MiB");
  ST_CHECK(options.first_bucket_bytes > 0, ConfigError,
           "strategy first_bucket_bytes must be > 0, got ", options.first_bucket_bytes,
           "; the default is 1 MiB");
  if (options.name == "single") return std::make_unique<SingleStrategy>();
  if (options.name == "ddp") return std::make_unique<detail::DDPStrategy>(options);
  if (options.name == "zero1" || options.name == "fsdp") {
    return std::make_unique<detail::ShardedStrategy>(options);
  }
  throw ConfigError(::shardtrain::detail::str_cat(
      "unknown strategy '", options.name, "'; expected one of: single, ddp, zero1, fsdp"));
}

}  // namespace shardtrain::strategy
