// Collectives among the ranks of one host through one shared mapping.
//
// Over loopback TCP every byte is copied into the kernel by the sender and
// out again by the receiver, with the protocol's work on top, all on the
// cores that also compute. Here each rank has a staging area in a mapping
// every rank of the group shares and a sequence word it advances when it has
// finished a phase: a rank copies its part into its own area, and its peers
// copy it out (or combine it into theirs) once its word says it is there.
// Waits spin a little, then sleep on the word (a futex) with a short bound,
// so a deadline that passes or a peer process that exits is noticed within
// milliseconds.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/detail.h"

namespace shardtrain::comm::detail {

class ShmChannel {
 public:
  /// Bytes of each rank's staging area (SHARDTRAIN_SHM_STAGE_BYTES sets
  /// another, rounded down to whole cache lines in each half; larger
  /// transfers go through it in pieces).
  static constexpr size_t kStageBytes = size_t{8} << 20;

  /// Every rank of `oc`'s group calls this together; it agrees over the
  /// group's TCP path. Returns null (every rank alike) when some rank is on
  /// another host (boot id and namespaces differ), when SHARDTRAIN_SHM=0,
  /// or when the mapping cannot be made on some rank.
  static std::unique_ptr<ShmChannel> open(const OpContext& oc);
  ~ShmChannel();
  ShmChannel(const ShmChannel&) = delete;
  ShmChannel& operator=(const ShmChannel&) = delete;

  /// Memory every rank of the group can read and write: `bytes` for each
  /// rank, zero-filled, in one segment all of them map. Every rank calls it
  /// together; returns null on every rank alike when some rank cannot make
  /// or map it (a full /dev/shm). The memory lives while the returned
  /// object does, whether or not the channel still exists.
  struct Region;
  std::shared_ptr<Region> allocate(const OpContext& oc, size_t bytes);

  /// In place: every rank's `buf` (numel elements) receives the reduction
  /// of all of them, the same bits on every rank. When every rank's `buf`
  /// lies at the same place in memory from allocate(), each rank reduces
  /// its shard_range reading the peers' buffers where they are and writes
  /// the result into every rank's buffer: no staging.
  void all_reduce(const OpContext& oc, void* buf, int64_t numel, DType dtype, ReduceOp op);
  /// In place: `buf` (numel elements) holds this rank's shard_range. When
  /// every rank's `buf` lies at the same place in memory from allocate(),
  /// each rank copies the peers' shards out of their buffers: no staging.
  void all_gather(const OpContext& oc, void* buf, int64_t numel, DType dtype);
  /// `out` receives the reduction of every rank's shard_range of `in`;
  /// `out` may be that range of `in` itself. When every rank's `in` lies at
  /// the same place in memory from allocate(), each rank reads its range
  /// from the peers' inputs where they are: no staging.
  void reduce_scatter(const OpContext& oc, const void* in, void* out, int64_t numel, DType dtype,
                      ReduceOp op);
  /// Each rank's part plan.send[p] of `in` reaches rank p's `out` at its
  /// plan.recv[rank]: staged in pieces, every pair at once, in
  /// ceil(plan.most / slot) steps on every rank (none when every part is
  /// empty). `in` and `out` do not overlap.
  void all_to_all(const OpContext& oc, const char* in, char* out, const AllToAllPlan& plan, DType dtype);
  /// How many all_reduce, reduce_scatter and all_gather calls of at least
  /// kInPlaceBytes took the in-place path, and how many were staged because
  /// some rank's buffer was not in allocated memory (or not at the same
  /// place). Smaller ones are staged without asking and counted in neither.
  int64_t in_place_ops() const { return in_place_ops_.load(std::memory_order_relaxed); }
  int64_t staged_ops() const { return staged_ops_.load(std::memory_order_relaxed); }
  /// `buf` (numel elements) on every rank receives group rank `root`'s.
  void broadcast(const OpContext& oc, void* buf, int64_t numel, DType dtype, int root);
  /// Returns once every rank of the group has entered it.
  void barrier(const OpContext& oc);

 private:
  ShmChannel(char* base, size_t bytes, size_t stage_bytes, int rank, int size, std::vector<int64_t> pids);
  std::atomic<uint32_t>& word(int r) const;
  std::atomic<uint32_t>& closed(int r) const;  // set when rank r's channel is destroyed
  std::atomic<uint32_t>& sleepers(int r) const;  // peers asleep (or about to be) on rank r's word
  // What buffer rank r's current all_reduce reduces: the id of its Region
  // (0: none) and the buffer's byte offset in it.
  std::atomic<uint64_t>& region_id(int r) const;
  std::atomic<int64_t>& region_offset(int r) const;
  char* stage(int r) const;  // after the header of size_ lines
  // How a buffer goes through the slots: piece k is elements
  // [k * per, (k + 1) * per) of every rank's shard_range of `numel`.
  struct Pieces {
    int64_t numel;
    size_t es;      // bytes per element
    int64_t per;    // elements per slot
    int64_t count;  // pieces
    ShardRange mine;
    // Piece k of range r: its first byte in the buffer, and its elements.
    int64_t offset_of(const ShardRange& r, int64_t k) const { return (r.offset + k * per) * static_cast<int64_t>(es); }
    int64_t elements_in(const ShardRange& r, int64_t k) const;
  };
  Pieces pieces(int64_t numel, DType dtype) const;
  size_t slot_bytes() const;
  // Slot p of the set that piece k uses in rank `owner`'s area.
  char* slot(int owner, int64_t k, int p) const;
  template <typename First, typename Step>
  void pipeline(const OpContext& oc, int64_t steps, const First& first, const Step& step);
  template <typename F>
  void each_peer(const Pieces& pc, int64_t k, const F& f) const;
  // Piece k of each peer's range of `data`: into this rank's slot for that
  // peer, or out of that peer's own slot.
  void stage_for_peers(const Pieces& pc, int64_t k, const char* data) const;
  void copy_from_peers(const Pieces& pc, int64_t k, char* data) const;
  // out = this rank's values (`own`) combined with each peer p's at
  // peer(p) (count elements each): the order both all-reduce paths and
  // reduce_scatter share, so they give the same bits.
  template <typename Peer>
  void combine(const void* own, void* out, int64_t count, DType dtype, ReduceOp op, const Peer& peer) const;
  /// Most bytes per slot of all_reduce, reduce_scatter and all_gather's
  /// pieces: small enough to stay in cache from the rank that stages one to
  /// the rank that reads it.
  static constexpr size_t kPieceBytes = size_t{256} << 10;
  /// All-reduces, reduce-scatters and all-gathers of at least this many
  /// bytes first agree whether every rank's buffer is in allocated memory
  /// (an extra barrier, which smaller ones, staged in cache anyway, do not
  /// pay).
  static constexpr size_t kInPlaceBytes = size_t{256} << 10;
  /// Elements combined per pass of the in-place path: the rank's piece and
  /// the result stay in cache while they are copied to the peers.
  static constexpr size_t kInPlaceChunkBytes = size_t{64} << 10;
  // Every rank says which allocation and offset its buffer is at and waits
  // for the others: the region holding `buf` (and the offset) when every
  // rank's is at the same place of one allocation, else null on every rank
  // alike. Counts the answer in in_place_ops() or staged_ops(). Buffers
  // under kInPlaceBytes get null at once, uncounted (every rank alike: the
  // sizes agree).
  std::shared_ptr<Region> agree_on_region(const OpContext& oc, const char* buf, size_t bytes, int64_t* offset);
  // The in-place paths; false (on every rank alike) when the buffers are
  // not all at the same place of one allocation.
  bool all_reduce_in_place(const OpContext& oc, char* buf, int64_t numel, DType dtype, ReduceOp op);
  bool reduce_scatter_in_place(const OpContext& oc, const char* in, char* out, int64_t numel, DType dtype,
                               ReduceOp op);
  bool all_gather_in_place(const OpContext& oc, char* buf, int64_t numel, DType dtype);
  std::shared_ptr<Region> region_holding(const char* buf, size_t bytes) const;
  void publish();
  // A wait spins (up to 100 µs, unless the ranks outnumber the CPUs) before
  // it sleeps: a peer that is about to publish is usually microseconds away,
  // and waking from a futex costs tens of them.
  void wait_for(const OpContext& oc, int p, uint32_t phase) const;  // until rank p has published `phase`
  void wait_all(const OpContext& oc, uint32_t phase) const;

  char* base_;
  size_t bytes_;
  size_t stage_bytes_;
  int rank_;
  int size_;
  std::vector<int64_t> pids_;  // per group rank, for noticing a peer that exited
  uint32_t phase_ = 0;         // the last phase this rank published
  bool may_spin_ = false;      // not with more ranks than CPUs
  uint64_t regions_made_ = 0;  // allocate() calls so far, the same on every rank
  mutable std::mutex regions_mutex_;  // allocate() runs on the communication thread, releases anywhere
  mutable std::vector<std::weak_ptr<Region>> regions_;
  std::atomic<int64_t> in_place_ops_{0};
  std::atomic<int64_t> staged_ops_{0};
};

struct ShmChannel::Region {
  Region(char* base, size_t per_rank, int ranks, int rank, uint64_t id)
      : base(base), per_rank(per_rank), ranks(ranks), rank(rank), id(id) {}
  ~Region();
  Region(const Region&) = delete;
  Region& operator=(const Region&) = delete;
  char* of(int r) const { return base + static_cast<size_t>(r) * per_rank; }
  char* mine() const { return of(rank); }
  char* const base;  // this process's mapping of every rank's part
  const size_t per_rank;
  const int ranks;
  const int rank;
  const uint64_t id;
};

}  // namespace shardtrain::comm::detail
