// The pipeline schedules as per-rank orders of work, and their simulation
// (see pipeline_schedule.h).
#include "shardtrain/parallel/pipeline_schedule.h"

#include <algorithm>
#include <limits>
#include <map>
#include <optional>
#include <tuple>

#include "shardtrain/core/error.h"

namespace shardtrain::parallel {

namespace {

using shardtrain::detail::str_cat;

PipeAction forward(int stage, int micro) { return {PipeOp::Forward, stage, micro}; }
PipeAction backward(int stage, int micro) { return {PipeOp::Backward, stage, micro}; }

std::vector<PipeAction> gpipe(int m, int r) {
  std::vector<PipeAction> out;
  for (int i = 0; i < m; ++i) out.push_back(forward(r, i));
  for (int i = 0; i < m; ++i) out.push_back(backward(r, i));
  return out;
}

// PipeDream-Flush: warm up with the forwards the later ranks need before
// the first backward comes back, then alternate, then drain.
std::vector<PipeAction> one_f_one_b(int p, int m, int r) {
  const int warmup = std::min(p - r - 1, m);
  std::vector<PipeAction> out;
  for (int i = 0; i < warmup; ++i) out.push_back(forward(r, i));
  for (int i = 0; i < m - warmup; ++i) {
    out.push_back(forward(r, warmup + i));
    out.push_back(backward(r, i));
  }
  for (int i = m - warmup; i < m; ++i) out.push_back(backward(r, i));
  return out;
}

// ZB-H1: 1f1b's order with each backward split: rank r runs a
// weight-gradient half (the oldest pending) after each of its input
// gradients but the first r, and the r it skipped at the end, where they
// fill the drain that 1f1b leaves idle. The bubble is a third of 1f1b's
// (forward, input and weight halves of equal cost) and no rank holds more
// than p micro-batches, 1f1b's peak. (As PyTorch's zero-bubble schedule
// and the paper authors' own schedule model order it.)
std::vector<PipeAction> zero_bubble(int p, int m, int r) {
  std::vector<PipeAction> out;
  int inputs = 0, weights = 0;
  for (const PipeAction& a : one_f_one_b(p, m, r)) {
    if (a.op == PipeOp::Forward) {
      out.push_back(a);
      continue;
    }
    out.push_back({PipeOp::BackwardInput, a.stage, a.micro});
    if (inputs++ >= r) out.push_back({PipeOp::BackwardWeight, r, weights++});
  }
  while (weights < m) out.push_back({PipeOp::BackwardWeight, r, weights++});
  return out;
}

// Megatron's virtual pipeline: the micro-batches go in rounds of G through
// each of the rank's v stages in turn (G = p, or m when m < p, as
// PyTorch's interleaved schedule generalises it), backwards through the
// stages in reverse; warm-up covers the forwards the other ranks' stages
// need before this rank's first backward can come back.
std::vector<PipeAction> interleaved(int p, int m, int v, int r) {
  const int rounds = std::max(1, m / p);
  const int group = m / rounds;  // micro-batches per round
  const int total = m * v;
  const auto micro_of = [&](int k) { return (k / (group * v)) * group + k % group; };
  const auto fwd = [&](int k) { return forward(((k / group) % v) * p + r, micro_of(k)); };
  const auto bwd = [&](int k) { return backward((v - 1 - (k / group) % v) * p + r, micro_of(k)); };
  const int warmup = std::min(total, (v - 1) * group + 2 * (p - 1 - r));
  std::vector<PipeAction> out;
  int f = 0, b = 0;
  for (; f < warmup; ++f) out.push_back(fwd(f));
  while (f < total) {
    out.push_back(fwd(f++));
    out.push_back(bwd(b++));
  }
  while (b < total) out.push_back(bwd(b++));
  return out;
}

}  // namespace

std::string to_string(const PipeAction& a, bool with_stage) {
  const char* op = a.op == PipeOp::Forward         ? "F"
                   : a.op == PipeOp::Backward      ? "B"
                   : a.op == PipeOp::BackwardInput ? "I"
                                                   : "W";
  return str_cat(op, a.micro, with_stage ? str_cat("@s", a.stage) : std::string());
}

std::vector<std::vector<PipeAction>> pipeline_schedule(PipelineSchedule schedule, int ranks, int micro_batches,
                                                       int stages_per_rank) {
  const int p = ranks, m = micro_batches, v = stages_per_rank;
  ST_CHECK(p >= 1 && m >= 1, ConfigError, "a pipeline needs at least one rank and one micro-batch, got ", p,
           " rank(s) and ", m, " micro-batch(es)");
  ST_CHECK(v >= 1 && (v == 1 || schedule == PipelineSchedule::Interleaved1F1B), ConfigError,
           "distributed.stages_per_rank=", v, ": ",
           v < 1 ? "must be >= 1" : "more than one stage per rank needs pipeline_schedule interleaved_1f1b");
  if (schedule == PipelineSchedule::Interleaved1F1B && v > 1) {
    const int rounds = std::max(1, m / p);
    ST_CHECK(m % rounds == 0, ConfigError, "the interleaved schedule takes the micro-batches in m / ", p,
             " (pipeline ranks) rounds of equal size: ", m, " micro-batches (batch.accumulate) do not make ",
             rounds, " equal rounds; use a multiple of ", p, ", or fewer than ", 2 * p);
  }
  std::vector<std::vector<PipeAction>> out;
  for (int r = 0; r < p; ++r) {
    switch (schedule) {
      case PipelineSchedule::GPipe:
        out.push_back(gpipe(m, r));
        break;
      case PipelineSchedule::OneFOneB:
        out.push_back(one_f_one_b(p, m, r));
        break;
      case PipelineSchedule::Interleaved1F1B:
        out.push_back(v == 1 ? one_f_one_b(p, m, r) : interleaved(p, m, v, r));
        break;
      case PipelineSchedule::ZeroBubble:
        out.push_back(zero_bubble(p, m, r));
        break;
    }
  }
  return out;
}

namespace {

// What each (kind, stage, micro) produced and when: the forward's
// activation and the input gradient (from B or I).
enum Kind { kActivation, kInputGrad };
using WorkKey = std::tuple<int, int, int>;

WorkKey key(Kind k, int stage, int micro) { return std::make_tuple(static_cast<int>(k), stage, micro); }

// Every action once, on the rank holding its stage: how often each
// (op, stage, micro) is run.
std::map<WorkKey, int> count_actions(const std::vector<std::vector<PipeAction>>& schedule, int stages,
                                     int micro_batches) {
  const int p = static_cast<int>(schedule.size());
  std::map<WorkKey, int> seen;
  for (int r = 0; r < p; ++r) {
    for (const PipeAction& a : schedule[static_cast<size_t>(r)]) {
      ST_CHECK(a.stage >= 0 && a.stage < stages && a.micro >= 0 && a.micro < micro_batches &&
                   stage_rank(a.stage, p) == r,
               ConfigError, "pipeline schedule: rank ", r, "'s ", to_string(a, true), " is not its work");
      ST_CHECK(++seen[std::make_tuple(static_cast<int>(a.op), a.stage, a.micro)] == 1, ConfigError,
               "pipeline schedule: rank ", r, " runs ", to_string(a, true), " twice");
    }
  }
  return seen;
}

// Every stage runs every micro-batch's forward and its backward, whole or
// split into its input and weight halves.
void check_complete(const std::map<WorkKey, int>& seen, int p, int stages, int micro_batches) {
  for (int s = 0; s < stages; ++s) {
    for (int i = 0; i < micro_batches; ++i) {
      const auto count = [&](PipeOp op) { return seen.count(std::make_tuple(static_cast<int>(op), s, i)); };
      const bool whole = count(PipeOp::Backward) == 1;
      const bool split = count(PipeOp::BackwardInput) == 1 && count(PipeOp::BackwardWeight) == 1;
      ST_CHECK(count(PipeOp::Forward) == 1 && whole != split, ConfigError, "pipeline schedule: stage ", s,
               " (rank ", stage_rank(s, p), ") lacks the forward or the backward of micro-batch ", i);
    }
  }
}

// What the action takes in; stage 0's forward takes the batch.
std::optional<WorkKey> input_of(const PipeAction& a, int stages) {
  std::optional<WorkKey> needs;
  if (a.op == PipeOp::Forward) {
    if (a.stage > 0) needs = key(kActivation, a.stage - 1, a.micro);
  } else if (a.op == PipeOp::BackwardWeight) {
    needs = key(kInputGrad, a.stage, a.micro);
  } else {
    needs = a.stage == stages - 1 ? key(kActivation, a.stage, a.micro) : key(kInputGrad, a.stage + 1, a.micro);
  }
  return needs;
}

double cost_of(const PipeAction& a, const PipeCosts& costs) {
  return a.op == PipeOp::Forward         ? costs.forward
         : a.op == PipeOp::Backward      ? costs.backward_input + costs.backward_weight
         : a.op == PipeOp::BackwardInput ? costs.backward_input
                                         : costs.backward_weight;
}

// The simulation under way: each rank's next action, when it is free, the
// micro-batches whose inputs it holds, and when each output was produced.
struct Run {
  const std::vector<std::vector<PipeAction>>& schedule;
  int stages;
  const PipeCosts& costs;
  PipeSimulation sim;
  std::map<WorkKey, double> done;
  std::vector<size_t> next;
  std::vector<double> free_at;
  std::vector<int> in_flight;

  Run(const std::vector<std::vector<PipeAction>>& schedule, int stages, const PipeCosts& costs)
      : schedule(schedule), stages(stages), costs(costs), next(schedule.size(), 0),
        free_at(schedule.size(), 0.0), in_flight(schedule.size(), 0) {
    sim.busy.assign(schedule.size(), 0.0);
    sim.peak_in_flight.assign(schedule.size(), 0);
    sim.starts.resize(schedule.size());
  }
};

// Runs action `a` on rank r once its input is ready (at `ready`) and the
// rank is free.
void run_action(Run& run, int r, const PipeAction& a, double ready) {
  PipeSimulation& sim = run.sim;
  const double cost = cost_of(a, run.costs);
  const double start = std::max(ready, run.free_at[static_cast<size_t>(r)]);
  const double end = start + cost;
  sim.starts[static_cast<size_t>(r)].push_back(start);
  run.free_at[static_cast<size_t>(r)] = end;
  sim.busy[static_cast<size_t>(r)] += cost;
  int& held = run.in_flight[static_cast<size_t>(r)];
  if (a.op == PipeOp::Forward) {
    run.done[key(kActivation, a.stage, a.micro)] = end;
    sim.peak_in_flight[static_cast<size_t>(r)] = std::max(sim.peak_in_flight[static_cast<size_t>(r)], ++held);
  } else {
    if (a.op != PipeOp::BackwardWeight) run.done[key(kInputGrad, a.stage, a.micro)] = end;
    // The stage's inputs are held until its weight gradient is taken.
    if (a.op != PipeOp::BackwardInput) --held;
  }
  sim.makespan = std::max(sim.makespan, end);
}

// Runs rank r's actions in its order until one waits on an input not yet
// produced; whether it ran any.
bool advance_rank(Run& run, int r) {
  bool progress = false;
  const auto& order = run.schedule[static_cast<size_t>(r)];
  for (size_t& i = run.next[static_cast<size_t>(r)]; i < order.size(); ++i) {
    const PipeAction& a = order[i];
    const std::optional<WorkKey> needs = input_of(a, run.stages);
    double ready = 0.0;
    if (needs) {
      const auto it = run.done.find(*needs);
      if (it == run.done.end()) break;  // waits (on another rank, or on itself: a hang)
      ready = it->second;
    }
    run_action(run, r, a, ready);
    progress = true;
  }
  return progress;
}

// Every rank has run its whole order, else the schedule hangs.
void check_finished(const Run& run) {
  const int p = static_cast<int>(run.schedule.size());
  std::string stuck;
  for (int r = 0; r < p; ++r) {
    const size_t i = run.next[static_cast<size_t>(r)];
    const auto& order = run.schedule[static_cast<size_t>(r)];
    if (i < order.size()) stuck += str_cat(stuck.empty() ? "" : ", ", "rank ", r, " at ", to_string(order[i], true));
  }
  ST_CHECK(stuck.empty(), ConfigError, "pipeline schedule hangs: every remaining rank waits on work that "
           "cannot come (", stuck, ")");
}

// The ranks' mean idle time as a fraction of their busy time.
double mean_bubble(const PipeSimulation& sim, int p) {
  double bubble = 0.0;
  for (int r = 0; r < p; ++r) {
    const double busy = sim.busy[static_cast<size_t>(r)];
    bubble += (sim.makespan - busy) / busy;
  }
  return bubble / p;
}

}  // namespace

PipeSimulation simulate(const std::vector<std::vector<PipeAction>>& schedule, int stages_per_rank,
                        int micro_batches, const PipeCosts& costs) {
  const int p = static_cast<int>(schedule.size());
  const int stages = p * stages_per_rank;
  ST_CHECK(p >= 1 && stages_per_rank >= 1 && micro_batches >= 1, ConfigError,
           "simulate: needs ranks, stages per rank and micro-batches >= 1");
  check_complete(count_actions(schedule, stages, micro_batches), p, stages, micro_batches);

  Run run(schedule, stages, costs);
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < p; ++r) {
      if (advance_rank(run, r)) progress = true;
    }
  }
  check_finished(run);
  run.sim.bubble = mean_bubble(run.sim, p);
  return run.sim;
}

std::vector<StageRange> split_stages(const std::vector<int64_t>& unit_params, int stages,
                                     const std::vector<int64_t>& split) {
  const int n = static_cast<int>(unit_params.size());
  const int layers = n - 2;
  ST_CHECK(stages >= 1 && n >= stages, ConfigError, "distributed.pipeline_parallel=", stages,
           " stages need at least as many pieces of the model (the embedding, ", std::max(0, layers),
           " decoder layers, the head); lower distributed.pipeline_parallel");
  std::vector<StageRange> out;
  if (!split.empty()) {
    ST_CHECK(static_cast<int>(split.size()) == stages - 1, ConfigError, "distributed.pipeline_split has ",
             split.size(), " entries; ", stages, " stages need ", stages - 1,
             " (the first decoder layer of every stage after the first)");
    for (size_t i = 0; i < split.size(); ++i) {
      // A stage may hold the embedding or the head alone: 0 .. layers.
      ST_CHECK(split[i] >= 0 && split[i] <= layers && (i == 0 || split[i] > split[i - 1]), ConfigError,
               "distributed.pipeline_split[", i, "]=", split[i], ": the first layers of the stages must increase "
               "within the model's ", layers, " decoder layers (0 .. ", layers, ")");
    }
    int first = 0;
    for (const int64_t layer : split) {
      out.push_back({first, static_cast<int>(layer) + 1});
      first = static_cast<int>(layer) + 1;
    }
    out.push_back({first, n});
    return out;
  }
  // The smallest largest stage over the cuts of units [0, i) into k stages
  // (prefix sums; n and the stages are a few hundred at most).
  std::vector<int64_t> prefix(static_cast<size_t>(n) + 1, 0);
  for (int i = 0; i < n; ++i) prefix[static_cast<size_t>(i) + 1] = prefix[static_cast<size_t>(i)] + unit_params[static_cast<size_t>(i)];
  constexpr int64_t kNone = std::numeric_limits<int64_t>::max();
  std::vector<std::vector<int64_t>> best(static_cast<size_t>(stages) + 1, std::vector<int64_t>(static_cast<size_t>(n) + 1, kNone));
  std::vector<std::vector<int>> cut(best.size(), std::vector<int>(static_cast<size_t>(n) + 1, 0));
  best[0][0] = 0;
  for (int k = 1; k <= stages; ++k) {
    for (int i = k; i <= n; ++i) {
      for (int j = k - 1; j < i; ++j) {  // the last stage is units [j, i)
        if (best[static_cast<size_t>(k) - 1][static_cast<size_t>(j)] == kNone) continue;
        const int64_t worst = std::max(best[static_cast<size_t>(k) - 1][static_cast<size_t>(j)],
                                       prefix[static_cast<size_t>(i)] - prefix[static_cast<size_t>(j)]);
        // Ties keep the latest j: the earlier stages take what the best allows.
        if (worst <= best[static_cast<size_t>(k)][static_cast<size_t>(i)]) {
          best[static_cast<size_t>(k)][static_cast<size_t>(i)] = worst;
          cut[static_cast<size_t>(k)][static_cast<size_t>(i)] = j;
        }
      }
    }
  }
  out.resize(static_cast<size_t>(stages));
  for (int k = stages, i = n; k >= 1; --k) {
    const int j = cut[static_cast<size_t>(k)][static_cast<size_t>(i)];
    out[static_cast<size_t>(k) - 1] = {j, i};
    i = j;
  }
  return out;
}

}  // namespace shardtrain::parallel
