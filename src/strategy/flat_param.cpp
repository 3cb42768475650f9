#include "strategy/flat_param.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "strategy/flat_memory.h"

namespace shardtrain::strategy::detail {

int64_t word_multiple(at::ScalarType dtype) {
  switch (dtype) {
    case at::kByte:
    case at::kChar:
    case at::kBool: return 4;
    case at::kShort: return 2;
    default: return 1;
  }
}

at::Tensor as_words(const at::Tensor& flat) {
  if (word_multiple(flat.scalar_type()) == 1) return flat;
  const int64_t bytes = flat.numel() * static_cast<int64_t>(flat.element_size());
  const int64_t offset = flat.storage_offset() * static_cast<int64_t>(flat.element_size());
  TORCH_INTERNAL_ASSERT(flat.is_contiguous() && bytes % 4 == 0 && offset % 4 == 0,
                        "a byte flat must be word aligned");
  return at::empty({0}, flat.options().dtype(at::kInt)).set_(flat.storage(), offset / 4, {bytes / 4}, {1});
}

FlatLayout plan_flat(const std::vector<int64_t>& numels, int shards, int rank,
                     int64_t shard_multiple) {
  FlatLayout l;
  for (int64_t n : numels) {
    ParamSlot s;
    s.offset = l.numel;
    s.numel = n;
    l.numel += n;
    l.slots.push_back(s);
  }
  const int64_t unit = static_cast<int64_t>(shards) * shard_multiple;
  l.padded = (l.numel + unit - 1) / unit * unit;
  l.shard_numel = l.padded / shards;
  l.shard_offset = static_cast<int64_t>(rank) * l.shard_numel;
  const int64_t shard_end = l.shard_offset + l.shard_numel;
  for (auto& s : l.slots) {
    const int64_t lo = std::min(std::max(s.offset, l.shard_offset), shard_end);
    const int64_t hi = std::max(std::min(s.offset + s.numel, shard_end), lo);
    s.shard_begin = lo - l.shard_offset;
    s.shard_count = hi - lo;
    s.param_offset = s.shard_count > 0 ? lo - s.offset : 0;
  }
  return l;
}

at::Tensor FlatParam::shard_slice(size_t i, bool whole) const {
  const FlatMember& p = params[i];
  at::Tensor slice = shard.narrow(0, p.slot.shard_begin, p.slot.shard_count);
  return whole ? slice.view(p.shape) : slice;
}

void FlatParam::adopt_grad(size_t i) {
  if (!grad_full.defined()) {
    // Each parameter's part is written when it is adopted: no pass of zeros first.
    grad_full = flat_empty(layout.padded, compute_dtype);
    grad_full.narrow(0, layout.numel, layout.padded - layout.numel).zero_();
    grad_unwritten.assign(params.size(), true);
  }
  const FlatMember& p = params[i];
  at::Tensor& g = p.var.mutable_grad();
  at::Tensor view = alias_of(grad_full, p.slot.offset, p.shape);
  if (grad_unwritten[i]) {
    if (g.defined()) {
      view.copy_(g);
    } else {
      view.zero_();
    }
    grad_unwritten[i] = false;
  } else if (g.defined() && g.data_ptr() != view.data_ptr()) {
    view.add_(g);
  }
  g = view;
}

void FlatParam::adopt_grads() {
  for (size_t i = 0; i < params.size(); ++i) adopt_grad(i);
}

}  // namespace shardtrain::strategy::detail
