// `shardtrain estimate [CONFIG] [--set k=v ...]`: memory per rank and
// communication per step of every strategy for the config's model, and the
// strategy `distributed.strategy: auto` would run. Builds the model (to count
// its parameters and plan its fsdp units) but trains nothing.
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "commands.h"
#include "flags.h"
#include "shardtrain/config/config.h"
#include "shardtrain/core/error.h"
#include "shardtrain/models/family.h"
#include "shardtrain/models/mlp.h"
#include "shardtrain/precision/precision.h"
#include "shardtrain/strategy/estimate.h"
#include "shardtrain/strategy/strategy.h"
#include "shardtrain/strategy/wrap.h"
#include "shardtrain/train/plan.h"
#include "shardtrain/train/task.h"

namespace shardtrain::cli {
namespace {

const char kEstimateUsage[] =
    "usage: shardtrain estimate [CONFIG] [--set KEY=VALUE ...] [--nproc-per-node N] [--nnodes M]\n"
    "\n"
    "Estimates, for the model CONFIG describes (default: configs/default.yaml), the\n"
    "memory per rank and the communication per optimizer step of every strategy,\n"
    "and which one distributed.strategy auto would pick under\n"
    "distributed.memory_budget_mb (0: MemAvailable / local ranks). N defaults to\n"
    "distributed.nproc_per_node (auto = this machine's cores); the world size is\n"
    "M x N. Figures are estimates (ZeRO's formulas for Adam, Korthikanti et al.'s\n"
    "for activations); see docs/config.md. With ranks per node to split the model\n"
    "over, a second table gives each distributed.tensor_parallel degree's totals.\n";

struct EstimateArgs {
  std::string config = "configs/default.yaml";
  std::vector<std::string> overrides;
  int nproc = -1;  // -1: from the config
  int nnodes = 1;
};

// The arguments, or nothing when --help was asked.
std::optional<EstimateArgs> parse_estimate_args(int argc, char** argv) {
  EstimateArgs a;
  CLI::App app;
  setup_app(app);
  app.add_option("config", a.config);
  add_list(app, "--set", a.overrides);
  app.add_option_function<std::string>("--nproc-per-node", [&a](const std::string& v) {
    a.nproc = v == "auto" ? 0
                          : static_cast<int>(parse_int("--nproc-per-node", v, 1, 1 << 20,
                                                       "a count >= 1 or 'auto'"));
  });
  add_int(app, "--nnodes", a.nnodes, 1, 1 << 20, "a count >= 1");
  if (parse_flags(app, argc, argv, "estimate")) return std::nullopt;
  return a;
}

// ---- formatting ----------------------------------------------------------------------

std::string fmt(const char* format, double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), format, v);
  return buf;
}

// Bytes as "12.34 MiB" below 1 GiB, "1.23 GiB" from there.
std::string bytes(double b) {
  const double mib = b / (1024.0 * 1024.0);
  return mib < 1024.0 ? fmt("%.2f MiB", mib) : fmt("%.2f GiB", mib / 1024.0);
}

// 1234567 -> "1,234,567".
std::string grouped(int64_t n) {
  std::string digits = std::to_string(n < 0 ? -n : n);
  for (int i = static_cast<int>(digits.size()) - 3; i > 0; i -= 3) digits.insert(i, ",");
  return (n < 0 ? "-" : "") + digits;
}

// Characters on screen (UTF-8 code points), for padding text with Ψ or ×.
size_t width(const std::string& s) {
  return static_cast<size_t>(std::count_if(
      s.begin(), s.end(), [](char c) { return (static_cast<unsigned char>(c) & 0xC0) != 0x80; }));
}

std::string pad_left(const std::string& s, size_t w) {
  return std::string(w > width(s) ? w - width(s) : 0, ' ') + s;
}

std::string pad_right(const std::string& s, size_t w) {
  return s + std::string(w > width(s) ? w - width(s) : 0, ' ');
}

std::string join(const std::vector<std::string>& items, const char* sep) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) out += (i ? sep : "") + items[i];
  return out;
}

// Each tensor-parallel degree the model can take on this host: the total
// per rank of every strategy on the data-parallel ranks left.
void print_tensor_parallel(const config::Config& config, int world, int nproc, double budget, int tp,
                           bool tp_auto, const std::string& tp_failure) {
  const std::vector<int> degrees = train::tensor_parallel_degrees(config, nproc);
  if (degrees.size() < 2 && !tp_auto) return;
  std::vector<std::string> head = {"tp", "dp"};
  std::vector<std::vector<std::string>> cells;
  const int pp = static_cast<int>(config.distributed.pipeline_parallel());
  for (const int t : degrees) {
    if (world % (t * pp) != 0) continue;  // no data-parallel size left with the pipeline
    config::Config c = config;
    c.distributed.tensor_parallel(t);
    const auto model = train::planning_model(c);
    const auto rows = strategy::estimate_all(train::estimate_input(c, *model, world, nproc));
    std::vector<std::string> line = {std::to_string(t), std::to_string(world / (t * pp))};
    const bool first = head.size() == 2;
    for (const auto& r : rows) {
      if (first) head.push_back(r.strategy);
      line.push_back(bytes(r.total_bytes) + (r.total_bytes <= budget ? "" : "*"));
    }
    if (t == tp) line.push_back(tp_auto ? "<- auto" : "<- config");
    cells.push_back(std::move(line));
  }
  std::vector<size_t> w(head.size());
  for (size_t c = 0; c < head.size(); ++c) {
    w[c] = width(head[c]);
    for (const auto& row : cells) w[c] = std::max(w[c], width(row[c]));
  }
  std::printf("\ntensor parallelism: total per rank at each degree of %d ranks per node (* over the budget)\n",
              nproc);
  const auto print_row = [&](const std::vector<std::string>& row) {
    std::string line;
    for (size_t c = 0; c < head.size(); ++c) line += (c ? "  " : "") + pad_left(row[c], w[c]);
    if (row.size() > head.size()) line += "  " + row.back();
    std::printf("%s\n", line.c_str());
  };
  print_row(head);
  for (const auto& row : cells) print_row(row);
  if (tp_auto) {
    if (tp_failure.empty()) {
      std::printf("tensor_parallel auto picks: %d (the least degree at which %s fits)\n", tp,
                  config.distributed.strategy() == strategy::StrategyKind::Auto
                      ? "a strategy"
                      : config.distributed.display_name().c_str());
    } else {
      std::printf("tensor_parallel auto picks: none; %s\n", tp_failure.c_str());
    }
  }
}

}  // namespace

int estimate_main(int argc, char** argv) {
  const std::optional<EstimateArgs> parsed = parse_estimate_args(argc, argv);
  if (!parsed) {
    std::fputs(kEstimateUsage, stdout);
    return 0;
  }
  const EstimateArgs& args = *parsed;
  config::Config config = config::Config::load(args.config, args.overrides);
  // As the trainer will: `auto` becomes what this machine would run.
  const precision::ResolvedPrecision resolved =
      precision::resolve_precision_measured(config.precision, torch::cuda::is_available());
  config.precision = resolved.kind;
  const config::DistributedConfig& dc = config.distributed;

  // ---- world ----
  const unsigned cpus = std::max(1u, std::thread::hardware_concurrency());
  int nproc = args.nproc >= 0 ? args.nproc : static_cast<int>(dc.nproc_per_node());
  const bool nproc_auto = nproc == 0;
  if (nproc_auto) nproc = static_cast<int>(cpus);
  int nnodes = args.nnodes;
  const bool single = dc.strategy() == strategy::StrategyKind::Single;
  if (single) nproc = nnodes = 1;
  const int world = nproc * nnodes;

  // ---- tensor parallelism: auto decided as shardtrain train decides it ----
  const bool tp_auto = dc.tensor_parallel() == 0;
  std::string tp_failure;
  if (tp_auto) try {
      train::resolve_tensor_parallel(config, world, nproc);
    } catch (const ConfigError& e) {
      tp_failure = e.what();
      config.distributed.tensor_parallel(1);  // the tables below as without it
    }
  const int tp = static_cast<int>(dc.tensor_parallel());
  ST_CHECK(nproc % tp == 0, ConfigError, "distributed.tensor_parallel=", tp, " does not divide the ", nproc,
           " ranks per node; a tensor-parallel group shares one host");

  // ---- model, units and the estimator's input (the same as strategy auto
  // uses): the model one rank holds, built deferred (no weights drawn, so a
  // model far larger than this machine is estimated too); its element
  // counts must stay exact in 64 bits ----
  const double params = train::model_parameter_count(config.model);
  char count[32];
  std::snprintf(count, sizeof(count), "%.3g", params);
  ST_CHECK(params < 1e15, ConfigError, "the model has about ", count,
           " parameters; estimate counts models of up to 1e15; lower the model's sizes");
  const auto model = train::planning_model(config);
  const std::vector<strategy::UnitPlan> units =
      strategy::plan_units(*model, strategy::policy_from_options(dc));
  strategy::EstimateInput in = train::estimate_input(config, *model, world, nproc);
  const int64_t psi = in.num_params;
  const bool mixed = in.mixed_precision;
  const int act_bytes = train::activation_element_bytes(config);
  const int64_t micro = train::estimate_micro_batch(config, world);
  const auto rows = strategy::estimate_all(in);
  in.mixed_precision = !mixed;
  const auto other = strategy::estimate_all(in);  // the other state column
  in.mixed_precision = mixed;

  const bool budget_auto = dc.memory_budget_mb() <= 0.0;
  const double budget = train::memory_budget_bytes(config, nproc);

  // ---- header ----
  std::printf("model: %s, %s\n", enum_name(config.model.type),
              models::family_of(config.model.type).size_text(config.model).c_str());
  if (in.frozen_bytes > 0) {
    std::printf("parameters (Ψ): %s trainable (LoRA adapters); frozen base: %s (%s), no gradients or optimizer state\n",
                grouped(psi).c_str(), bytes(static_cast<double>(in.frozen_bytes)).c_str(),
                enum_name(config.lora.quantize()));
  } else {
    std::printf("parameters (Ψ): %s trainable\n", grouped(psi).c_str());
  }
  std::string policy = enum_name(dc.auto_wrap_policy());
  if (dc.auto_wrap_policy() == strategy::AutoWrapPolicy::ModuleType) {
    policy += " [" + join(dc.wrap_module_types(), ", ") + "]";
  }
  if (dc.auto_wrap_policy() == strategy::AutoWrapPolicy::Size) {
    policy += " (min_num_params " + grouped(dc.min_num_params()) + ")";
  }
  std::printf("fsdp units (auto_wrap_policy %s): %zu\n", policy.c_str(), units.size());
  size_t name_w = 6;
  for (const auto& u : units) name_w = std::max(name_w, width(u.name));
  const auto print_unit = [&](const strategy::UnitPlan& u) {
    const std::string name = u.name.empty() ? "(root)" : u.name;
    std::printf("  %s  %s parameters\n", pad_right(name, name_w).c_str(),
                pad_left(grouped(u.numel), 14).c_str());
  };
  const size_t kShown = 8;
  for (size_t i = 0; i < units.size(); ++i) {
    if (units.size() > kShown && i == kShown - 2) {
      std::printf("  ... %zu more\n", units.size() - (kShown - 1));
      i = units.size() - 1;
    }
    print_unit(units[i]);
  }
  std::printf("world: %d rank(s) = %d node(s) x %d per node%s\n", world, nnodes, nproc,
              single                   ? " (strategy single)"
              : nproc_auto             ? " (nproc_per_node auto: online CPUs)"
                                       : "");
  if (!tp_failure.empty()) {
    std::printf("tensor_parallel auto: no degree fits (see below); the first table is without tensor parallelism\n");
  } else if (tp > 1 || tp_auto) {
    std::printf("tensor_parallel %d%s: %d data-parallel rank(s)%s\n", tp, tp_auto ? " (auto)" : "", world / tp,
                tp > 1 ? "; a rank holds its blocks of the split layers" : "");
  }
  std::printf("precision %s, param_dtype %s: %s formulas; activations for micro-batch %lld "
              "in %d-byte elements%s\n",
              enum_name(config.precision), enum_name(dc.param_dtype()),
              mixed ? "mixed-precision" : "fp32",
              (long long)micro, act_bytes,
              config.model.activation_checkpointing
                  ? ", activation checkpointing on"
                  : "");
  if (!resolved.reason.empty()) std::printf("precision %s: %s\n", enum_name(config.precision), resolved.reason.c_str());
  if (config.precision == precision::PrecisionKind::Bf16True) {
    std::printf("note: bf16-true keeps weights, gradients and Adam state in bf16; its model state "
                "is about half the fp32 column\n");
  }
  const std::string budget_source =
      budget_auto ? detail::str_cat(" (auto: MemAvailable / ", nproc, " local rank(s))")
                  : std::string(" (distributed.memory_budget_mb)");
  std::printf("memory budget: %s per rank%s\n", bytes(budget).c_str(), budget_source.c_str());

  // ---- table ----
  std::string chosen;
  std::string failure;
  try {
    chosen = strategy::choose_strategy(in, budget).strategy;
  } catch (const ConfigError& e) {
    failure = e.what();
  }
  // The configured strategy as the estimator names it ("fsdp/<sharding>").
  std::string configured = dc.display_name();
  if (dc.strategy() == strategy::StrategyKind::Auto) configured = chosen;

  const std::vector<std::string> head = {"strategy",   "state mixed", "state fp32",  "gathered",
                                         "activations", "total",      "comm/step", "fits"};
  std::vector<std::vector<std::string>> cells;
  for (size_t i = 0; i < rows.size(); ++i) {
    const auto& r = rows[i];
    const double state_mixed = mixed ? r.model_state_bytes : other[i].model_state_bytes;
    const double state_fp32 = mixed ? other[i].model_state_bytes : r.model_state_bytes;
    const bool gathers = r.kind == strategy::StrategyKind::Fsdp &&
                         (r.sharding == strategy::Sharding::FullShard || r.sharding == strategy::Sharding::HybridShard);
    std::string mark;
    if (r.strategy == configured) {
      mark = dc.strategy() == strategy::StrategyKind::Auto ? "  <- auto" : "  <- config";
    }
    cells.push_back({r.strategy, bytes(state_mixed), bytes(state_fp32),
                     gathers ? bytes(r.gathered_bytes) : "-", bytes(r.activation_bytes),
                     bytes(r.total_bytes), fmt("%.2f Ψ", r.comm_volume),
                     (r.total_bytes <= budget ? "yes" : "no") + mark});
  }
  std::vector<size_t> w(head.size());
  for (size_t c = 0; c < head.size(); ++c) {
    w[c] = width(head[c]);
    for (const auto& row : cells) w[c] = std::max(w[c], width(row[c]));
  }
  const auto print_row = [&](const std::vector<std::string>& row) {
    std::string line = pad_right(row[0], w[0]);
    for (size_t c = 1; c + 1 < row.size(); ++c) line += "  " + pad_left(row[c], w[c]);
    line += "  " + row.back();
    std::printf("%s\n", line.c_str());
  };
  std::printf("\nper rank; total = state %s + gathered + activations; comm in Ψ elements per "
              "optimizer step\n",
              mixed ? "mixed" : "fp32");
  print_row(head);
  for (const auto& row : cells) print_row(row);
  std::printf("\n");

  if (dc.accumulation() == strategy::Accumulation::Unsharded) {
    std::printf("note: accumulation unsharded keeps whole gradients across micro-steps under "
                "fsdp shard_grad_op, full_shard and hybrid_shard: +%s per rank, not in the "
                "table\n",
                bytes(static_cast<double>(psi) * (mixed ? 2.0 : 4.0)).c_str());
  }
  if (chosen.empty()) {
    std::printf("auto would pick: none; %s\n", failure.c_str());
  } else {
    const auto& r = *std::find_if(rows.begin(), rows.end(),
                                  [&](const auto& e) { return e.strategy == chosen; });
    std::printf("auto would pick: %s (least communication that fits: %.2f Ψ per step, %s of %s)\n",
                chosen.c_str(), r.comm_volume, bytes(r.total_bytes).c_str(), bytes(budget).c_str());
  }
  print_tensor_parallel(config, world, nproc, budget, tp, tp_auto, tp_failure);
  return 0;
}

}  // namespace shardtrain::cli
