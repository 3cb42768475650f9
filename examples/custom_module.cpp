// Training your own torch::nn::Module with shardtrain's Trainer.
//
// The model, its loss and its data are yours; shardtrain brings the loop,
// DDP, accumulation, schedules, callbacks and metrics. Run it on 2 ranks:
//   shardtrain launch --nproc-per-node 2 -- ./custom_module [steps]
#include <shardtrain/comm/communicator.h>
#include <shardtrain/core/error.h>
#include <shardtrain/train/task.h>
#include <shardtrain/train/trainer.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>

// A two-layer classifier with a residual connection: any Module works.
struct ResidualNetImpl : torch::nn::Module {
  ResidualNetImpl(int64_t in, int64_t hidden, int64_t classes)
      : inp(register_module("inp", torch::nn::Linear(in, hidden))),
        mid(register_module("mid", torch::nn::Linear(hidden, hidden))),
        out(register_module("out", torch::nn::Linear(hidden, classes))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::relu(inp(x));
    h = h + torch::relu(mid(h));
    return out(h);
  }
  torch::nn::Linear inp, mid, out;
};
TORCH_MODULE(ResidualNet);

// Samples whose class is the index of their largest feature: learnable, and
// generated from (step) alone so every rank agrees on the global batch.
shardtrain::data::Batch global_batch(int64_t step, int64_t rows) {
  auto gen = at::detail::createCPUGenerator(1000 + static_cast<uint64_t>(step));
  auto x = torch::randn({rows, 16}, c10::optional<at::Generator>(gen));
  return {x, x.narrow(1, 0, 4).argmax(1)};
}

static int run(int argc, char** argv) {
  const int64_t steps = argc > 1 ? std::atoll(argv[1]) : 200;
  auto comm = shardtrain::comm::Communicator::create(shardtrain::comm::CommOptions::from_env());

  shardtrain::config::Config config;  // defaults, then what this job needs
  config.run.dir = "runs/custom_module";
  config.batch.global = 32;
  config.batch.micro = 8;
  config.optimizer.lr = 1e-2;
  config.schedule.warmup_steps = 5;
  config.trainer.max_steps = steps;
  config.trainer.eval_every = 0;
  config.trainer.log_every = 50;
  config.trainer.progress = shardtrain::train::ProgressMode::Plain;

  torch::manual_seed(0);  // the same initial weights on every rank
  auto model = ResidualNet(16, 64, 4);
  shardtrain::train::TrainTask task;
  task.model = model.ptr();
  // Summed over the batch; the trainer divides by the targets in the whole
  // accumulation window on all ranks.
  task.loss_sum = [model](const shardtrain::data::Batch& b) mutable {
    return torch::nn::functional::cross_entropy(
        model->forward(b.input), b.target,
        torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum));
  };
  task.count_targets = [](const shardtrain::data::Batch& b) { return b.target.size(0); };
  const int64_t global = 32;
  task.train_batch = [global](int64_t step, int64_t j, int64_t micro, int rank, int world) {
    auto whole = global_batch(step, global);
    const int64_t first = (j * world + rank) * micro;
    return shardtrain::data::Batch{whole.input.narrow(0, first, micro),
                                   whole.target.narrow(0, first, micro)};
  };

  shardtrain::train::Trainer trainer(config, task, comm);
  const auto& state = trainer.fit();
  if (comm->rank() == 0) {
    std::printf("final loss %.4f after %lld steps on %d rank(s)\n", state.loss,
                static_cast<long long>(state.step), comm->size());
  }
  // The classes are easy: a trained model must be well below chance (ln 4 = 1.39).
  return state.loss < 0.9 ? 0 : 1;
}

// What the library throws is a typed error with a one-line message: say it
// and exit, 2 for bad input (the launcher does not restart it), not abort.
int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const shardtrain::Error& e) {
    std::fprintf(stderr, "custom_module: %s\n", e.what());
    return dynamic_cast<const shardtrain::ConfigError*>(&e) != nullptr ? 2 : 1;
  }
}
