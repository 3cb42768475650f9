// `shardtrain bench-comm`: latency and bandwidth of one collective, run under
// the launcher. Definitions follow nccl-tests: algbw = bytes / time; busbw
// scales algbw by the fraction of the buffer each rank must move, so it is
// comparable with link bandwidth: 2(n-1)/n for all_reduce, (n-1)/n for
// reduce_scatter, all_gather and all_to_all (each rank sends and receives
// that fraction of its buffer), 1 for broadcast. After timing, one more
// call with rank-dependent values is checked, so a wrong collective fails
// the run instead of printing fast figures.
#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "commands.h"
#include "flags.h"
#include "shardtrain/comm/communicator.h"
#include "shardtrain/core/error.h"

namespace shardtrain::cli {
namespace {

struct BenchArgs {
  std::string op = "all_reduce";
  int64_t bytes = int64_t{1} << 20;
  std::string dtype = "float32";
  int iters = 20;
  int warmup = 5;
  std::string json;
  std::string buffer = "ordinary";
};

void print_help() {
  std::printf(
      "usage: shardtrain launch --nproc-per-node N -- shardtrain bench-comm [options]\n"
      "  --op OP        all_reduce | reduce_scatter | all_gather | broadcast | all_to_all |\n"
      "                 barrier (default all_reduce; barrier ignores --bytes and --dtype;\n"
      "                 all_to_all sends each rank an equal part of the buffer, the last\n"
      "                 part taking the remainder)\n"
      "  --bytes B      buffer size in bytes; suffixes K, M, G (default 1M)\n"
      "  --dtype D      float32 | bfloat16 | float16 (default float32)\n"
      "  --iters K      timed iterations (default 20), after --warmup W (default 5)\n"
      "  --buffer KIND  ordinary (at::ones) | allocated (Communicator::allocate,\n"
      "                 which all_reduce works on in place) (default ordinary)\n"
      "  --json FILE    append the figures as one JSON line (rank 0)\n");
}

int64_t parse_bytes(const std::string& text) {
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  double scale = 1;
  const std::string suffix = end ? end : "";
  if (suffix == "K" || suffix == "KB" || suffix == "k") scale = 1 << 10;
  else if (suffix == "M" || suffix == "MB") scale = 1 << 20;
  else if (suffix == "G" || suffix == "GB") scale = 1 << 30;
  else ST_CHECK(suffix.empty(), ConfigError, "--bytes '", text, "' is not a size like 4096, 1K, 64M");
  ST_CHECK(end != text.c_str() && value >= 0 && value * scale <= 1e12, ConfigError, "--bytes '", text,
           "' is not a size like 4096, 1K, 64M");
  return static_cast<int64_t>(value * scale);
}

// The arguments, or nothing when --help was asked.
std::optional<BenchArgs> parse_bench_comm_args(int argc, char** argv) {
  BenchArgs a;
  CLI::App app;
  setup_app(app);
  add_text(app, "--op", a.op);
  app.add_option_function<std::string>("--bytes", [&a](const std::string& v) { a.bytes = parse_bytes(v); });
  add_text(app, "--dtype", a.dtype);
  add_int(app, "--iters", a.iters, 1, 1000000000, "a count >= 1");
  add_int(app, "--warmup", a.warmup, 0, 1000000000, "a count >= 0");
  add_text(app, "--json", a.json);
  add_text(app, "--buffer", a.buffer);
  if (parse_flags(app, argc, argv, "bench-comm", "unknown option")) return std::nullopt;
  ST_CHECK(a.op == "all_reduce" || a.op == "reduce_scatter" || a.op == "all_gather" ||
               a.op == "broadcast" || a.op == "all_to_all" || a.op == "barrier",
           ConfigError, "--op '", a.op,
           "' is not one of all_reduce, reduce_scatter, all_gather, broadcast, all_to_all, barrier");
  ST_CHECK(a.buffer == "ordinary" || a.buffer == "allocated", ConfigError, "--buffer '", a.buffer,
           "' is not one of ordinary, allocated");
  ST_CHECK(a.iters > 0 && a.warmup >= 0, ConfigError, "--iters must be positive and --warmup >= 0");
  return a;
}

at::ScalarType scalar_type(const std::string& name) {
  if (name == "float32") return at::kFloat;
  if (name == "bfloat16") return at::kBFloat16;
  if (name == "float16") return at::kHalf;
  ST_CHECK(false, ConfigError, "--dtype '", name, "' is not one of float32, bfloat16, float16");
  return at::kFloat;
}

// all_to_all's part for each destination rank: numel / n elements, the last
// part also taking the remainder.
std::vector<int64_t> all_to_all_bench_parts(int64_t numel, int n) {
  std::vector<int64_t> parts(n, numel / n);
  parts.back() += numel % n;
  return parts;
}

// The values all_to_all is checked with: element p of rank `src`'s buffer
// holds (src + 1) + (n + 1) * (p % period), an integer that names its source
// and (within the period) its position. The period keeps every value below
// 2^8 (bfloat16), 2^11 (float16) or 2^24 (float32), where integers are exact.
at::Tensor all_to_all_bench_values(int src, int n, int64_t first, int64_t count, at::ScalarType dtype) {
  const int64_t exact = dtype == at::kBFloat16 ? int64_t{1} << 8 : dtype == at::kHalf ? int64_t{1} << 11
                                                                                      : int64_t{1} << 24;
  const int64_t period = std::max<int64_t>(1, exact / (n + 1));
  const at::Tensor p = at::arange(first, first + count, at::kLong);
  return (p.remainder(period) * (n + 1) + (src + 1)).to(dtype);
}

}  // namespace

int bench_comm_main(int argc, char** argv) {
  const std::optional<BenchArgs> parsed = parse_bench_comm_args(argc, argv);
  if (!parsed) {
    print_help();
    return 0;
  }
  const BenchArgs& args = *parsed;
  auto comm = comm::Communicator::create(comm::CommOptions::from_env());
  const int n = comm->size();
  const at::ScalarType dtype = scalar_type(args.dtype);
  const bool barrier = args.op == "barrier";
  const int64_t numel =
      barrier ? 0 : std::max<int64_t>(1, args.bytes / static_cast<int64_t>(c10::elementSize(dtype)));
  const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
  const comm::ShardRange mine = comm::shard_range(numel, n, comm->rank());
  auto full = args.buffer == "allocated" ? comm->allocate(numel, dtype).fill_(1) : at::ones({numel}, dtype);
  auto shard = at::ones({mine.count}, dtype);
  // all_to_all: part j of `full` goes to rank j; this rank receives its own
  // part's size from every rank, in rank order.
  const bool to_all = args.op == "all_to_all";
  const std::vector<int64_t> send_parts = to_all ? all_to_all_bench_parts(numel, n) : std::vector<int64_t>();
  const int64_t my_part = to_all ? send_parts[comm->rank()] : 0;
  const std::vector<int64_t> recv_parts(to_all ? n : 0, my_part);
  auto received = at::ones({to_all ? n * my_part : 0}, dtype);

  auto run_once = [&] {
    if (args.op == "all_reduce") comm->all_reduce(full);
    else if (args.op == "reduce_scatter") comm->reduce_scatter(full, shard);
    else if (args.op == "all_gather") comm->all_gather(shard, full);
    else if (to_all) comm->all_to_all(full, send_parts, received, recv_parts);
    else if (barrier) comm->barrier();
    else comm->broadcast(full);
  };
  for (int i = 0; i < args.warmup; ++i) run_once();
  comm->barrier();
  std::vector<double> times;
  for (int i = 0; i < args.iters; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    run_once();
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  // The figures only count if the collective is right: once more with
  // rank-dependent values, checked against what it must compute.
  const double r = comm->rank() + 1;
  const double sum = n * (n + 1) / 2.0;
  full.fill_(r);
  shard.fill_(r);
  if (to_all) {
    full.copy_(all_to_all_bench_values(comm->rank(), n, 0, numel, dtype));
    received.zero_();  // no checked value is 0: a row left unwritten shows
  }
  run_once();
  at::Tensor want;
  at::Tensor got = full;
  if (args.op == "all_reduce") {
    want = at::full({numel}, sum, dtype);
  } else if (args.op == "reduce_scatter") {
    want = at::full({mine.count}, sum, dtype);
    got = shard;
  } else if (args.op == "all_gather") {
    want = at::empty({numel}, dtype);
    for (int k = 0; k < n; ++k) {
      const comm::ShardRange part = comm::shard_range(numel, n, k);
      want.narrow(0, part.offset, part.count).fill_(k + 1);
    }
  } else if (to_all) {
    // From every rank k, the elements of k's buffer at this rank's part.
    const int64_t first = comm->rank() * (numel / n);
    std::vector<at::Tensor> from;
    for (int k = 0; k < n; ++k) from.push_back(all_to_all_bench_values(k, n, first, my_part, dtype));
    want = at::cat(from);
    got = received;
  } else if (barrier) {
    want = got;  // nothing to check: BarrierWaitsForTheLastRank tests it
  } else {
    want = at::ones({numel}, dtype);  // rank 0's
  }
  ST_CHECK(at::equal(got, want), CommError, args.op, " of ", bytes, " bytes on ", n,
           " ranks gave a wrong result on rank ", comm->rank(),
           "; the figures of this run are void. Hint: run the collectives tests (ctest -R dist.collectives)");

  // The slowest rank defines each iteration's time.
  auto t = at::from_blob(times.data(), {static_cast<int64_t>(times.size())}, at::kDouble).clone();
  comm->all_reduce(t, comm::AllReduceOptions().op(comm::ReduceOp::Max));
  const double avg_s = t.mean().item<double>();
  const double algbw = bytes / avg_s / 1e9;
  const double factor = args.op == "all_reduce" ? 2.0 * (n - 1) / n
                        : args.op == "broadcast" ? 1.0
                                                 : static_cast<double>(n - 1) / n;
  const double busbw = algbw * factor;
  if (comm->rank() == 0) {
    std::printf("%-15s %-9s %12lld bytes  %2d ranks  %10.1f us  algbw %8.3f GB/s  busbw %8.3f GB/s\n",
                args.op.c_str(), args.dtype.c_str(), static_cast<long long>(bytes), n, avg_s * 1e6,
                algbw, busbw);
    if (!args.json.empty()) {
      std::ofstream out(args.json, std::ios::app);
      ST_CHECK(out.good(), ConfigError, "cannot append to --json file '", args.json, "'");
      out << "{\"impl\":\"shardtrain\",\"op\":\"" << args.op << "\",\"dtype\":\"" << args.dtype
          << "\",\"bytes\":" << bytes << ",\"world_size\":" << n << ",\"iters\":" << args.iters
          << ",\"time_us\":" << avg_s * 1e6 << ",\"algbw_gbps\":" << algbw
          << ",\"busbw_gbps\":" << busbw << ",\"buffer\":\"" << args.buffer << "\"}\n";
    }
  }
  comm->barrier();
  return 0;
}

}  // namespace shardtrain::cli
