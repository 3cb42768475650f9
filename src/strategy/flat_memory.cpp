#include "strategy/flat_memory.h"

#include <ATen/native/Resize.h>
#include <sys/mman.h>
#include <unistd.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "shardtrain/core/error.h"

namespace shardtrain::strategy::detail {

namespace {

std::atomic<int64_t> g_live_bytes{0};
std::atomic<int64_t> g_peak_bytes{0};

struct MappedBlock {
  void* data;
  size_t bytes;
};

// Released mappings are kept and handed to the next buffer of the same size:
// a unit is released and gathered again every micro-step, and a fresh mapping
// costs the kernel a page fault and a zeroed page per 4 KB each time. The
// pool never lets live plus kept bytes exceed the most ever live at once (the
// high-water mark), so it adds nothing to the peak: a new mapping first
// returns kept blocks of other sizes to the system.
struct Pool {
  std::mutex mu;
  std::unordered_map<size_t, std::vector<void*>> blocks;
  size_t kept_bytes = 0;
  size_t live_bytes = 0;
  size_t high_water = 0;
};
Pool& pool() {
  static Pool* p = new Pool;  // never destroyed: buffers may outlive static destruction
  return *p;
}

void unmap_block(void* ctx) {
  auto* block = static_cast<MappedBlock*>(ctx);
  g_live_bytes -= static_cast<int64_t>(block->bytes);
  bool kept = false;
  {
    Pool& p = pool();
    std::lock_guard<std::mutex> lock(p.mu);
    p.live_bytes -= block->bytes;
    if (p.live_bytes + p.kept_bytes + block->bytes <= p.high_water) {
      p.blocks[block->bytes].push_back(block->data);
      p.kept_bytes += block->bytes;
      kept = true;
    }
  }
  if (!kept) munmap(block->data, block->bytes);
  delete block;
}

// A kept block of exactly `bytes`, or nullptr after returning enough kept
// blocks to the system that a new mapping stays within the high-water mark.
void* take_block(size_t bytes) {
  std::vector<std::pair<void*, size_t>> victims;
  void* data = nullptr;
  {
    Pool& p = pool();
    std::lock_guard<std::mutex> lock(p.mu);
    auto it = p.blocks.find(bytes);
    if (it != p.blocks.end() && !it->second.empty()) {
      data = it->second.back();
      it->second.pop_back();
      p.kept_bytes -= bytes;
    } else {
      for (auto b = p.blocks.begin(); b != p.blocks.end() && p.kept_bytes > 0 &&
                                       p.live_bytes + p.kept_bytes + bytes > p.high_water;) {
        while (!b->second.empty() && p.live_bytes + p.kept_bytes + bytes > p.high_water) {
          victims.emplace_back(b->second.back(), b->first);
          b->second.pop_back();
          p.kept_bytes -= b->first;
        }
        b = b->second.empty() ? p.blocks.erase(b) : std::next(b);
      }
    }
    p.live_bytes += bytes;
    p.high_water = std::max(p.high_water, p.live_bytes);
  }
  for (const auto& [ptr, size] : victims) munmap(ptr, size);
  return data;
}

void give_back_block(size_t bytes) {  // a failed mapping is not live
  Pool& p = pool();
  std::lock_guard<std::mutex> lock(p.mu);
  p.live_bytes -= bytes;
}

// flat_empty(..., populate=false) asks the allocator for a mapping whose
// pages are not faulted in up front.
thread_local bool t_populate = true;

class FlatAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t bytes) const override {
    if (bytes == 0) return {nullptr, nullptr, &c10::detail::deleteNothing, c10::Device(c10::kCPU)};
    void* data = take_block(bytes);  // reused as it is: every user writes before it reads
    if (data == nullptr) {
      data = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                  MAP_PRIVATE | MAP_ANONYMOUS | (t_populate ? MAP_POPULATE : 0), -1, 0);
      if (data == MAP_FAILED) give_back_block(bytes);
    }
    ST_CHECK(data != MAP_FAILED, Error, "out of memory: cannot map ", bytes,
             " bytes for a flat parameter or gradient buffer; use a sharding mode that keeps "
             "less (distributed.sharding: full_shard), more ranks, or a smaller model");
    const int64_t live = g_live_bytes += static_cast<int64_t>(bytes);
    int64_t peak = g_peak_bytes.load();
    while (live > peak && !g_peak_bytes.compare_exchange_weak(peak, live)) {
    }
    return {data, new MappedBlock{data, bytes}, &unmap_block, c10::Device(c10::kCPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
};

FlatAllocator& flat_allocator() {
  static FlatAllocator allocator;
  return allocator;
}

}  // namespace

FlatMemoryStats flat_memory_stats() { return {g_live_bytes.load(), g_peak_bytes.load()}; }

void reset_flat_memory_peak() { g_peak_bytes = g_live_bytes.load(); }

void trim_flat_memory() {
  std::vector<std::pair<void*, size_t>> blocks;
  {
    Pool& p = pool();
    std::lock_guard<std::mutex> lock(p.mu);
    for (auto& [size, kept] : p.blocks) {
      for (void* b : kept) blocks.emplace_back(b, size);
    }
    p.blocks.clear();
    p.kept_bytes = 0;
    p.high_water = 0;  // pooling starts again from the next buffer made
  }
  for (const auto& [ptr, size] : blocks) munmap(ptr, size);
}

at::Tensor flat_empty(int64_t numel, at::ScalarType dtype, bool populate) {
  const size_t bytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
  t_populate = populate;
  c10::Storage storage(c10::Storage::use_byte_size_t(), bytes, &flat_allocator(),
                       /*resizable=*/true);
  t_populate = true;
  return at::empty({0}, at::TensorOptions().dtype(dtype)).set_(storage, 0, {numel}, {1});
}

at::Tensor populated_empty(int64_t numel, at::ScalarType dtype) {
  at::Tensor t = at::empty({numel}, at::TensorOptions().dtype(dtype));
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const auto begin = reinterpret_cast<uintptr_t>(t.data_ptr());
  const uintptr_t first = (begin + page - 1) / page * page;
  const uintptr_t end = (begin + t.nbytes()) / page * page;
  // Best effort: a kernel without it (before Linux 5.14) faults on first use.
  if (end > first) (void)madvise(reinterpret_cast<void*>(first), end - first, MADV_POPULATE_WRITE);
  return t;
}

void release_storage(const at::Tensor& flat) {
  at::native::resize_bytes_cpu(flat.storage().unsafeGetStorageImpl(), 0);
}

void regrow_storage(const at::Tensor& flat) {
  at::native::resize_bytes_cpu(flat.storage().unsafeGetStorageImpl(),
                               static_cast<size_t>(flat.numel()) * flat.element_size());
}

bool has_storage(const at::Tensor& flat) {
  return flat.storage().nbytes() >= static_cast<size_t>(flat.numel()) * flat.element_size();
}

at::Tensor alias_of(const at::Tensor& flat, int64_t offset, at::IntArrayRef shape) {
  return at::empty({0}, flat.options()).set_(flat.storage(), flat.storage_offset() + offset, shape);
}

}  // namespace shardtrain::strategy::detail
