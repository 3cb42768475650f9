// Flat buffers of the sharded strategies: 1-D tensors whose storage comes
// straight from mmap, so that releasing a gathered unit returns its memory to
// the system whatever malloc's thresholds, and whose storage can be released
// and grown again in place while views of it stay valid. Released mappings
// are kept and reused by the next buffer of the same size (a unit is released
// and gathered again every micro-step, and a fresh mapping faults in and
// zeroes every page), as long as live plus kept bytes stay within the most
// ever live at once; the rest go back to the system.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace shardtrain::strategy::detail {

/// Bytes held by flat buffers now and at most since the last reset.
struct FlatMemoryStats {
  int64_t live_bytes = 0;
  int64_t peak_bytes = 0;
};
FlatMemoryStats flat_memory_stats();
/// Sets peak_bytes to live_bytes (to measure the peak of a later phase).
void reset_flat_memory_peak();

/// A 1-D tensor of `numel` elements in mmap'd storage. Its contents are
/// undefined (a reused mapping keeps what it held): write before reading.
/// A new mapping has its pages faulted in at once unless `populate` is
/// false (a buffer that is released before it is used).
at::Tensor flat_empty(int64_t numel, at::ScalarType dtype, bool populate = true);

/// A 1-D tensor of `numel` elements from the CPU allocator (not a flat
/// buffer: flat_memory_stats() does not count it) whose pages are faulted
/// in at once where the kernel can (MADV_POPULATE_WRITE): filling a large
/// buffer faults it in 4 KiB at a time otherwise, which costs more than the
/// filling on some machines. Contents undefined.
at::Tensor populated_empty(int64_t numel, at::ScalarType dtype);

/// Returns the kept released mappings to the system (a strategy that ends).
void trim_flat_memory();

/// Returns the storage of `flat` to the system; its views keep their shape.
void release_storage(const at::Tensor& flat);

/// Gives `flat` storage for all its elements again, contents undefined.
void regrow_storage(const at::Tensor& flat);

/// Whether `flat` currently has storage for all its elements.
bool has_storage(const at::Tensor& flat);

/// `shape` elements of `flat` from `offset`, sharing its storage but not an
/// autograd view of it: gradients must be plain tensors, because optimizers
/// detach_() them in zero_grad(), which views refuse.
at::Tensor alias_of(const at::Tensor& flat, int64_t offset, at::IntArrayRef shape);

}  // namespace shardtrain::strategy::detail
