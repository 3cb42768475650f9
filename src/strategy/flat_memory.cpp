#include "strategy/flat_memory.h"

#include <ATen/native/Resize.h>
#include <sys/mman.h>

#include <ATen/ATen.h>

#include <atomic>
#include <cstring>
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

// Released mappings kept for the next buffer of the same size: a gathered
// unit is released and gathered again every micro-step, and a fresh mapping
// costs the kernel a page fault and a zeroed page per 4 KB each time. At most
// kPooledPerSize per size, so the memory held back stays within a few units.
constexpr size_t kPooledPerSize = 2;
std::mutex g_pool_mu;
std::unordered_map<size_t, std::vector<void*>> g_pool;

void unmap_block(void* ctx) {
  auto* block = static_cast<MappedBlock*>(ctx);
  g_live_bytes -= static_cast<int64_t>(block->bytes);
  {
    std::lock_guard<std::mutex> lock(g_pool_mu);
    auto& kept = g_pool[block->bytes];
    if (kept.size() < kPooledPerSize) {
      kept.push_back(block->data);
      delete block;
      return;
    }
  }
  munmap(block->data, block->bytes);
  delete block;
}

void* pooled_block(size_t bytes) {
  std::lock_guard<std::mutex> lock(g_pool_mu);
  const auto it = g_pool.find(bytes);
  if (it == g_pool.end() || it->second.empty()) return nullptr;
  void* data = it->second.back();
  it->second.pop_back();
  return data;
}

class FlatAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t bytes) const override {
    if (bytes == 0) return {nullptr, nullptr, &c10::detail::deleteNothing, c10::Device(c10::kCPU)};
    void* data = pooled_block(bytes);
    if (data != nullptr) {
      std::memset(data, 0, bytes);  // as fresh as a new mapping
    } else {
      data = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
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

at::Tensor flat_empty(int64_t numel, at::ScalarType dtype) {
  const size_t bytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
  c10::Storage storage(c10::Storage::use_byte_size_t(), bytes, &flat_allocator(),
                       /*resizable=*/true);
  return at::empty({0}, at::TensorOptions().dtype(dtype)).set_(storage, 0, {numel}, {1});
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
