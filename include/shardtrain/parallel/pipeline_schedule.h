// Pipeline schedules as data: which forward and backward work each rank of
// a pipeline does, in which order, for m micro-batches over p ranks.
//
// A model's layers are cut into S = p * v contiguous stages; rank r holds
// stages r, r + p, ..., r + (v - 1) p (v = stages per rank, 1 except for
// the interleaved schedule), so an activation leaving stage s always goes to
// the next rank. The schedules (per rank, in order):
//
//   gpipe             every forward, then every backward
//   1f1b              p - r - 1 forwards to warm up, then one forward and one
//                     backward alternately, then the remaining backwards
//                     (PipeDream-Flush): at most p - r micro-batches in flight
//   interleaved_1f1b  1f1b over v stages per rank, the micro-batches taken in
//                     rounds of p through each of the rank's stages in turn
//                     (Megatron-LM's virtual pipeline): the bubble is 1/v of 1f1b's
//   zero_bubble       1f1b with each backward split into its input-gradient
//                     half (B, on the critical path) and its weight-gradient
//                     half (W, deferred into what would be idle time):
//                     Qi et al. 2024's ZB-H1, 1f1b's peak activation memory
//
// An executor derives the transfers from the order alone: before a forward
// of stage s > 0 it receives the activation from stage s - 1's rank, after
// it sends to stage s + 1's rank; backwards the other way. simulate() runs a
// schedule against those dependencies: it proves that every receive has its
// send and that no order waits on itself (a hang), and measures the bubble.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "shardtrain/core/enum_names.h"

namespace shardtrain::parallel {

enum class PipelineSchedule { GPipe, OneFOneB, Interleaved1F1B, ZeroBubble };
ST_ENUM_NAMES(PipelineSchedule, {PipelineSchedule::GPipe, "gpipe"}, {PipelineSchedule::OneFOneB, "1f1b"},
              {PipelineSchedule::Interleaved1F1B, "interleaved_1f1b"},
              {PipelineSchedule::ZeroBubble, "zero_bubble"});

/// One piece of work: a stage's forward, its whole backward, or (zero
/// bubble) the input-gradient or weight-gradient half of it.
enum class PipeOp { Forward, Backward, BackwardInput, BackwardWeight };

struct PipeAction {
  PipeOp op = PipeOp::Forward;
  int stage = 0;  // global stage index, 0 .. p * v - 1
  int micro = 0;  // micro-batch, 0 .. m - 1
  bool operator==(const PipeAction& o) const { return op == o.op && stage == o.stage && micro == o.micro; }
};

/// "F3" (stage left out) or "F3@s5"; B, I (input gradient), W (weight gradient).
std::string to_string(const PipeAction& a, bool with_stage = false);

/// The rank holding `stage` when `ranks` ranks hold `stages_per_rank` each.
inline int stage_rank(int stage, int ranks) { return stage % ranks; }

/// Each rank's compute actions, in order (index = rank). ConfigError for
/// ranks or micro_batches < 1, stages_per_rank < 1 (or > 1 for a schedule
/// that is not interleaved), and, for interleaved_1f1b, micro-batches that
/// do not make floor(m / p) equal rounds (m = 9 over p = 4).
std::vector<std::vector<PipeAction>> pipeline_schedule(PipelineSchedule schedule, int ranks, int micro_batches,
                                                       int stages_per_rank = 1);

/// Time units of each kind of work: a whole backward is B = I + W.
struct PipeCosts {
  double forward = 1.0, backward_input = 1.0, backward_weight = 1.0;
};

struct PipeSimulation {
  /// When the last action ends.
  double makespan = 0.0;
  /// Per rank: busy time, and the most micro-batches whose forward ran on
  /// it but whose backward (weight half, under zero bubble) had not: the
  /// activations it holds.
  std::vector<double> busy;
  std::vector<int> peak_in_flight;
  /// Idle time over busy time, averaged over ranks: (p - 1) / m for 1f1b.
  double bubble = 0.0;
  /// Per rank, each action's start, in schedule order.
  std::vector<std::vector<double>> starts;
};

/// Runs `schedule` (per rank, as pipeline_schedule gives it, or any other
/// order) with each action starting once its rank is free and its inputs
/// exist: a forward after the previous stage's forward of that micro-batch,
/// an input gradient after the next stage's (the last stage: after its own
/// forward), a weight gradient after its stage's input gradient. Transfers
/// take no time. ConfigError naming the stuck ranks' next actions when the
/// orders wait on each other (the schedule would hang), or when an action
/// is missing, repeated, or on a rank that does not hold its stage.
PipeSimulation simulate(const std::vector<std::vector<PipeAction>>& schedule, int stages_per_rank,
                        int micro_batches, const PipeCosts& costs = {});

// ---- stages -------------------------------------------------------------------------------

/// A stage: units [first, end) of the model, in order. The units are the
/// token embedding (unit 0), the decoder layers (unit 1 + layer index) and
/// the head with the final norm (the last unit).
struct StageRange {
  int first = 0, end = 0;
  bool operator==(const StageRange& o) const { return first == o.first && end == o.end; }
};

/// Cuts the units, whose parameter counts `unit_params` gives in order, into
/// `stages` contiguous non-empty stages. Without `split`: the cut whose
/// largest stage holds the fewest parameters (the embedding and the head
/// weigh what they hold, like any layer); on ties the earlier stages take more.
/// With `split` (distributed.pipeline_split): the first decoder layer of
/// each stage after the first, stages - 1 increasing layer indices; the
/// embedding goes with the first stage and the head with the last.
/// ConfigError for fewer units than stages, or a split of the wrong length,
/// not increasing, or outside the layers (naming it).
std::vector<StageRange> split_stages(const std::vector<int64_t>& unit_params, int stages,
                                     const std::vector<int64_t>& split = {});

}  // namespace shardtrain::parallel
