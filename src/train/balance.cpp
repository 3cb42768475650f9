// LoadBalancer: shares of the global batch from measured speeds.
#include "train/balance.h"

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <numeric>

#include "shardtrain/core/error.h"

namespace shardtrain::train::detail {

namespace {

std::vector<double> normalised(std::vector<double> w) {
  const double sum = std::accumulate(w.begin(), w.end(), 0.0);
  for (double& x : w) x /= sum;
  return w;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace

std::vector<int64_t> split_counts(const std::vector<double>& shares, int64_t total) {
  ST_CHECK(!shares.empty() && total >= 0, InvalidArgument, "split_counts: ", shares.size(), " shares of ", total);
  const double sum = std::accumulate(shares.begin(), shares.end(), 0.0);
  ST_CHECK(sum > 0.0 && std::isfinite(sum), InvalidArgument, "split_counts: shares sum to ", sum);
  std::vector<int64_t> counts(shares.size());
  std::vector<double> remainder(shares.size());
  int64_t given = 0;
  for (size_t k = 0; k < shares.size(); ++k) {
    const double exact = static_cast<double>(total) * shares[k] / sum;
    counts[k] = static_cast<int64_t>(std::floor(exact));
    remainder[k] = exact - static_cast<double>(counts[k]);
    given += counts[k];
  }
  std::vector<size_t> order(shares.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return remainder[a] > remainder[b]; });
  for (size_t i = 0; given < total; i = (i + 1) % order.size(), ++given) ++counts[order[i]];
  return counts;
}

std::vector<int64_t> micro_step_sizes(int64_t global, int64_t accumulate) {
  ST_CHECK(global >= 0 && accumulate > 0, InvalidArgument, "micro_step_sizes: ", global, " rows over ", accumulate,
           " micro-steps");
  std::vector<int64_t> sizes(static_cast<size_t>(accumulate), global / accumulate);
  for (int64_t j = 0; j < global % accumulate; ++j) ++sizes[static_cast<size_t>(j)];
  return sizes;
}

LoadBalancer::LoadBalancer(std::vector<double> shares, BalanceOptions options)
    : shares_(std::move(shares)),
      speeds_(shares_.size(), 0.0),
      window_samples_(shares_.size(), 0.0),
      window_compute_(shares_.size(), 0.0),
      named_(shares_.size(), false),
      options_(options) {
  ST_CHECK(!shares_.empty(), InvalidArgument, "LoadBalancer: no ranks");
  for (double s : shares_) {
    ST_CHECK(s > 0.0 && std::isfinite(s), ConfigError, "distributed.shares: ", s,
             " is not a positive weight; give each data-parallel rank a weight > 0");
  }
  shares_ = normalised(shares_);
}

double LoadBalancer::predicted_time(const std::vector<double>& shares) const {
  std::vector<double> rows(shares.size(), 0.0);
  for (const int64_t size : micro_step_sizes(options_.global, options_.accumulate)) {
    const std::vector<int64_t> counts = split_counts(shares, size);
    for (size_t k = 0; k < rows.size(); ++k) rows[k] += static_cast<double>(counts[k]);
  }
  double t = 0.0;
  for (size_t k = 0; k < rows.size(); ++k) t = std::max(t, rows[k] / speeds_[k]);
  return t;
}

double LoadBalancer::slowdown(int rank) const {
  // Against the other ranks: with two, a rank half as fast as its peer is 2x
  // slower (a median over both would say 1.5x).
  std::vector<double> measured;
  for (size_t k = 0; k < speeds_.size(); ++k) {
    if (speeds_[k] > 0.0 && static_cast<int>(k) != rank) measured.push_back(speeds_[k]);
  }
  const double own = speeds_.at(static_cast<size_t>(rank));
  if (measured.empty() || own <= 0.0) return 1.0;
  return median(measured) / own;
}

std::pair<int64_t, int64_t> LoadBalancer::rows(int64_t j, int rank) const {
  const std::vector<int64_t> sizes = micro_step_sizes(options_.global, options_.accumulate);
  int64_t first = std::accumulate(sizes.begin(), sizes.begin() + j, int64_t{0});
  const std::vector<int64_t> counts = split_counts(shares_, sizes.at(static_cast<size_t>(j)));
  first = std::accumulate(counts.begin(), counts.begin() + rank, first);
  return {first, counts.at(static_cast<size_t>(rank))};
}

BalanceEvents LoadBalancer::observe(int64_t step, const std::vector<double>& samples,
                                    const std::vector<double>& compute_s) {
  ST_CHECK(samples.size() == shares_.size() && compute_s.size() == shares_.size(), InvalidArgument,
           "LoadBalancer::observe: ", samples.size(), " ranks' samples for ", shares_.size(), " ranks");
  // A rank that computed nothing this step adds nothing (it keeps its last
  // speed when its whole window was empty).
  for (size_t k = 0; k < shares_.size(); ++k) {
    if (samples[k] <= 0.0 || compute_s[k] <= 0.0) continue;
    window_samples_[k] += samples[k];
    window_compute_[k] += compute_s[k];
  }
  BalanceEvents events;
  if (options_.rebalance_every <= 0 || step % options_.rebalance_every != 0) return events;
  for (size_t k = 0; k < shares_.size(); ++k) {
    if (window_compute_[k] > 0.0) speeds_[k] = window_samples_[k] / window_compute_[k];
    window_samples_[k] = window_compute_[k] = 0.0;
  }
  const bool all_measured = std::all_of(speeds_.begin(), speeds_.end(), [](double s) { return s > 0.0; });
  if (all_measured) {
    const std::vector<double> planned = normalised(speeds_);
    const double gain = predicted_time(shares_) / predicted_time(planned);
    if (gain >= 1.0 + options_.min_gain) {
      shares_ = planned;
      events.replanned = true;
      events.predicted_gain = gain;
    }
  }
  // Named once when slower than the median by the factor; recovered when
  // back within half of its excess (no flapping at the boundary).
  const double recover_below = 1.0 + 0.5 * (options_.straggler_factor - 1.0);
  for (int k = 0; k < ranks(); ++k) {
    const double slow = slowdown(k);
    if (!named_[k] && slow >= options_.straggler_factor) {
      named_[k] = true;
      events.slowed.push_back(k);
    } else if (named_[k] && slow < recover_below) {
      named_[k] = false;
      events.recovered.push_back(k);
    }
  }
  return events;
}

std::string LoadBalancer::to_json() const {
  return nlohmann::json{{"shares", shares_}, {"speeds", speeds_}}.dump();
}

bool LoadBalancer::restore(const std::string& json) {
  const nlohmann::json j = nlohmann::json::parse(json);
  auto shares = j.at("shares").get<std::vector<double>>();
  auto speeds = j.at("speeds").get<std::vector<double>>();
  if (shares.size() != shares_.size() || speeds.size() != shares_.size()) return false;
  for (double s : shares) {
    if (!(s > 0.0) || !std::isfinite(s)) return false;
  }
  shares_ = std::move(shares);
  speeds_ = std::move(speeds);
  return true;
}

}  // namespace shardtrain::train::detail
