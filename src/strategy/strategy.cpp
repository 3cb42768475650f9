// make_strategy, the shared gradient clipping, and the `single` strategy.
#include "shardtrain/strategy/strategy.h"

#include <torch/torch.h>

#include "shardtrain/comm/communicator.h"
#include "shardtrain/core/error.h"
#include "strategy/detail.h"

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

}  // namespace detail

namespace {

// One process trains alone: no communication at all. Any world size works;
// every rank then trains its own copy independently.
class SingleStrategy final : public Strategy {
 public:
  void setup(torch::nn::Module& model, std::shared_ptr<comm::Communicator> comm) override {
    comm_ = std::move(comm);
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
  std::string name() const override { return "single"; }
  int64_t gradient_collectives() const override { return 0; }

 private:
  std::shared_ptr<comm::Communicator> comm_;
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
  throw ConfigError(::shardtrain::detail::str_cat(
      "unknown strategy '", options.name, "'; expected one of: single, ddp"));
}

}  // namespace shardtrain::strategy
