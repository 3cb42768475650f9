// A hand-written training loop that uses a shardtrain strategy directly, with
// no Trainer: DDP with gradient accumulation, clipping and AdamW.
//   shardtrain launch --nproc-per-node 2 -- ./manual_loop [steps]
#include <shardtrain/comm/communicator.h>
#include <shardtrain/core/error.h>
#include <shardtrain/strategy/strategy.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>

static int run(int argc, char** argv) {
  const int64_t steps = argc > 1 ? std::atoll(argv[1]) : 50;
  auto comm = shardtrain::comm::Communicator::create(shardtrain::comm::CommOptions::from_env());
  const int rank = comm->rank(), world = comm->size();

  torch::manual_seed(0);
  torch::nn::Sequential model(torch::nn::Linear(8, 32), torch::nn::GELU(), torch::nn::Linear(32, 1));

  auto strategy = shardtrain::strategy::make_strategy(
      shardtrain::strategy::StrategyOptions().strategy(shardtrain::strategy::StrategyKind::Ddp));
  strategy->setup(*model.ptr(), comm);  // broadcasts rank 0's weights, plans buckets
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-2));

  // Regress y = sum(x): each optimizer step sees a global batch of 64 rows,
  // as `accumulate` micro-batches per rank.
  const int64_t global = 64, accumulate = 2, micro = global / (accumulate * world);
  double loss_value = 0;
  for (int64_t step = 0; step < steps; ++step) {
    auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(step));
    auto x = torch::randn({global, 8}, c10::optional<at::Generator>(gen));
    auto y = x.sum(1, /*keepdim=*/true);
    loss_value = 0;
    for (int64_t j = 0; j < accumulate; ++j) {
      strategy->set_gradient_sync(j == accumulate - 1);  // communicate once per step
      const int64_t first = (j * world + rank) * micro;
      auto loss = torch::mse_loss(model->forward(x.narrow(0, first, micro)), y.narrow(0, first, micro));
      (loss / accumulate).backward();
      loss_value += loss.item<double>() / accumulate;
    }
    strategy->finish_gradient_sync();  // gradients are averaged over ranks now
    strategy->clip_grad_norm(1.0);
    strategy->optimizer_step(optimizer);
    optimizer.zero_grad();
    if (rank == 0 && (step + 1) % 10 == 0) {
      std::printf("step %lld loss %.4f\n", static_cast<long long>(step + 1), loss_value);
    }
  }
  if (rank == 0) std::printf("collectives: %lld\n", static_cast<long long>(strategy->gradient_collectives()));
  return loss_value < 0.5 ? 0 : 1;
}

// What the library throws is a typed error with a one-line message: say it
// and exit, 2 for bad input (the launcher does not restart it), not abort.
int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const shardtrain::Error& e) {
    std::fprintf(stderr, "manual_loop: %s\n", e.what());
    return dynamic_cast<const shardtrain::ConfigError*>(&e) != nullptr ? 2 : 1;
  }
}
