// Gradient reduction of the sharded strategies, behind one small interface
// chosen once at set-up:
//
//   reduce-scatter  (full_shard, shard_grad_op, hybrid_shard): each flat's
//                   whole gradient is reduce-scattered into this rank's
//                   gradient shard and then freed; under hybrid_shard the
//                   shard is averaged over the nodes too.
//   all-reduce      (zero1, no_shard): whole gradients are all-reduced and
//                   kept between steps; this rank's slice is the optimizer's.
//
// Reductions run asynchronously in launch order; launch order must be the
// same on every rank (the strategy launches from backward hooks, whose order
// is the same everywhere, and from finish in plan order).
#pragma once

#include <memory>
#include <vector>

#include "shardtrain/comm/communicator.h"
#include "shardtrain/strategy/options.h"
#include "strategy/flat_param.h"
#include "strategy/unit_gather.h"

namespace shardtrain::strategy::detail {

class GradReducer {
 public:
  virtual ~GradReducer() = default;

  /// Whether whole gradients stay allocated between steps (and so must be
  /// cleared by the first gradient of the next window: clear_stale()).
  virtual bool keeps_whole_gradients() const = 0;
  /// Whether every micro-step's gradients are reduced in backward, not only
  /// the last one's (sharded accumulation frees whole gradients at once).
  virtual bool reduces_every_micro_step(Accumulation accumulation) const = 0;

  /// A new accumulation window begins: forget the last one's sums.
  virtual void start_window() = 0;
  /// Before the first gradient of a window reaches flat f's whole buffer
  /// (accumulator pre-hooks), and before finish reduces a flat that no
  /// gradient reached: launch() expects it done.
  virtual void clear_stale(size_t f) {}
  /// Whether finish must still reduce flat f (no hook reduced its latest
  /// gradients in this window).
  virtual bool needs_reduction(size_t f) const = 0;
  /// Starts reducing flat f's whole gradient (averaged over ranks).
  virtual void launch(size_t f) = 0;
  /// Waits for every reduction and leaves each flat's result in grad_shard;
  /// the window is closed.
  virtual void complete_all() = 0;
  /// After an error: waits for what was issued without rethrowing, forgets it.
  virtual void drain() noexcept = 0;
};

/// `shard` is the group gradients are scattered over; `replica`, when
/// hybrid, the group each shard is averaged over afterwards (may be null).
std::unique_ptr<GradReducer> make_reduce_scatter_reducer(std::vector<FlatParam>& flats,
                                                         comm::Communicator& shard,
                                                         comm::Communicator* replica,
                                                         WaitClock& clock);

/// Whole gradients averaged over `group`.
std::unique_ptr<GradReducer> make_all_reduce_reducer(std::vector<FlatParam>& flats,
                                                     comm::Communicator& group, WaitClock& clock);

}  // namespace shardtrain::strategy::detail
