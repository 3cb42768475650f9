// make_strategy and the `single` strategy.
#include "shardtrain/strategy/strategy.h"

#include <torch/torch.h>

#include <unordered_set>

#include "shardtrain/comm/communicator.h"
#include "shardtrain/comm/mesh.h"
#include "shardtrain/core/deferred.h"
#include "shardtrain/core/error.h"
#include "strategy/detail.h"
#include "strategy/fsdp.h"

namespace shardtrain::strategy {

void Strategy::setup(torch::nn::Module& model, const comm::DeviceMesh& mesh) { setup(model, mesh.dp()); }

std::vector<int64_t> TensorChunk::shape(const std::vector<int64_t>& global_shape) const {
  std::vector<int64_t> s = global_shape;
  if (whole()) return s;
  s[static_cast<size_t>(dim)] = 0;
  for (const auto& r : ranges) s[static_cast<size_t>(dim)] += r.second;
  return s;
}

std::vector<ElementRun> chunk_runs(const std::vector<int64_t>& global_shape, const TensorChunk& chunk,
                                   int64_t first, int64_t count) {
  std::vector<ElementRun> runs;
  if (count <= 0) return runs;
  if (chunk.whole()) return {{first, 0, count}};
  const size_t d = static_cast<size_t>(chunk.dim);
  int64_t inner = 1;  // elements per index along dim
  for (size_t i = d + 1; i < global_shape.size(); ++i) inner *= global_shape[i];
  const int64_t along = chunk.shape(global_shape)[d];
  const int64_t slab = along * inner;  // the chunk's elements per outer index
  int64_t e = first;
  while (e < first + count) {
    const int64_t outer = e / slab, j = e % slab / inner, i = e % inner;
    // The range holding index j of the chunk along dim.
    int64_t before = 0;
    size_t k = 0;
    while (before + chunk.ranges[k].second <= j) before += chunk.ranges[k++].second;
    const int64_t start = chunk.ranges[k].first + (j - before);
    const int64_t n = std::min(first + count - e, (before + chunk.ranges[k].second - j) * inner - i);
    const int64_t global = (outer * global_shape[d] + start) * inner + i;
    if (!runs.empty() && runs.back().global + runs.back().count == global) {
      runs.back().count += n;
    } else {
      runs.push_back({global, e - first, n});
    }
    e += n;
  }
  return runs;
}

namespace {

// One process trains alone: no communication at all. Any world size works;
// every rank then trains its own copy independently.
class SingleStrategy final : public Strategy {
 public:
  void setup(torch::nn::Module& model, std::shared_ptr<comm::Communicator> comm) override {
    comm_ = std::move(comm);
    model_ = &model;
    materialize(model);  // weights still in their files
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
    return detail::clip_grad_norm(detail::defined_grads(params_), max_norm);
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

std::string StrategyOptions::display_name() const {
  if (strategy_ != StrategyKind::Fsdp) return enum_name(strategy_);
  return std::string("fsdp/") + enum_name(sharding_);
}

std::unique_ptr<Strategy> make_strategy(const StrategyOptions& options) {
  ST_CHECK(options.bucket_cap_mb() > 0, ConfigError, "distributed.bucket_cap_mb must be > 0, got ",
           options.bucket_cap_mb(), "; the default is 25");
  ST_CHECK(options.first_bucket_mb() > 0, ConfigError,
           "distributed.first_bucket_mb must be > 0, got ", options.first_bucket_mb(),
           "; the default is 1");
  ST_CHECK(options.limit_all_gathers() >= 1, ConfigError,
           "distributed.limit_all_gathers must be >= 1, got ", options.limit_all_gathers());
  switch (options.strategy()) {
    case StrategyKind::Single:
      return std::make_unique<SingleStrategy>();
    case StrategyKind::Ddp:
      return std::make_unique<detail::DDPStrategy>(options);
    case StrategyKind::Zero1:
    case StrategyKind::Fsdp:
      return std::make_unique<detail::ShardedStrategy>(options);
    case StrategyKind::Auto:
      break;
  }
  throw ConfigError(
      "strategy 'auto' must be resolved before make_strategy(): pick one with "
      "choose_strategy() (strategy/estimate.h), as the trainer does");
}

}  // namespace shardtrain::strategy
