// Unit gathering: each unit's parameters are Sharded (only this rank's
// shards exist), Gathering (all-gathers in flight) or Gathered (whole). The
// gatherer moves units between those states, prefetches the next unit in the
// recorded execution order, and bounds the all-gathers in flight.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "shardtrain/comm/communicator.h"
#include "strategy/flat_param.h"

namespace torch::nn {
class Module;
}

namespace shardtrain::strategy::detail {

/// Waits for collectives and adds the time the training thread was blocked
/// (not hidden by compute) to `exposed_s`.
struct WaitClock {
  double exposed_s = 0.0;
  // Bytes launched since the last finish (CommStats); counted where the
  // collectives are issued.
  int64_t reduced_bytes = 0;
  int64_t gathered_bytes = 0;
  void wait(const comm::Work& work);
};

struct Unit {
  enum class State { Sharded, Gathering, Gathered };

  std::string name;
  const torch::nn::Module* module = nullptr;
  int64_t numel = 0;
  std::vector<size_t> flats;  // indices into the strategy's flat parameters
  bool persistent = false;    // kept whole: the root, or every unit when parameters are not sharded
  State state = State::Gathered;
  std::vector<comm::Work> gathers;
  bool forward_seen = false;
  int trainable_params = 0;
  int ready = 0;  // trainable parameters whose gradient arrived in this backward
  // Frozen parameters (a LoRA base) are read in backward by nodes that give
  // no parameter gradient, so a unit that has them is freed only once
  // backward has left it (ShardedStrategy::release_finished_units).
  bool has_frozen = false;
  bool reshard_deferred = false;
  int64_t forward_begin = 0, forward_end = 0;  // ticks of the last forward outside backward
};

class UnitGatherer {
 public:
  /// `units` are final (set-up is done); `comm` is the shard group (null
  /// when nothing is sharded); at most
  /// `limit` unit gathers are in flight at once through prefetching.
  UnitGatherer(std::vector<Unit>& units, std::vector<FlatParam>& flats, comm::Communicator* comm,
               int64_t limit, WaitClock& clock)
      : units_(units), flats_(flats), comm_(comm), limit_(limit), clock_(clock),
        position_(units.size(), -1) {}

  /// Sharded -> Gathering: one async all-gather per flat of the unit.
  void issue(size_t u);
  /// Gathering -> Gathered.
  void wait(size_t u);
  /// Whatever the state: Gathered on return.
  void gather_now(size_t u);
  /// issue() if `u` is a unit, Sharded and the in-flight limit allows.
  void prefetch(long u);
  /// Gathered or Gathering -> Sharded, releasing the whole buffers; persistent
  /// units stay whole.
  void reshard(size_t u);
  /// Makes every unit use its updated shard: persistent units are gathered
  /// again (or copied from the shard when it is the whole buffer).
  void refresh_from_shards();

  /// Appends `u` to the execution order (first step only, once per unit).
  void record(size_t u);
  /// Stops recording; prefetching follows the recorded order from now on.
  void freeze_order() { frozen_ = true; }
  bool order_frozen() const { return frozen_; }
  /// The unit after (+1) or before (-1) `u` in the recorded order, or -1.
  long next_in_order(size_t u, int direction) const;
  /// Whether `u` is the last unit of the recorded (frozen) order.
  bool last_in_order(size_t u) const {
    return frozen_ && position_[u] >= 0 && position_[u] + 1 == static_cast<long>(order_.size());
  }

  int64_t prefetches() const { return prefetches_; }
  int max_in_flight() const { return max_in_flight_; }

 private:
  std::vector<Unit>& units_;
  std::vector<FlatParam>& flats_;
  comm::Communicator* comm_;
  int64_t limit_;
  WaitClock& clock_;
  std::vector<size_t> order_;
  std::vector<long> position_;  // unit -> index in order_, -1 if absent
  bool frozen_ = false;
  int in_flight_ = 0;
  int max_in_flight_ = 0;
  int64_t prefetches_ = 0;
};

}  // namespace shardtrain::strategy::detail
