#include "strategy/unit_gather.h"

#include <ATen/ATen.h>

#include <chrono>

#include "shardtrain/core/error.h"
#include "strategy/flat_memory.h"

namespace shardtrain::strategy::detail {

void WaitClock::wait(const comm::Work& work) {
  if (work.is_completed()) {
    work.wait();
    return;
  }
  const auto start = std::chrono::steady_clock::now();
  work.wait();
  exposed_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void UnitGatherer::issue(size_t u) {
  Unit& unit = units_[u];
  ST_ASSERT(unit.state == Unit::State::Sharded, "unit gathered twice");
  at::NoGradGuard no_grad;
  for (size_t f : unit.flats) {
    FlatParam& fl = flats_[f];
    if (!has_storage(fl.full)) regrow_storage(fl.full);
    if (!fl.gather_src.is_same(fl.shard)) fl.gather_src.copy_(fl.shard);
    unit.gathers.push_back(comm_->all_gather(as_words(fl.gather_src), as_words(fl.full),
                                             comm::AllGatherOptions().async(true)));
    clock_.gathered_bytes += fl.full.nbytes();
  }
  unit.state = Unit::State::Gathering;
  max_in_flight_ = std::max(max_in_flight_, ++in_flight_);
}

void UnitGatherer::wait(size_t u) {
  Unit& unit = units_[u];
  for (auto& w : unit.gathers) clock_.wait(w);
  unit.gathers.clear();
  unit.state = Unit::State::Gathered;
  --in_flight_;
}

void UnitGatherer::gather_now(size_t u) {
  if (units_[u].state == Unit::State::Sharded) issue(u);
  if (units_[u].state == Unit::State::Gathering) wait(u);
}

void UnitGatherer::prefetch(long u) {
  if (u < 0 || units_[static_cast<size_t>(u)].state != Unit::State::Sharded) return;
  if (in_flight_ >= limit_) return;
  issue(static_cast<size_t>(u));
  ++prefetches_;
}

void UnitGatherer::reshard(size_t u) {
  Unit& unit = units_[u];
  if (unit.persistent || unit.state == Unit::State::Sharded) return;
  if (unit.state == Unit::State::Gathering) wait(u);
  for (size_t f : unit.flats) release_storage(flats_[f].full);
  unit.state = Unit::State::Sharded;
}

void UnitGatherer::refresh_from_shards() {
  at::NoGradGuard no_grad;
  std::vector<size_t> regather;
  for (size_t u = 0; u < units_.size(); ++u) {
    Unit& unit = units_[u];
    if (unit.state == Unit::State::Gathering) wait(u);
    if (!unit.persistent && unit.state == Unit::State::Sharded) continue;  // gathered on use
    if (comm_ == nullptr || comm_->size() == 1) {
      for (size_t f : unit.flats) {
        FlatParam& fl = flats_[f];
        if (fl.shard.data_ptr() != fl.full.data_ptr()) fl.full.copy_(fl.shard);
      }
      continue;
    }
    // Whole units: all-gather the updated shards (async, all issued first).
    unit.state = Unit::State::Sharded;
    issue(u);
    regather.push_back(u);
  }
  for (size_t u : regather) wait(u);
}

void UnitGatherer::record(size_t u) {
  if (frozen_ || position_[u] >= 0) return;
  position_[u] = static_cast<long>(order_.size());
  order_.push_back(u);
}

long UnitGatherer::next_in_order(size_t u, int direction) const {
  if (!frozen_ || position_[u] < 0) return -1;
  const long next = position_[u] + direction;
  if (next < 0 || next >= static_cast<long>(order_.size())) return -1;
  return static_cast<long>(order_[static_cast<size_t>(next)]);
}

}  // namespace shardtrain::strategy::detail
