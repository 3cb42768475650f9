// Sharded checkpoint cost (issue 6): save and load time, and the peak RSS
// during the save, for the GPT under fsdp/full_shard with AdamW, next to the
// time of one training step. Built and run by bench/checkpoint.sh (not by
// CMake), one rank per process under the launcher:
//
//   shardtrain launch --nproc-per-node N -- build/bench_checkpoint --dir DIR
//       [--n-layer 8 --n-head 8 --n-embd 512 --block-size 256 --vocab 256 --micro 2]
//
// Per rank: build the model (seed 1), set up fsdp/full_shard, AdamW; run two
// steps on random tokens (micro batch x block_size), timing the second (the
// first creates Adam's state). Save parameters and optimizer state with
// checkpoint::save_sharded, timed; peak RSS during the save is VmHWM after
// it, with VmHWM reset to the current RSS just before (writing "5" to
// /proc/self/clear_refs). Then destroy the model and build a fresh one
// (another seed), strategy and optimizer, and time load_sharded +
// reload_parameters + load_optimizer_state. Each timed phase is enclosed in
// barriers, so its time is the slowest rank's. Rank 0 prints one JSON line:
//   {"world", "params", "step_s", "save_s", "load_s", "save_peak_rss_mb",
//    "rss_before_save_mb" (both the max over ranks, MB = 1e6 bytes), the
//    per-rank lists, with VmHWM before the reset (the training peak), which
//    shows the reset worked, "checkpoint_bytes", "verified"}
// where "verified" says that the loaded shards sum to what was saved.
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "bench_flags.h"
#include "shardtrain/checkpoint/checkpoint.h"
#include "shardtrain/checkpoint/optimizer_state.h"
#include "shardtrain/comm/communicator.h"
#include "shardtrain/models/gpt.h"
#include "shardtrain/strategy/strategy.h"

namespace {

namespace fs = std::filesystem;
namespace ck = shardtrain::checkpoint;
namespace st = shardtrain::strategy;
using shardtrain::comm::Communicator;
using Clock = std::chrono::steady_clock;

struct Args {
  std::string dir;
  shardtrain::models::GPTConfig gpt;
  int64_t micro = 2;
};

Args parse(int argc, char** argv) {
  Args a;
  a.gpt.n_layer = 8;
  a.gpt.n_head = 8;
  a.gpt.n_embd = 512;
  a.gpt.block_size = 256;
  a.gpt.vocab_size = 256;
  CLI::App app("Sharded checkpoint save/load cost under fsdp/full_shard", "bench_checkpoint");
  app.add_option("--dir", a.dir, "a scratch directory every rank sees")->required();
  app.add_option("--n-layer", a.gpt.n_layer)->check(CLI::Range(1, 1024));
  app.add_option("--n-head", a.gpt.n_head)->check(CLI::Range(1, 1024));
  app.add_option("--n-embd", a.gpt.n_embd)->check(CLI::Range(1, 1 << 16));
  app.add_option("--block-size", a.gpt.block_size)->check(CLI::Range(1, 1 << 20));
  app.add_option("--vocab", a.gpt.vocab_size)->check(CLI::Range(1, 1 << 24));
  app.add_option("--micro", a.micro)->check(CLI::Range(1, 1 << 16));
  bench::parse_flags(app, argc, argv);
  return a;
}

// A field of /proc/self/status ("VmRSS", "VmHWM") in bytes.
double status_bytes(const std::string& field) {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(field + ":", 0) == 0) {
      std::istringstream s(line.substr(field.size() + 1));
      double kb = 0;
      s >> kb;
      return kb * 1024.0;
    }
  }
  return -1.0;
}

// Makes VmHWM start again from the current RSS (Linux >= 4.0).
bool reset_peak_rss() {
  std::ofstream out("/proc/self/clear_refs");
  out << "5";
  out.flush();
  return out.good();
}

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Every rank's `v`, in rank order, on every rank.
std::vector<double> gather(Communicator& comm, double v) {
  auto in = torch::tensor({v}, torch::kDouble);
  auto out = torch::zeros({comm.size()}, torch::kDouble);
  comm.all_gather(in, out).wait();
  return std::vector<double>(out.data_ptr<double>(), out.data_ptr<double>() + comm.size());
}

double max_of(const std::vector<double>& v) {
  double m = v.front();
  for (double x : v) m = std::max(m, x);
  return m;
}

std::string list(const std::vector<double>& v, double scale) {
  std::string s = "[";
  char buf[32];
  for (size_t i = 0; i < v.size(); ++i) {
    std::snprintf(buf, sizeof buf, "%s%.1f", i ? ", " : "", v[i] * scale);
    s += buf;
  }
  return s + "]";
}

// One model, strategy and optimizer: what a training job holds.
struct Job {
  shardtrain::models::GPT model{nullptr};
  std::unique_ptr<st::Strategy> strategy;
  std::unique_ptr<torch::optim::AdamW> opt;

  Job(const shardtrain::models::GPTConfig& cfg, uint64_t seed, const std::shared_ptr<Communicator>& comm) {
    torch::manual_seed(seed);
    model = shardtrain::models::GPT(cfg);
    // Units: the blocks (the default wrap policy).
    strategy = st::make_strategy(
        st::StrategyOptions().strategy(st::StrategyKind::Fsdp).sharding(st::Sharding::FullShard));
    strategy->setup(*model, comm);
    std::vector<torch::Tensor> params;
    for (const auto& p : strategy->optimizer_parameters()) params.push_back(p.local);
    opt = std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(3e-4).weight_decay(0.1));
  }

  void step(const torch::Tensor& idx, const torch::Tensor& targets) {
    const auto logits = model->forward(idx);
    const auto loss = torch::cross_entropy_loss(logits.view({-1, logits.size(-1)}), targets.reshape({-1}));
    loss.backward();
    strategy->finish_gradient_sync();
    strategy->clip_grad_norm(1.0);
    strategy->optimizer_step(*opt);
    opt->zero_grad();
  }

  // The sum of every element this rank holds (parameters and Adam state),
  // summed over ranks: equal before the save and after the load.
  double checksum(Communicator& comm) {
    double s = 0.0;
    auto tensors = strategy->sharded_state_dict();
    const auto state = ck::optimizer_state(*opt, strategy->optimizer_parameters());
    tensors.insert(tensors.end(), state.begin(), state.end());
    for (const auto& t : tensors) {
      if (t.primary && t.local.numel() > 0) s += t.local.to(torch::kDouble).sum().item<double>();
    }
    auto total = torch::tensor({s}, torch::kDouble);
    comm.all_reduce(total).wait();
    return total.item<double>();
  }
};

int64_t directory_bytes(const std::string& dir) {
  int64_t n = 0;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (e.is_regular_file()) n += static_cast<int64_t>(e.file_size());
  }
  return n;
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = parse(argc, argv);
  auto comm = Communicator::create(shardtrain::comm::CommOptions::from_env());
  const int rank = comm->rank();
  const std::string dir = ck::checkpoint_dir(args.dir, 2);
  if (rank == 0) fs::remove_all(args.dir);
  comm->barrier();

  // Random tokens, this rank's micro batch; the same two batches each step.
  torch::manual_seed(1000 + rank);
  const auto tokens = torch::randint(args.gpt.vocab_size, {args.micro, args.gpt.block_size + 1}, torch::kLong);
  const auto idx = tokens.narrow(1, 0, args.gpt.block_size).contiguous();
  const auto targets = tokens.narrow(1, 1, args.gpt.block_size).contiguous();

  double step_s = 0, save_s = 0, load_s = 0, saved_sum = 0, loaded_sum = 0;
  std::vector<double> before, peak, training_peak;
  const int64_t params = args.gpt.num_parameters();
  {
    Job job(args.gpt, 1, comm);
    job.step(idx, targets);  // creates Adam's state
    comm->barrier();
    auto t0 = Clock::now();
    job.step(idx, targets);
    comm->barrier();
    step_s = seconds_since(t0);

    auto tensors = job.strategy->sharded_state_dict();
    const auto state = ck::optimizer_state(*job.opt, job.strategy->optimizer_parameters());
    tensors.insert(tensors.end(), state.begin(), state.end());
    comm->barrier();
    const double rss = status_bytes("VmRSS");
    const double hwm_training = status_bytes("VmHWM");
    if (!reset_peak_rss()) std::fprintf(stderr, "rank %d: cannot write /proc/self/clear_refs\n", rank);
    t0 = Clock::now();
    ck::save_sharded(dir, *comm, tensors, "bench", "", ck::SaveOptions().strategy(job.strategy->name()).step(2));
    const double hwm = status_bytes("VmHWM");
    comm->barrier();
    save_s = seconds_since(t0);
    before = gather(*comm, rss);
    training_peak = gather(*comm, hwm_training);
    peak = gather(*comm, hwm);
    saved_sum = job.checksum(*comm);
  }

  {
    Job job(args.gpt, 2, comm);  // another seed: everything must come from the checkpoint
    comm->barrier();
    const auto t0 = Clock::now();
    auto targets_ = job.strategy->sharded_state_dict();
    ck::load_sharded(dir, *comm, targets_);
    job.strategy->reload_parameters();
    ck::load_optimizer_state(dir, *comm, *job.opt, job.strategy->optimizer_parameters());
    comm->barrier();
    load_s = seconds_since(t0);
    loaded_sum = job.checksum(*comm);
  }

  if (rank == 0) {
    const bool verified = saved_sum == loaded_sum;
    std::printf(
        "{\"world\": %d, \"params\": %lld, \"micro\": %lld, \"block_size\": %lld, \"step_s\": %.4f, "
        "\"save_s\": %.4f, \"load_s\": %.4f, \"save_peak_rss_mb\": %.1f, \"rss_before_save_mb\": %.1f, "
        "\"save_peak_rss_mb_per_rank\": %s, \"rss_before_save_mb_per_rank\": %s, "
        "\"peak_rss_before_reset_mb_per_rank\": %s, "
        "\"checkpoint_bytes\": %lld, \"verified\": %s}\n",
        comm->size(), static_cast<long long>(params), static_cast<long long>(args.micro),
        static_cast<long long>(args.gpt.block_size), step_s, save_s, load_s, max_of(peak) / 1e6,
        max_of(before) / 1e6, list(peak, 1e-6).c_str(), list(before, 1e-6).c_str(),
        list(training_peak, 1e-6).c_str(),
        static_cast<long long>(directory_bytes(dir)), verified ? "true" : "false");
    std::fflush(stdout);
    if (!verified) std::fprintf(stderr, "checksum after load %.17g != saved %.17g\n", loaded_sum, saved_sum);
  }
  comm->barrier();
  if (rank == 0) fs::remove_all(args.dir);
  return saved_sum == loaded_sum ? 0 : 1;
}
