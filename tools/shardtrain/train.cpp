// `shardtrain train [CONFIG] [--set k=v ...] [launch options]`: one
// training run. Outside any launcher, with more than one rank asked for, it
// starts its own ranks through the launcher and waits for them.
#include <torch/torch.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "commands.h"
#include "launch_flags.h"
#include "shardtrain/checkpoint/checkpoint.h"
#include "shardtrain/comm/communicator.h"
#include "shardtrain/config/config.h"
#include "shardtrain/core/error.h"
#include "shardtrain/data/tokens.h"
#include "shardtrain/launch/env.h"
#include "shardtrain/core/blas.h"
#include "shardtrain/launch/launcher.h"
#include "shardtrain/models/family.h"
#include "shardtrain/models/gpt.h"
#include "shardtrain/models/hf_dir.h"
#include "shardtrain/train/plan.h"
#include "shardtrain/train/report.h"
#include "shardtrain/train/task.h"
#include "shardtrain/train/trainer.h"
#include "train/run_dir.h"

namespace shardtrain::cli {
namespace {

namespace fs = std::filesystem;

const char kTrainUsage[] =
    "usage: shardtrain train [CONFIG] [--set KEY=VALUE ...] [LAUNCH OPTIONS]\n"
    "\n"
    "Trains the model CONFIG describes; without CONFIG, the built-in defaults (the\n"
    "same as configs/default.yaml). KEY is a dotted config key (optimizer.lr,\n"
    "batch.micro, ...; see docs/config.md). A relative data.train that is not under\n"
    "the current directory is looked for among the project's own files (an installed\n"
    "PREFIX/share/shardtrain, or the checkout above a build directory).\n"
    "Without a surrounding launcher, it starts its ranks through `shardtrain launch`\n"
    "when there is more than one (--nproc-per-node, default distributed.nproc_per_node,\n"
    "auto = this machine's cores), more than one node, or restarts to allow. The\n"
    "launch options mean what they mean to `shardtrain launch` (--stop-grace defaults\n"
    "to 300 here, time for the ranks to save a checkpoint):\n"
    "%s";

struct TrainArgs {
  std::string config;  // "": the built-in defaults
  std::vector<std::string> overrides;
  dist::LaunchOptions launch = dist::LaunchOptions().stop_grace_s(300.0);
  int nproc = -1;             // -1: from the config
  bool launch_flags = false;  // any launcher flag given
};

// The arguments, or nothing when --help was asked.
std::optional<TrainArgs> parse_train_args(int argc, char** argv) {
  TrainArgs a;
  CLI::App app;
  setup_app(app);
  add_list(app, "--set", a.overrides);
  add_launch_flags(app, a.launch, &a.nproc);
  app.add_option("config", a.config);
  if (parse_flags(app, argc, argv, "train", "unexpected argument",
                  "allowed: CONFIG, --set, " + launch_flag_names() +
                      "; see shardtrain train --help")) {
    return std::nullopt;
  }
  for (const CLI::Option* o : app.get_options()) {
    if (o->count() > 0 && o->get_name() != "--set" && o->get_name() != "config" &&
        o != app.get_help_ptr()) {
      a.launch_flags = true;
    }
  }
  return a;
}

// Starts `nproc` copies of this command on this node under the launcher.
int relaunch(const TrainArgs& args, int nproc) {
  dist::LaunchOptions options = args.launch;
  options.nproc_per_node(nproc);
  const std::string self = this_program();
  ST_CHECK(!self.empty(), Error, "cannot find this program's path to start its ranks");
  options.command({self, "train"});
  options.rank_main(run_tool);  // this very program: ranks forked, not exec'ed
  if (!args.config.empty()) options.command().push_back(args.config);
  for (const auto& o : args.overrides) {
    options.command().push_back("--set");
    options.command().push_back(o);
  }
  std::printf("starting %d ranks on node %d of %d: shardtrain launch -- shardtrain train %s\n",
              nproc, options.node_rank(), options.nnodes(),
              args.config.empty() ? "(built-in defaults)" : args.config.c_str());
  std::fflush(stdout);
  return dist::launch(options);
}

// The project's own files (configs/, data/) for a binary run from anywhere:
// beside an installed one (PREFIX/bin/shardtrain -> PREFIX/share/shardtrain),
// or in the checkout above its build directory. "" when none holds `relative`.
std::string project_file(const std::string& relative) {
  const fs::path exe = this_program();
  if (exe.empty()) return "";
  for (const fs::path& root : {exe.parent_path().parent_path() / "share" / "shardtrain",
                               exe.parent_path().parent_path()}) {
    const fs::path candidate = root / relative;
    std::error_code ec;
    if (fs::exists(candidate, ec)) return candidate.string();
  }
  return "";
}

config::Config load_config(const TrainArgs& args, bool say) {
  config::Config config = args.config.empty()
                              ? config::Config::parse("", args.overrides, "<built-in defaults>")
                              : config::Config::load(args.config, args.overrides);
  if (say && args.config.empty()) {
    std::printf("config: none given; the built-in defaults (the same as configs/default.yaml)\n");
  }
  // The data and the tokenizer the example configs name (data/...).
  for (std::string* path : {&config.data.train, &config.data.tokenizer}) {
    std::error_code ec;
    if (path->empty() || *path == "bytes" || *path == "auto" || fs::path(*path).is_absolute() ||
        fs::exists(*path, ec)) {
      continue;
    }
    const std::string found = project_file(*path);
    if (!found.empty()) {
      if (say) std::printf("data: '%s' is not under the current directory; using %s\n", path->c_str(), found.c_str());
      *path = found;
    }
  }
  std::fflush(stdout);
  return config;
}

}  // namespace

int train_main(int argc, char** argv) {
  const std::optional<TrainArgs> parsed = parse_train_args(argc, argv);
  if (!parsed) {
    std::printf(kTrainUsage, kLaunchFlagsUsage);
    return 0;
  }
  const TrainArgs& args = *parsed;
  check_launch_flags(args.launch);
  const dist::ClusterEnv env = dist::ClusterEnv::detect();
  // Said once, by the process the user started (its ranks load the same).
  config::Config config = load_config(args, /*say=*/env.source == dist::EnvSource::Standalone);
  // The process the user started lives as long as the job, through the
  // launcher's restarts: it holds the run directory (train/run_dir.h) and
  // its ranks see that it does. Node 0's, on a multi-node job.
  std::unique_ptr<train::detail::RunDirLock> run_lock;
  if (env.source == dist::EnvSource::Standalone && args.launch.node_rank() == 0 &&
      !train::detail::run_dir_locked_above(config.run.dir)) {
    const std::string& resume = config.checkpoint.resume;
    run_lock = train::detail::RunDirLock::acquire(
        config.run.dir, (!resume.empty() && resume != "never") || config.run.overwrite, /*refuse_previous_run=*/true);
  }
  if (env.source == dist::EnvSource::Standalone) {
    int nproc = args.nproc >= 0 ? args.nproc : static_cast<int>(config.distributed.nproc_per_node());
    if (nproc == 0) nproc = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    if (config.distributed.strategy() == strategy::StrategyKind::Single) nproc = 1;
    const bool launched = nproc > 1 || args.launch.nnodes() > 1 || args.launch.max_restarts() > 0;
    ST_CHECK(args.launch.nnodes() == 1 || config.distributed.strategy() != strategy::StrategyKind::Single,
             ConfigError, "distributed.strategy 'single' runs one process, but --nnodes is ",
             args.launch.nnodes(), "; use ddp, zero1 or fsdp across nodes");
    if (launched) return relaunch(args, nproc);
  } else {
    ST_CHECK(!args.launch_flags, ConfigError, "launch options (", launch_flag_names(),
             ") apply only outside a launcher, but this process is already rank ", env.rank,
             " of a launched job; give them to the launcher instead");
  }

  comm::CommOptions comm_options = comm::CommOptions::from_env();
  if (config.distributed.backend() != comm::Backend::Auto) comm_options.backend(config.distributed.backend());
  auto comm = comm::Communicator::create(comm_options);
  ST_CHECK(config.distributed.strategy() != strategy::StrategyKind::Single || comm->size() == 1, ConfigError,
           "distributed.strategy 'single' runs one process, but WORLD_SIZE is ", comm->size(),
           "; use ddp or start one rank");
  // tensor_parallel auto on nodes that run different numbers of ranks: 1,
  // the only degree the mesh takes there (a group must fill equal hosts).
  if (config.distributed.tensor_parallel() == 0 && env.uneven_nodes()) config.distributed.tensor_parallel(1);
  // tensor_parallel auto: rank 0 decides (budgets are per host) and every
  // rank runs what it decided.
  if (config.distributed.tensor_parallel() == 0) {
    std::string error;
    int64_t tp = 0;
    if (comm->rank() == 0) try {
        train::resolve_tensor_parallel(config, comm->size(), env.local_world_size);
        tp = config.distributed.tensor_parallel();
      } catch (const ConfigError& e) {
        error = e.what();
      }
    auto decided = torch::tensor({tp}, torch::kLong);
    comm->broadcast(decided);
    ST_CHECK(decided.item<int64_t>() > 0, ConfigError,
             comm->rank() == 0 ? error : std::string("distributed.tensor_parallel: auto failed on rank 0 (see its error)"));
    config.distributed.tensor_parallel(decided.item<int64_t>());
  }
  // A layout the mesh cannot hold (a tensor-parallel group across hosts)
  // is refused before the model is built.
  train::mesh_shape(config, comm->size(), env.local_world_size);
  // Tensor-parallel ranks and a pipeline's stages share their data: the
  // task plans for the data-parallel ranks.
  train::Trainer trainer(config, train::make_task(config, config.distributed.data_parallel_size(comm->size())), comm);
  if (comm->rank() == 0) {
    const auto plan = trainer.batch();
    const std::string core = blas_core();
    const int dp = config.distributed.data_parallel_size(comm->size());
    std::string model_parallel;
    if (config.distributed.tensor_parallel() > 1) {
      model_parallel += " x tensor_parallel " + std::to_string(config.distributed.tensor_parallel());
    }
    if (config.distributed.pipeline_parallel() > 1) {
      model_parallel += " x pipeline_parallel " + std::to_string(config.distributed.pipeline_parallel()) + " (" +
                        enum_name(config.distributed.pipeline_schedule()) + ")";
    }
    std::printf("%s | %d rank(s) x %d thread(s) | %s | strategy %s%s | batch %lld = %lld micro x %lld accumulate x %d ranks\n",
                env.describe().c_str(), comm->size(), at::get_num_threads(),
                core.empty() ? "BLAS: not OpenBLAS" : ("OpenBLAS " + core + " kernels").c_str(),
                enum_name(config.distributed.strategy()), model_parallel.c_str(),
                (long long)plan.global, (long long)plan.micro, (long long)plan.accumulate, dp);
    std::printf("precision: %s\n", trainer.precision_description().c_str());
    if (comm->size() > 1) std::printf("network: %s\n", comm->endpoint().c_str());
    std::fflush(stdout);
  }
  const train::TrainerState& state = trainer.fit();
  if (comm->rank() == 0) {
    // The report is a view of what is already on disk: failing to write it
    // (a full disk) is said, but does not fail a run whose model is saved.
    const std::string report = train::default_report_path(state.run_dir);
    try {
      train::write_report({state.run_dir}, report);
      std::printf("report: %s\n", report.c_str());
    } catch (const std::exception& e) {
      std::fprintf(stderr, "warning: no report written: %s\n",
                   ::shardtrain::detail::one_line_message(e).c_str());
    }
    std::fflush(stdout);
  }
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
    if (models::family_of(config.model.type).language_model() && config.trainer.sample_tokens > 0) {
      const std::string dir = checkpoint::exported_model_dir(state.run_dir);
      const LoadedModel lm = load_model(models::is_hf_dir(dir) ? dir : checkpoint::exported_model_path(state.run_dir));
      const auto options = models::GenerateOptions()
                               .max_new_tokens(config.trainer.sample_tokens)
                               .seed(config.run.seed)
                               .temperature(0.8)
                               .top_k(40);
      std::printf("sample:\n%s\n", sample_text(*lm.model, *model_tokenizer(config), "\n", options).c_str());
    }
    std::printf("run directory: %s (metrics.jsonl, report.html, tb/, checkpoints/, model/, config.yaml)\n",
                state.run_dir.c_str());
  }
  comm->barrier();
  return 0;
}

}  // namespace shardtrain::cli
