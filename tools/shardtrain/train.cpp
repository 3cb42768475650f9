// `shardtrain train [CONFIG] [--set k=v ...] [--nproc-per-node N]`: one
// training run. Outside any launcher, with more than one rank asked for, it
// starts its own ranks through the launcher and waits for them.
#include <torch/torch.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "commands.h"
#include "shardtrain/checkpoint/checkpoint.h"
#include "shardtrain/comm/communicator.h"
#include "shardtrain/config/config.h"
#include "shardtrain/core/error.h"
#include "shardtrain/data/tokens.h"
#include "shardtrain/dist/env.h"
#include "shardtrain/dist/launcher.h"
#include "shardtrain/models/gpt.h"
#include "shardtrain/train/task.h"
#include "shardtrain/train/trainer.h"

namespace shardtrain::cli {
namespace {

const char kUsage[] =
    "usage: shardtrain train [CONFIG] [--set KEY=VALUE ...] [--nproc-per-node N]\n"
    "\n"
    "Trains the model CONFIG describes (default: configs/default.yaml). KEY is a\n"
    "dotted config key (optimizer.lr, batch.micro, ...; see docs/config.md).\n"
    "Without a surrounding launcher and with N > 1 (default: distributed.nproc_per_node,\n"
    "auto = this machine's cores), it starts N ranks through `shardtrain launch`.\n";

struct TrainArgs {
  std::string config = "configs/default.yaml";
  std::vector<std::string> overrides;
  int nproc = -1;  // -1: from the config
};

TrainArgs parse(int argc, char** argv) {
  TrainArgs a;
  bool have_config = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const auto value = [&](const std::string& flag) -> std::string {
      const auto eq = arg.find('=');
      if (arg.rfind(flag + "=", 0) == 0) return arg.substr(eq + 1);
      ST_CHECK(i + 1 < argc, ConfigError, flag, " needs a value; see shardtrain train --help");
      return argv[++i];
    };
    if (arg == "--set" || arg.rfind("--set=", 0) == 0) {
      a.overrides.push_back(value("--set"));
    } else if (arg == "--nproc-per-node" || arg.rfind("--nproc-per-node=", 0) == 0) {
      const std::string v = value("--nproc-per-node");
      a.nproc = v == "auto" ? 0 : std::atoi(v.c_str());
      ST_CHECK(v == "auto" || a.nproc > 0, ConfigError, "--nproc-per-node '", v,
               "' is not a positive number or auto");
    } else if (!arg.empty() && arg[0] != '-' && !have_config) {
      a.config = arg;
      have_config = true;
    } else {
      ST_CHECK(false, ConfigError, "unexpected argument '", arg, "'; see shardtrain train --help");
    }
  }
  return a;
}

// Starts `nproc` copies of this command under the launcher.
int relaunch(const TrainArgs& args, int nproc) {
  dist::LaunchOptions options;
  options.nproc_per_node(nproc);
  // On SIGTERM/SIGINT the ranks finish their step and save a checkpoint
  // before exiting; give them time before the launcher's SIGKILL.
  options.stop_grace_s(300.0);
  char self[4096] = {0};
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  ST_CHECK(n > 0, Error, "cannot find this program's path to start its ranks");
  options.command({std::string(self, static_cast<size_t>(n)), "train", args.config});
  for (const auto& o : args.overrides) {
    options.command().push_back("--set");
    options.command().push_back(o);
  }
  std::printf("starting %d ranks: shardtrain launch --nproc-per-node %d -- shardtrain train %s\n",
              nproc, nproc, args.config.c_str());
  std::fflush(stdout);
  return dist::launch(options);
}

}  // namespace

std::string sample_text(models::GPTImpl& model, const std::string& prompt, int64_t max_new_tokens,
                        uint64_t seed, double temperature, int64_t top_k) {
  const std::vector<int64_t> ids = data::ByteTokenizer::encode(prompt.empty() ? "\n" : prompt);
  const auto idx = torch::tensor(ids, torch::kLong).view({1, -1});
  const auto out = model.generate(idx, max_new_tokens, temperature, top_k, seed);
  const auto* p = out.data_ptr<int64_t>();
  return data::ByteTokenizer::decode(std::vector<int64_t>(p, p + out.numel()));
}

int train_main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--help") || !std::strcmp(argv[i], "-h")) {
      std::fputs(kUsage, stdout);
      return 0;
    }
  }
  const TrainArgs args = parse(argc, argv);
  const config::Config config = config::Config::load(args.config, args.overrides);
  const dist::ClusterEnv env = dist::ClusterEnv::detect();
  if (env.source == dist::EnvSource::Standalone) {
    int nproc = args.nproc >= 0 ? args.nproc : static_cast<int>(config.distributed.nproc_per_node());
    if (nproc == 0) nproc = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    if (config.distributed.strategy() == strategy::StrategyKind::Single) nproc = 1;
    if (nproc > 1) return relaunch(args, nproc);
  }

  auto comm = comm::Communicator::create(comm::CommOptions::from_env());
  ST_CHECK(config.distributed.strategy() != strategy::StrategyKind::Single || comm->size() == 1, ConfigError,
           "distributed.strategy 'single' runs one process, but WORLD_SIZE is ", comm->size(),
           "; use ddp or start one rank");
  train::Trainer trainer(config, train::make_task(config, comm->size()), comm);
  if (comm->rank() == 0) {
    const auto plan = trainer.batch();
    std::printf("%s | %d rank(s) x %d thread(s) | strategy %s | batch %lld = %lld micro x %lld accumulate x %d ranks\n",
                env.describe().c_str(), comm->size(), at::get_num_threads(),
                enum_name(config.distributed.strategy()), (long long)plan.global, (long long)plan.micro,
                (long long)plan.accumulate, comm->size());
    if (comm->size() > 1) std::printf("network: %s\n", comm->endpoint().c_str());
    std::fflush(stdout);
  }
  const train::TrainerState& state = trainer.fit();
  if (state.signal != 0) {
    if (comm->rank() == 0) {
      std::printf("stopped by signal %d after step %lld; resume with --set checkpoint.resume=auto "
                  "(checkpoints in %s/checkpoints)\n",
                  state.signal, (long long)state.step, state.run_dir.c_str());
    }
    comm->barrier();
    return 128 + state.signal;
  }

  if (comm->rank() == 0) {
    // From the exported model: under a sharded strategy no rank holds the
    // whole model, and sampling on rank 0 alone must not communicate.
    if (config.model.type == train::ModelType::Gpt && config.trainer.sample_tokens > 0) {
      auto gpt = load_gpt(checkpoint::exported_model_path(state.run_dir));
      std::printf("sample:\n%s\n", sample_text(*gpt, "\n", config.trainer.sample_tokens,
                                                config.run.seed).c_str());
    }
    std::printf("run directory: %s (metrics.jsonl, checkpoints/, model.safetensors, config.yaml)\n",
                state.run_dir.c_str());
  }
  comm->barrier();
  return 0;
}

}  // namespace shardtrain::cli
