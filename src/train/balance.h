// Measured load balancing (distributed.load_balance: measured): how many of
// each micro-step's samples every data-parallel rank computes, planned from
// the ranks' measured speeds. The step's samples, their order and the loss
// normalisation (by the targets of the whole global batch) never change;
// only which rank computes which rows does, so training is the same
// computation as under `even`, up to the order of fp32 sums.
//
// Rows of a step: micro-step j holds sizes[j] consecutive rows of the global
// batch (sizes from micro_step_sizes), and rank k takes counts[k] of them
// after ranks 0..k-1 (counts from split_counts over the shares). With equal
// shares and a global batch of micro x accumulate x ranks this is exactly
// the even split.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace shardtrain::train::detail {

/// `total` items over weights `shares` (positive, any scale): each rank's
/// floor of its exact part, the rest one each to the largest remainders
/// (ties to the lower rank). The counts sum to `total`.
std::vector<int64_t> split_counts(const std::vector<double>& shares, int64_t total);

/// `global` rows over `accumulate` micro-steps: global / accumulate each,
/// the first global % accumulate one more.
std::vector<int64_t> micro_step_sizes(int64_t global, int64_t accumulate);

struct BalanceOptions {
  int64_t rebalance_every = 20;  // steps between re-plans
  double min_gain = 0.05;        // least predicted step-time gain worth a re-plan
  double straggler_factor = 1.5; // slower than the median by this: named
  // The step's rows (global batch, micro-steps), which rows() splits; a
  // re-plan is judged by the whole rows each rank would compute, so one that
  // moves no row (or too few to matter) is not made.
  int64_t global = 0;
  int64_t accumulate = 1;
};

/// What happened at a step's observation, for the log.
struct BalanceEvents {
  bool replanned = false;
  double predicted_gain = 1.0;  // old predicted step time / new, when re-planned
  std::vector<int> slowed;      // ranks newly slower than the median by straggler_factor
  std::vector<int> recovered;   // named ranks back within the factor
};

class LoadBalancer {
 public:
  /// `shares`: each data-parallel rank's starting weight (normalised here).
  LoadBalancer(std::vector<double> shares, BalanceOptions options);

  int ranks() const { return static_cast<int>(shares_.size()); }
  /// Each rank's fraction of the global batch (sums to 1).
  const std::vector<double>& shares() const { return shares_; }
  /// Samples per compute second of each rank over the last re-plan window
  /// (0: not measured yet).
  const std::vector<double>& speeds() const { return speeds_; }
  /// The median speed of the other ranks over this rank's (1 when unmeasured).
  double slowdown(int rank) const;

  /// Micro-step j's first row (within the step's options.global rows) and
  /// row count for `rank`.
  std::pair<int64_t, int64_t> rows(int64_t j, int rank) const;

  /// After step `step` (1-based): each rank's samples and compute seconds.
  /// At every rebalance_every-th step the speeds become each rank's samples
  /// over its compute seconds since the last such step (a window average:
  /// one step's timing noise would make equal ranks look unequal), the
  /// shares are re-planned in proportion to them when that predicts a step
  /// time at least min_gain shorter, and stragglers and recoveries are named.
  BalanceEvents observe(int64_t step, const std::vector<double>& samples, const std::vector<double>& compute_s);

  /// For checkpoints: shares and speeds; restore() takes them back (false,
  /// and nothing changed, when their rank count is not this balancer's).
  std::string to_json() const;
  bool restore(const std::string& json);

 private:
  // Step time, up to a constant, when each rank computes its rows under
  // `shares` at the measured speeds: the slowest rank's.
  double predicted_time(const std::vector<double>& shares) const;

  std::vector<double> shares_, speeds_;
  std::vector<double> window_samples_, window_compute_;  // since the last re-plan step
  std::vector<bool> named_;  // ranks named as stragglers, until they recover
  BalanceOptions options_;
};

}  // namespace shardtrain::train::detail
