#include "comm/shm.h"

#include <fcntl.h>
#include <sched.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "core/file.h"
#include "shardtrain/core/error.h"

namespace shardtrain::comm::detail {

namespace {

constexpr size_t kLine = 64;     // one sequence word per cache line
constexpr size_t kPage = 4096;   // the staging areas start on a page

// The header: a line per rank (its sequence word and closed flag), rounded
// up to whole pages, so the first staging area starts after the last line.
size_t header_bytes(int ranks) { return (static_cast<size_t>(ranks) * kLine + kPage - 1) / kPage * kPage; }

uint64_t fnv1a(const std::string& s, uint64_t h = 1469598103934665603ull) {
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

// What ranks that can share memory have in common: the same kernel boot and
// the same namespaces (network namespaces are how tests make separate hosts,
// and those must talk over their network). Empty when unknown.
std::string host_identity() {
  std::string id, why;
  if (!::shardtrain::detail::read_regular_file("/proc/sys/kernel/random/boot_id", 4096, &id, &why) ||
      id.empty()) {
    return {};
  }
  for (const char* ns : {"/proc/self/ns/net", "/proc/self/ns/ipc", "/proc/self/ns/pid", "/proc/self/ns/mnt"}) {
    struct stat st {};
    if (stat(ns, &st) != 0) return {};
    id += ":" + std::to_string(st.st_dev) + "/" + std::to_string(st.st_ino);
  }
  return id;
}

bool disabled_by_env() {
  const char* v = std::getenv("SHARDTRAIN_SHM");
  return v != nullptr && std::string(v) == "0";
}

void wake_all(std::atomic<uint32_t>& word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

// Whether the process is gone (or a zombie waiting to be reaped).
bool exited(int64_t pid) {
  if (kill(static_cast<pid_t>(pid), 0) != 0) return errno == ESRCH;
  std::string line, why;
  if (!::shardtrain::detail::read_regular_file("/proc/" + std::to_string(pid) + "/stat", 1 << 16, &line,
                                               &why)) {
    return false;
  }
  const size_t close = line.rfind(')');
  return close != std::string::npos && close + 2 < line.size() && line[close + 2] == 'Z';
}

// The TCP path's all-gather of one int64 per rank per field (setup only).
std::vector<int64_t> exchange(const OpContext& oc, const std::vector<int64_t>& mine) {
  const int64_t k = static_cast<int64_t>(mine.size());
  std::vector<int64_t> all(static_cast<size_t>(k * oc.size));
  std::copy(mine.begin(), mine.end(), all.begin() + oc.rank * k);
  ring_all_gather(oc, all.data(), k * oc.size, DType::Int64);
  return all;
}

// Maps segment `name` of `bytes` on every rank of the group: rank 0 makes
// it, the others open it once it exists, and rank 0 removes the name once
// every rank has tried, so nothing outlives the job. Null on every rank
// alike when some rank could not.
char* map_segment(const OpContext& oc, const std::string& name, size_t bytes) {
  char* base = nullptr;
  const auto map = [&](int flags) {
    const int fd = shm_open(name.c_str(), flags, 0600);
    if (fd < 0) return false;
    // Reserved, not just sized: a full /dev/shm then fails here (and the
    // caller goes without) instead of as SIGBUS on a later write.
    bool ok = (flags & O_CREAT) == 0 || posix_fallocate(fd, 0, static_cast<off_t>(bytes)) == 0;
    if (ok) {
      void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      ok = p != MAP_FAILED;
      if (ok) base = static_cast<char*>(p);
    }
    close(fd);
    return ok;
  };
  int64_t made = oc.rank == 0 ? map(O_CREAT | O_EXCL | O_RDWR) : 1;
  made = exchange(oc, {made})[0];
  int64_t mapped = made != 0 && (oc.rank == 0 || map(O_RDWR)) ? 1 : 0;
  const std::vector<int64_t> maps = exchange(oc, {mapped});
  if (oc.rank == 0) shm_unlink(name.c_str());  // also after a half-made segment
  const bool everyone = std::all_of(maps.begin(), maps.end(), [](int64_t m) { return m != 0; });
  if (!everyone && base != nullptr) {
    munmap(base, bytes);
    base = nullptr;
  }
  return base;
}

std::atomic<uint64_t> g_segments{0};

}  // namespace

std::unique_ptr<ShmChannel> ShmChannel::open(const OpContext& setup) {
  OpContext oc = setup;
  oc.phase = 7;  // slots of its own: never those of a numbered op
  const int n = oc.size;
  const std::string host = host_identity();
  const bool usable = n > 1 && !disabled_by_env() && !host.empty();
  // A rank that cannot take part offers a key no other rank has.
  const int64_t key = usable ? static_cast<int64_t>(fnv1a(host)) : -1 - oc.rank;
  const int64_t nonce = oc.rank == 0 ? static_cast<int64_t>(++g_segments) : 0;
  // At least a cache line per rank's slot in each of a staging area's two sets.
  const int64_t stage = byte_count_from_env("SHARDTRAIN_SHM_STAGE_BYTES", static_cast<int64_t>(kStageBytes),
                                            2 * static_cast<int64_t>(kLine) * n);
  constexpr int kFields = 4;
  std::vector<int64_t> all = exchange(oc, {key, static_cast<int64_t>(getpid()), nonce, stage});
  std::vector<int64_t> pids(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    if (all[kFields * r] != all[0]) return nullptr;  // another host, or shared memory off somewhere
    pids[r] = all[kFields * r + 1];
  }
  const std::string name = "/shardtrain-" + std::to_string(pids[0]) + "-" + std::to_string(all[2]);
  // Rank 0's, so every rank agrees; whole lines in each of the two halves,
  // so every slot and every rank's area starts on a cache line.
  const auto stage_bytes = static_cast<size_t>(all[3]) / (2 * kLine) * (2 * kLine);
  const size_t bytes = header_bytes(n) + static_cast<size_t>(n) * stage_bytes;
  char* base = map_segment(oc, name, bytes);
  if (base == nullptr) return nullptr;
  return std::unique_ptr<ShmChannel>(new ShmChannel(base, bytes, stage_bytes, oc.rank, n, std::move(pids)));
}

ShmChannel::ShmChannel(char* base, size_t bytes, size_t stage_bytes, int rank, int size,
                       std::vector<int64_t> pids)
    : base_(base), bytes_(bytes), stage_bytes_(stage_bytes), rank_(rank), size_(size), pids_(std::move(pids)) {
  // With more ranks than CPUs, a spinning rank holds the CPU a peer needs.
  cpu_set_t cpus;
  may_spin_ = sched_getaffinity(0, sizeof(cpus), &cpus) == 0 && CPU_COUNT(&cpus) >= size;
}

// A peer waiting on this rank learns at once that it will not come, as it
// would from a closed connection.
ShmChannel::~ShmChannel() {
  closed(rank_).store(1, std::memory_order_seq_cst);
  wake_all(word(rank_));
  munmap(base_, bytes_);
}

std::atomic<uint32_t>& ShmChannel::word(int r) const {
  return *reinterpret_cast<std::atomic<uint32_t>*>(base_ + static_cast<size_t>(r) * kLine);
}

std::atomic<uint32_t>& ShmChannel::closed(int r) const {
  return *reinterpret_cast<std::atomic<uint32_t>*>(base_ + static_cast<size_t>(r) * kLine + sizeof(uint32_t));
}

std::atomic<uint32_t>& ShmChannel::sleepers(int r) const {
  return *reinterpret_cast<std::atomic<uint32_t>*>(base_ + static_cast<size_t>(r) * kLine + 2 * sizeof(uint32_t));
}

std::atomic<uint64_t>& ShmChannel::region_id(int r) const {
  return *reinterpret_cast<std::atomic<uint64_t>*>(base_ + static_cast<size_t>(r) * kLine + 16);
}

std::atomic<int64_t>& ShmChannel::region_offset(int r) const {
  return *reinterpret_cast<std::atomic<int64_t>*>(base_ + static_cast<size_t>(r) * kLine + 24);
}

char* ShmChannel::stage(int r) const {
  return base_ + header_bytes(size_) + static_cast<size_t>(r) * stage_bytes_;
}

// The futex wake is a system call; it is made only when a peer has said
// (in the word's line) that it sleeps or is about to. Both sides order their
// store before their load (seq_cst), so either the publisher sees the
// sleeper or the sleeper sees the new phase before it sleeps.
void ShmChannel::publish() {
  word(rank_).store(++phase_, std::memory_order_seq_cst);
  if (sleepers(rank_).load(std::memory_order_seq_cst) != 0) wake_all(word(rank_));
}

void ShmChannel::wait_all(const OpContext& oc, uint32_t phase) const {
  for (int p = 0; p < size_; ++p) {
    if (p != rank_) wait_for(oc, p, phase);
  }
}

namespace {

void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

}  // namespace

void ShmChannel::wait_for(const OpContext& oc, int p, uint32_t phase) const {
  std::atomic<uint32_t>& w = word(p);
  const auto start = Clock::now();
  const auto spin_until = start + std::chrono::microseconds(may_spin_ ? 100 : 2);
  auto next_check = start + std::chrono::milliseconds(100);
  for (;;) {
    const uint32_t seen = w.load(std::memory_order_acquire);
    if (static_cast<int32_t>(seen - phase) >= 0) break;
    if (closed(p).load(std::memory_order_acquire) != 0) {
      throw CommError(oc.describe(p) +
                      ": the peer closed its side of the group. Hint: the peer probably exited "
                      "or failed; see its own output for why.");
    }
    const auto now = Clock::now();
    if (now < spin_until) {
      cpu_relax();
      continue;
    }
    if (now >= oc.deadline) {
      throw TimeoutError(oc.describe(p) +
                         ": timed out waiting for the peer in shared memory. Hint: the peer may "
                         "have hung or issued collectives in another order; raise "
                         "SHARDTRAIN_TIMEOUT_S if steps are legitimately this slow.");
    }
    if (now >= next_check) {
      if (exited(pids_[p])) {
        throw CommError(oc.describe(p) + ": the peer process (pid " + std::to_string(pids_[p]) +
                        ") exited. Hint: the peer probably exited; see its own output for why.");
      }
      next_check = now + std::chrono::milliseconds(100);
    }
    // Bounded, so the deadline and the peer's life are checked again.
    const timespec nap{0, 20 * 1000 * 1000};
    sleepers(p).fetch_add(1, std::memory_order_seq_cst);
    if (w.load(std::memory_order_seq_cst) == seen && closed(p).load(std::memory_order_seq_cst) == 0) {
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(&w), FUTEX_WAIT, seen, &nap, nullptr, 0);
    }
    sleepers(p).fetch_sub(1, std::memory_order_relaxed);
  }
}

namespace {

// Elements [lo, lo + cap) of a range of `count`: how many exist.
int64_t piece(int64_t count, int64_t lo, int64_t cap) { return std::clamp<int64_t>(count - lo, 0, cap); }

int64_t most_per_rank(int64_t numel, int n) { return (numel + n - 1) / n; }

}  // namespace

// all_reduce, reduce_scatter and all_gather move a buffer in pieces small
// enough to stay in cache from the rank that stages one to the rank that
// reads it. Each rank's area holds two sets of slots, so that a rank stages
// piece k+1 while its peers still read piece k. An op is a list of steps;
// step j first consumes what every peer published in step j-1 (after
// waiting for it), then stages what step j+1 needs, then publishes once:
// step j ends at phase base + j + 2, and the first staging at base + 1.
// A set is staged again two pieces later; by then every peer has published
// the step that read it last, which this rank has waited for.
size_t ShmChannel::slot_bytes() const {
  return std::min(stage_bytes_ / 2 / static_cast<size_t>(size_) / kLine * kLine, kPieceBytes);
}

char* ShmChannel::slot(int owner, int64_t k, int p) const {
  return stage(owner) + static_cast<size_t>(k % 2) * (stage_bytes_ / 2) + static_cast<size_t>(p) * slot_bytes();
}

int64_t ShmChannel::Pieces::elements_in(const ShardRange& r, int64_t k) const { return piece(r.count, k * per, per); }

ShmChannel::Pieces ShmChannel::pieces(int64_t numel, DType dtype) const {
  const size_t es = element_size(dtype);
  const auto per = static_cast<int64_t>(slot_bytes() / es);
  return {numel, es, per, (most_per_rank(numel, size_) + per - 1) / per, shard_range(numel, size_, rank_)};
}

template <typename First, typename Step>
void ShmChannel::pipeline(const OpContext& oc, int64_t steps, const First& first, const Step& step) {
  if (steps == 0) return;
  const uint32_t base = phase_;
  wait_all(oc, base);  // every peer has finished reading this rank's areas in the op before
  first();
  publish();
  for (int64_t j = 0; j < steps; ++j) {
    wait_all(oc, static_cast<uint32_t>(base + j + 1));
    step(j);
    publish();
  }
}

// Calls f(p, offset, bytes) for each peer p with where piece k of p's
// shard_range lies in the buffer, and its length.
template <typename F>
void ShmChannel::each_peer(const Pieces& pc, int64_t k, const F& f) const {
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    const ShardRange theirs = shard_range(pc.numel, size_, p);
    f(p, pc.offset_of(theirs, k), static_cast<size_t>(pc.elements_in(theirs, k)) * pc.es);
  }
}

void ShmChannel::stage_for_peers(const Pieces& pc, int64_t k, const char* data) const {
  each_peer(pc, k, [&](int p, int64_t at, size_t bytes) { std::memcpy(slot(rank_, k, p), data + at, bytes); });
}

void ShmChannel::copy_from_peers(const Pieces& pc, int64_t k, char* data) const {
  each_peer(pc, k, [&](int p, int64_t at, size_t bytes) { std::memcpy(data + at, slot(p, k, p), bytes); });
}

// This rank's values, then each peer's in rank order; Avg divides on the last.
template <typename Peer>
void ShmChannel::combine(const void* own, void* out, int64_t count, DType dtype, ReduceOp op,
                         const Peer& peer) const {
  const void* acc = own;
  int combined = 0;
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    const bool last = ++combined == size_ - 1;
    reduce(out, acc, peer(p), count, dtype, op, last && op == ReduceOp::Avg ? size_ : 0);
    acc = out;
  }
}

// Step k: copy each peer's piece k out of its own slot, stage piece k+1.
void ShmChannel::all_gather(const OpContext& oc, void* buf, int64_t numel, DType dtype) {
  char* data = static_cast<char*>(buf);
  if (all_gather_in_place(oc, data, numel, dtype)) return;
  const Pieces pc = pieces(numel, dtype);
  const auto stage_own = [&](int64_t k) {
    std::memcpy(slot(rank_, k, rank_), data + pc.offset_of(pc.mine, k),
                static_cast<size_t>(pc.elements_in(pc.mine, k)) * pc.es);
  };
  pipeline(oc, pc.count, [&] { stage_own(0); }, [&](int64_t k) {
    copy_from_peers(pc, k, data);
    if (k + 1 < pc.count) stage_own(k + 1);
  });
}

// Step k: combine this rank's piece k from the peers' slots for it, stage
// piece k+1 (each peer's part in the slot for that peer).
void ShmChannel::reduce_scatter(const OpContext& oc, const void* in, void* out, int64_t numel,
                                DType dtype, ReduceOp op) {
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  if (reduce_scatter_in_place(oc, src, dst, numel, dtype, op)) return;
  const Pieces pc = pieces(numel, dtype);
  pipeline(oc, pc.count, [&] { stage_for_peers(pc, 0, src); }, [&](int64_t k) {
    const int64_t count = pc.elements_in(pc.mine, k);
    if (count > 0) {
      combine(src + pc.offset_of(pc.mine, k), dst + k * pc.per * pc.es, count, dtype, op,
              [&](int p) { return slot(p, k, rank_); });
    }
    if (k + 1 < pc.count) stage_for_peers(pc, k + 1, src);
  });
}

// Step k: copy piece k of each peer's part for this rank out of the slot
// that peer keeps for it, stage piece k+1 of this rank's part for each peer.
void ShmChannel::all_to_all(const OpContext& oc, const char* in, char* out, const AllToAllPlan& plan,
                            DType dtype) {
  const size_t es = element_size(dtype);
  const auto per = static_cast<int64_t>(slot_bytes() / es);
  const int64_t steps = (plan.most + per - 1) / per;  // the same on every rank
  const ShardRange own = plan.send[rank_];
  if (own.count > 0) std::memcpy(out + plan.recv[rank_].offset * es, in + own.offset * es, own.count * es);
  const auto stage_pieces = [&](int64_t k) {
    for (int p = 0; p < size_; ++p) {
      const int64_t count = piece(plan.send[p].count, k * per, per);
      if (p != rank_ && count > 0) std::memcpy(slot(rank_, k, p), in + (plan.send[p].offset + k * per) * es, count * es);
    }
  };
  pipeline(oc, steps, [&] { stage_pieces(0); }, [&](int64_t k) {
    for (int p = 0; p < size_; ++p) {
      const int64_t count = piece(plan.recv[p].count, k * per, per);
      if (p != rank_ && count > 0) std::memcpy(out + (plan.recv[p].offset + k * per) * es, slot(p, k, rank_), count * es);
    }
    if (k + 1 < steps) stage_pieces(k + 1);
  });
}

ShmChannel::Region::~Region() { munmap(base, per_rank * static_cast<size_t>(ranks)); }

std::shared_ptr<ShmChannel::Region> ShmChannel::allocate(const OpContext& setup, size_t bytes) {
  OpContext oc = setup;
  oc.phase = 7;  // as open(): the setup exchanges' own slots
  const uint64_t id = ++regions_made_;
  // Whole pages per rank, so every rank's part starts on one.
  const size_t per_rank = std::max<size_t>((bytes + kPage - 1) / kPage * kPage, kPage);
  const std::vector<int64_t> all =
      exchange(oc, {oc.rank == 0 ? static_cast<int64_t>(++g_segments) : 0, static_cast<int64_t>(bytes)});
  for (int r = 0; r < size_; ++r) {
    ST_CHECK(all[2 * r + 1] == all[1], InvalidArgument, oc.describe(r), ": allocate asked for ", bytes,
             " bytes here and ", all[2 * r + 1], " there; every rank must ask for the same size");
  }
  const std::string name = "/shardtrain-" + std::to_string(pids_[0]) + "-" + std::to_string(all[0]);
  char* base = map_segment(oc, name, per_rank * static_cast<size_t>(size_));
  if (base == nullptr) return nullptr;
  auto region = std::make_shared<Region>(base, per_rank, size_, rank_, id);
  std::lock_guard<std::mutex> lock(regions_mutex_);
  regions_.erase(std::remove_if(regions_.begin(), regions_.end(), [](const auto& w) { return w.expired(); }),
                 regions_.end());
  regions_.push_back(region);
  return region;
}

std::shared_ptr<ShmChannel::Region> ShmChannel::region_holding(const char* buf, size_t bytes) const {
  std::lock_guard<std::mutex> lock(regions_mutex_);
  for (const auto& w : regions_) {
    std::shared_ptr<Region> r = w.lock();
    if (r && buf >= r->mine() && buf + bytes <= r->mine() + r->per_rank) return r;
  }
  return nullptr;
}

std::shared_ptr<ShmChannel::Region> ShmChannel::agree_on_region(const OpContext& oc, const char* buf, size_t bytes,
                                                                int64_t* offset) {
  // Small buffers, staged in cache anyway, do not pay for the agreement.
  if (bytes < kInPlaceBytes) return nullptr;
  std::shared_ptr<Region> region = region_holding(buf, bytes);
  *offset = region ? buf - region->mine() : -1;
  region_id(rank_).store(region ? region->id : 0, std::memory_order_relaxed);
  region_offset(rank_).store(*offset, std::memory_order_relaxed);
  publish();
  wait_all(oc, phase_);
  // Rank 0's answer against everyone's: the same test on every rank. (No
  // rank writes its answer again before every rank has passed a later
  // barrier of this op: each path below has one.)
  const uint64_t first_id = region_id(0).load(std::memory_order_relaxed);
  const int64_t first_offset = region_offset(0).load(std::memory_order_relaxed);
  bool same = first_id != 0;
  for (int p = 1; p < size_ && same; ++p) {
    same = region_id(p).load(std::memory_order_relaxed) == first_id &&
           region_offset(p).load(std::memory_order_relaxed) == first_offset;
  }
  ++(same ? in_place_ops_ : staged_ops_);
  return same ? region : nullptr;
}

// All ranks take the same path (agree_on_region). On this one, rank r
// combines its shard_range from every rank's buffer (its own values, then
// the peers' in rank order, as the staged path does) a chunk at a time and
// copies the chunk into each peer's buffer while it is in cache; the ranges
// are disjoint, so no two ranks touch the same bytes. A closing barrier
// keeps every buffer as it is until all ranks are done. Each byte is read
// once and written once, as by one memcpy per rank.
bool ShmChannel::all_reduce_in_place(const OpContext& oc, char* buf, int64_t numel, DType dtype, ReduceOp op) {
  const size_t es = element_size(dtype);
  int64_t offset = 0;
  const std::shared_ptr<Region> region = agree_on_region(oc, buf, static_cast<size_t>(numel) * es, &offset);
  if (!region) return false;
  const ShardRange mine = shard_range(numel, size_, rank_);
  const auto per = static_cast<int64_t>(kInPlaceChunkBytes / es);
  for (int64_t lo = 0; lo < mine.count; lo += per) {
    const int64_t count = std::min(per, mine.count - lo);
    const size_t at = static_cast<size_t>(offset) + static_cast<size_t>(mine.offset + lo) * es;
    char* own = region->mine() + at;
    combine(own, own, count, dtype, op, [&](int p) { return region->of(p) + at; });
    for (int p = 0; p < size_; ++p) {
      if (p != rank_) std::memcpy(region->of(p) + at, own, static_cast<size_t>(count) * es);
    }
  }
  publish();
  wait_all(oc, phase_);
  return true;
}

// Rank r combines its shard_range straight from every rank's input (its
// own values, then the peers' in rank order: the staged path's order and
// bits) into `out`, which may be that range of its own input: no rank
// writes where another reads. The closing barrier keeps every input as it
// is until all ranks have read theirs.
bool ShmChannel::reduce_scatter_in_place(const OpContext& oc, const char* in, char* out, int64_t numel, DType dtype,
                                         ReduceOp op) {
  const size_t es = element_size(dtype);
  int64_t offset = 0;
  const std::shared_ptr<Region> region = agree_on_region(oc, in, static_cast<size_t>(numel) * es, &offset);
  if (!region) return false;
  const ShardRange mine = shard_range(numel, size_, rank_);
  const size_t at = static_cast<size_t>(offset) + static_cast<size_t>(mine.offset) * es;
  if (mine.count > 0) combine(region->mine() + at, out, mine.count, dtype, op, [&](int p) { return region->of(p) + at; });
  publish();
  wait_all(oc, phase_);
  return true;
}

// Every rank's shard is in its own buffer (agree_on_region's barrier is
// past); rank r copies each peer's shard out of that peer's buffer, where
// the peer never writes during the op. The closing barrier keeps each
// shard as it is until all ranks have copied it.
bool ShmChannel::all_gather_in_place(const OpContext& oc, char* buf, int64_t numel, DType dtype) {
  const size_t es = element_size(dtype);
  int64_t offset = 0;
  const std::shared_ptr<Region> region = agree_on_region(oc, buf, static_cast<size_t>(numel) * es, &offset);
  if (!region) return false;
  for (int p = 0; p < size_; ++p) {
    const ShardRange theirs = shard_range(numel, size_, p);
    if (p == rank_ || theirs.count == 0) continue;
    const size_t at = static_cast<size_t>(offset) + static_cast<size_t>(theirs.offset) * es;
    std::memcpy(region->mine() + at, region->of(p) + at, static_cast<size_t>(theirs.count) * es);
  }
  publish();
  wait_all(oc, phase_);
  return true;
}

// Two steps per piece: step 2k combines this rank's piece k in place and
// stages the result in its own slot; step 2k+1 copies each peer's result
// out and stages piece k+1. Each byte of the buffer is read once and
// written once outside the cache, as by a memcpy.
void ShmChannel::all_reduce(const OpContext& oc, void* buf, int64_t numel, DType dtype, ReduceOp op) {
  char* data = static_cast<char*>(buf);
  if (all_reduce_in_place(oc, data, numel, dtype, op)) return;
  const Pieces pc = pieces(numel, dtype);
  pipeline(oc, 2 * pc.count, [&] { stage_for_peers(pc, 0, data); }, [&](int64_t j) {
    const int64_t k = j / 2;
    if (j % 2 == 0) {
      const int64_t count = pc.elements_in(pc.mine, k);
      if (count > 0) {
        char* acc = data + pc.offset_of(pc.mine, k);
        combine(acc, acc, count, dtype, op, [&](int p) { return slot(p, k, rank_); });
        std::memcpy(slot(rank_, k, rank_), acc, static_cast<size_t>(count) * pc.es);
      }
      return;
    }
    copy_from_peers(pc, k, data);
    if (k + 1 < pc.count) stage_for_peers(pc, k + 1, data);
  });
}

// The root stages a piece, every other rank copies it out: one copy per
// reader, all readers at once, where a chain over TCP forwards rank to rank.
// The root's area is used in two halves, so that it stages piece i+1 while
// the others copy piece i out. Each rank publishes once per piece: the root
// when a piece is staged, a reader when it has copied one out.
void ShmChannel::broadcast(const OpContext& oc, void* buf, int64_t numel, DType dtype, int root) {
  const size_t es = element_size(dtype);
  char* data = static_cast<char*>(buf);
  const size_t half = stage_bytes_ / 2 / kLine * kLine;
  const int64_t per = static_cast<int64_t>(half / es);
  const uint32_t base = phase_;
  uint32_t i = 0;
  for (int64_t lo = 0; lo < numel; lo += per, ++i) {
    const int64_t count = piece(numel, lo, per);
    char* staged = stage(root) + (i % 2) * half;
    if (rank_ == root) {
      // Every reader has copied out piece i-2, the last one in this half
      // (for the first two pieces: has finished the op before this one).
      wait_all(oc, base + (i < 2 ? 0 : i - 1));
      std::memcpy(staged, data + lo * es, count * es);
    } else {
      wait_for(oc, root, base + i + 1);
      std::memcpy(data + lo * es, staged, count * es);
    }
    publish();
  }
}

void ShmChannel::barrier(const OpContext& oc) {
  publish();
  wait_all(oc, phase_);
}

}  // namespace shardtrain::comm::detail
