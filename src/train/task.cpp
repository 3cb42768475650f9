// make_task: the built-in models with their data, as a TrainTask.
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>

#include "models/tensor_parallel.h"
#include "shardtrain/core/error.h"
#include "shardtrain/data/lm_data.h"
#include "shardtrain/launch/env.h"
#include "shardtrain/models/causal_lm.h"
#include "shardtrain/models/family.h"
#include "shardtrain/models/gpt.h"
#include "shardtrain/models/mlp.h"
#include "shardtrain/train/plan.h"
#include "shardtrain/train/task.h"

namespace shardtrain::train {

int64_t count_non_ignored(const data::Batch& batch) {
  return batch.target.ne(kIgnoreIndex).sum().item<int64_t>();
}

models::GPTConfig gpt_config(const config::ModelConfig& m) { return models::GPTConfig::from(m); }

namespace {

int64_t count_parameters(torch::nn::Module& model) {
  int64_t n = 0;
  for (const auto& p : model.parameters()) n += p.numel();
  return n;
}


// A language model of any family on the config's data (data::make_lm_data:
// token windows or samples, packed rows honoured through Batch::segment).
TrainTask lm_task(const config::Config& config, std::shared_ptr<models::CausalLMImpl> model,
                  const config::BatchPlan& plan, int world_size) {
  const int64_t vocab_size = config.model.vocab_size;
  const int64_t block_size = config.model.block_size;
  const data::LmData data = data::make_lm_data(
      config.data, *data::load_tokenizer(config.data.tokenizer, model_dir(config)),
      block_size, plan.global, plan.micro * world_size, config.run.seed, model_dir(config));
  ST_CHECK(data.stats.max_token < vocab_size, ConfigError, "data.train '", config.data.train,
           "' holds token id ", data.stats.max_token, " but model.vocab_size is ", vocab_size,
           "; raise model.vocab_size");
  const bool samples = data.stats.format == "jsonl";
  if (samples && dist::ClusterEnv::detect().rank == 0) {
    std::fprintf(stderr, "%s\n", data.stats.summary().c_str());
  }
  TrainTask task;
  task.model = model;
  task.tokens_per_sample = block_size;
  // Under tensor parallelism with a vocabulary-parallel loss the logits
  // are this rank's columns; lm_cross_entropy_sum knows from the model.
  task.logits_loss_sum = [model](const at::Tensor& logits, const data::Batch& b) {
    return models::detail::lm_cross_entropy_sum(*model, logits, b.target, kIgnoreIndex);
  };
  task.loss_sum = [model, loss = task.logits_loss_sum](const data::Batch& b) {
    return loss(model->forward(b.input, b.position, b.segment), b);
  };
  task.count_targets = count_non_ignored;
  if (model->has_auxiliary_loss()) {
    task.aux_loss = [model] { return model->auxiliary_loss(); };
    task.aux_loss_weight = model->auxiliary_loss_weight();
  }
  task.train_batch = data.train_batch;
  task.train_rows = data.train_rows;
  task.epoch_of = data.epoch_of;
  task.eval_batch = data.eval_batch;
  task.static_metrics.set("num_parameters", count_parameters(*model));
  if (samples) task.static_metrics.set("packing_efficiency", data.stats.packing_efficiency);
  return task;
}

// An MLP regressing a fixed random linear map: data made from the seed, so
// the MLP path needs no files. Global batch s is generated whole from (seed, s)
// and each rank takes its rows, so the data order obeys the same rule as the
// token sampler.
TrainTask regression_task(const config::Config& config, std::shared_ptr<models::MLPImpl> model,
                          const config::BatchPlan& plan) {
  const auto& sizes = config.model.mlp_sizes;
  const int64_t in = sizes.front();
  const auto gen = at::detail::createCPUGenerator(config.run.seed ^ 0x9e3779b97f4a7c15ULL);
  const auto w_true = at::randn({in, sizes.back()}, c10::optional<at::Generator>(gen)) / std::sqrt(static_cast<double>(in));
  const auto make = [w_true, in](uint64_t seed, int64_t rows) {
    const auto g = at::detail::createCPUGenerator(seed);
    auto x = at::randn({rows, in}, c10::optional<at::Generator>(g));
    auto y = at::matmul(x, w_true) + 0.01 * at::randn({rows, w_true.size(1)}, c10::optional<at::Generator>(g));
    return data::Batch{x, y, {}, {}};
  };
  const uint64_t seed = config.run.seed;
  const int64_t global = plan.global;
  TrainTask task;
  task.model = model;
  task.loss_sum = [model](const data::Batch& b) {
    return torch::mse_loss(model->forward(b.input), b.target, at::Reduction::Sum);
  };
  task.count_targets = [](const data::Batch& b) { return b.target.numel(); };
  task.train_rows = [make, seed, global](int64_t step, int64_t first, int64_t count) {
    const data::Batch whole = make(seed * 1000003ULL + static_cast<uint64_t>(step), global);
    return data::Batch{whole.input.narrow(0, first, count), whole.target.narrow(0, first, count), {}, {}};
  };
  task.train_batch = [rows = task.train_rows](int64_t step, int64_t j, int64_t micro, int rank, int world) {
    return rows(step, (j * world + rank) * micro, micro);
  };
  task.eval_batch = [make, seed](int64_t index, int64_t micro, int rank, int world) {
    const data::Batch whole = make(~seed - static_cast<uint64_t>(index), micro * world);
    return data::Batch{whole.input.narrow(0, rank * micro, micro),
                       whole.target.narrow(0, rank * micro, micro), {}, {}};
  };
  task.static_metrics.set("num_parameters", count_parameters(*model));
  return task;
}

}  // namespace

std::string model_dir(const config::Config& config) {
  const std::string& from = config.model.init_from;
  return !from.empty() && std::filesystem::is_directory(from) ? from : "";
}

TrainTask make_task(const config::Config& config, int world_size) {
  const config::BatchPlan plan = config.resolve_batch(world_size);
  const models::ModelFamily& family = models::family_of(config.model.type);
  family.validate(config.model);
  // Before any allocation: a model that cannot fit is a ConfigError naming
  // the bytes, not a LibTorch allocator failure with a backtrace.
  check_model_fits(config, world_size, dist::ClusterEnv::detect().local_world_size);
  torch::manual_seed(config.run.seed);  // same initial weights on every rank
  // Weights that come from files are deferred as the model is built: the
  // strategy reads them where they are kept (a sharded one, only its
  // shards), so no rank holds the whole model on the way.
  const bool deferred = !config.model.init_from.empty();
  const std::shared_ptr<torch::nn::Module> model = family.build(config.model, deferred);
  if (auto lm = std::dynamic_pointer_cast<models::CausalLMImpl>(model)) {
    return lm_task(config, std::move(lm), plan, world_size);
  }
  auto mlp = std::dynamic_pointer_cast<models::MLPImpl>(model);
  ST_ASSERT(mlp != nullptr, "model family ", enum_name(family.type()), " builds no task's model");
  return regression_task(config, std::move(mlp), plan);
}

}  // namespace shardtrain::train
