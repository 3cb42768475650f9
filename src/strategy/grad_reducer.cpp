#include "strategy/grad_reducer.h"

#include <ATen/ATen.h>

#include <deque>

namespace shardtrain::strategy::detail {

namespace {

struct Reduction {
  size_t flat = 0;
  comm::Work work;
  at::Tensor src;  // kept alive until the reduction finished
  at::Tensor out;
  bool direct = false;  // out is grad_shard itself
};

void drain_queue(std::deque<Reduction>& queue) noexcept {
  for (auto& r : queue) {
    try {
      r.work.wait();
    } catch (...) {
    }
  }
  queue.clear();
}

at::Tensor in_reduce_dtype(const FlatParam& fl) {
  return fl.reduce_dtype == fl.compute_dtype ? fl.grad_full : fl.grad_full.to(fl.reduce_dtype);
}

class ReduceScatterReducer final : public GradReducer {
 public:
  ReduceScatterReducer(std::vector<FlatParam>& flats, comm::Communicator& shard,
                       comm::Communicator* replica, WaitClock& clock)
      : flats_(flats), shard_(shard), clock_(clock), sums_(flats.size(), Sum::Empty) {
    if (replica != nullptr && replica->size() > 1) replica_ = replica;
  }

  bool keeps_whole_gradients() const override { return false; }
  bool reduces_every_micro_step(Accumulation accumulation) const override {
    return accumulation == Accumulation::Sharded;
  }

  void start_window() override { sums_.assign(flats_.size(), Sum::Empty); }

  bool needs_reduction(size_t f) const override {
    return sums_[f] == Sum::Empty || flats_[f].grad_full.defined();
  }

  void launch(size_t f) override {
    FlatParam& fl = flats_[f];
    at::NoGradGuard no_grad;
    Reduction r;
    r.flat = f;
    r.src = in_reduce_dtype(fl);
    // The window's first reduction writes into grad_shard when the dtypes allow.
    r.direct = sums_[f] == Sum::Empty && fl.reduce_dtype == fl.master_dtype;
    if (sums_[f] == Sum::Empty) sums_[f] = Sum::Launched;
    r.out = r.direct ? fl.grad_shard
                     : at::empty({fl.layout.shard_numel}, at::TensorOptions().dtype(fl.reduce_dtype));
    r.work = shard_.reduce_scatter(r.src, r.out,
                                   comm::ReduceScatterOptions().op(comm::ReduceOp::Avg).async(true));
    clock_.reduced_bytes += r.src.nbytes();
    // The whole gradient lives on only in r.src until the reduction is done.
    fl.grad_full = at::Tensor();
    for (auto& p : fl.params) p.var.mutable_grad() = at::Tensor();
    pending_.push_back(std::move(r));
    // Finished reductions are folded in at once; at most two stay in flight
    // with their whole-gradient buffers (bounded memory).
    while (!pending_.empty() && (pending_.front().work.is_completed() || pending_.size() > 2)) {
      complete_front();
    }
  }

  void complete_all() override {
    while (!pending_.empty()) complete_front();
    while (!replica_pending_.empty()) {
      Reduction r = std::move(replica_pending_.front());
      replica_pending_.pop_front();
      clock_.wait(r.work);
      fold(r);
    }
  }

  void drain() noexcept override {
    drain_queue(pending_);
    drain_queue(replica_pending_);
  }

 private:
  // What grad_shard holds in the current window.
  enum class Sum {
    Empty,     // nothing: no reduction launched
    Launched,  // a reduction is on its way (perhaps straight into it)
    Summed,    // the sum of the window's reductions folded so far
  };

  void complete_front() {
    Reduction r = std::move(pending_.front());
    pending_.pop_front();
    clock_.wait(r.work);
    if (replica_ != nullptr) {
      // Average the shard over the nodes too. Never waited for before
      // complete_all: a rank blocked on the inter-node group while its node
      // peers wait for it on the intra-node group could close a cycle of waits.
      r.src = at::Tensor();
      r.work = replica_->all_reduce(r.out, comm::AllReduceOptions().op(comm::ReduceOp::Avg).async(true));
      clock_.reduced_bytes += r.out.nbytes();
      replica_pending_.push_back(std::move(r));
      return;
    }
    fold(r);
  }

  void fold(const Reduction& r) {
    FlatParam& fl = flats_[r.flat];
    at::NoGradGuard no_grad;
    if (!r.direct) {
      if (sums_[r.flat] == Sum::Summed) {
        fl.grad_shard.add_(r.out);
      } else {
        fl.grad_shard.copy_(r.out);
      }
    }
    sums_[r.flat] = Sum::Summed;
  }

  std::vector<FlatParam>& flats_;
  comm::Communicator& shard_;
  comm::Communicator* replica_ = nullptr;
  WaitClock& clock_;
  std::vector<Sum> sums_;
  std::deque<Reduction> pending_;          // reduce-scatters in flight, in launch order
  std::deque<Reduction> replica_pending_;  // hybrid: inter-node averages in flight
};

class AllReduceReducer final : public GradReducer {
 public:
  AllReduceReducer(std::vector<FlatParam>& flats, comm::Communicator& group, WaitClock& clock)
      : flats_(flats), group_(group), clock_(clock), grads_(flats.size(), Whole::Accumulating) {}

  bool keeps_whole_gradients() const override { return true; }
  bool reduces_every_micro_step(Accumulation) const override { return false; }

  void start_window() override {}

  void clear_stale(size_t f) override {
    if (grads_[f] != Whole::Stale) return;
    flats_[f].grad_full.zero_();
    grads_[f] = Whole::Accumulating;
  }

  bool needs_reduction(size_t f) const override { return grads_[f] != Whole::Reduced; }

  void launch(size_t f) override {
    FlatParam& fl = flats_[f];
    at::NoGradGuard no_grad;
    Reduction r;
    r.flat = f;
    r.src = r.out = in_reduce_dtype(fl);
    r.work = group_.all_reduce(r.src, comm::AllReduceOptions().op(comm::ReduceOp::Avg).async(true));
    clock_.reduced_bytes += r.src.nbytes();
    grads_[f] = Whole::Reduced;
    pending_.push_back(std::move(r));
    while (!pending_.empty() && pending_.front().work.is_completed()) complete_front();
  }

  void complete_all() override {
    while (!pending_.empty()) complete_front();
    for (size_t f = 0; f < flats_.size(); ++f) {
      if (flats_[f].trainable) grads_[f] = Whole::Stale;
    }
  }

  void drain() noexcept override { drain_queue(pending_); }

 private:
  // What a flat's whole gradient buffer holds.
  enum class Whole {
    Accumulating,  // this window's gradients so far
    Reduced,       // a reduction of this window was launched from it
    Stale,         // the last window's average, to be cleared before reuse
  };

  void complete_front() {
    Reduction r = std::move(pending_.front());
    pending_.pop_front();
    clock_.wait(r.work);
    FlatParam& fl = flats_[r.flat];
    at::NoGradGuard no_grad;
    if (!r.src.is_same(fl.grad_full)) fl.grad_full.copy_(r.src);
    if (!fl.grad_shard_is_view) {
      fl.grad_shard.copy_(fl.grad_full.narrow(0, fl.layout.shard_offset, fl.layout.shard_numel));
    }
  }

  std::vector<FlatParam>& flats_;
  comm::Communicator& group_;
  WaitClock& clock_;
  std::vector<Whole> grads_;
  std::deque<Reduction> pending_;
};

}  // namespace

std::unique_ptr<GradReducer> make_reduce_scatter_reducer(std::vector<FlatParam>& flats,
                                                         comm::Communicator& shard,
                                                         comm::Communicator* replica,
                                                         WaitClock& clock) {
  return std::make_unique<ReduceScatterReducer>(flats, shard, replica, clock);
}

std::unique_ptr<GradReducer> make_all_reduce_reducer(std::vector<FlatParam>& flats,
                                                     comm::Communicator& group, WaitClock& clock) {
  return std::make_unique<AllReduceReducer>(flats, group, clock);
}

}  // namespace shardtrain::strategy::detail
