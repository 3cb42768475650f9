// Deferred tensors: parameters whose values are read later, where they are
// kept.
//
// A model that is about to be loaded from files need not hold its weights
// before the strategy decides where they live: under a sharded strategy a
// rank keeps a slice of most of them. A deferred tensor has its final shape,
// dtype and requires_grad but one element of storage (every stride 0; reads
// see that element, writes fail), and carries a reader that yields any
// element range of its values. The storage and the reader go together: a
// set_data() that gives the parameter real storage drops the reader.
//
//   defer(layer->weight);                                     // at build time
//   defer(layer->weight, [&](int64_t first, at::Tensor out) { // at load time
//     out.copy_(file.read_range("w", first, out.numel()));
//   });
//   materialize(*model);   // or a sharded strategy reads only its slices
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>

namespace torch::nn {
class Module;
}

namespace shardtrain {

/// Writes elements [first, first + out.numel()) of a tensor's values, in
/// row-major order, into `out` (1-D, contiguous, the tensor's dtype).
using DeferredReader = std::function<void(int64_t first, const at::Tensor& out)>;

/// Gives `t` (a parameter or buffer, updated in place through set_data) a
/// deferred placeholder of its shape and dtype: its storage is released.
/// `reader` null: the values are not known yet (reading them is an error).
void defer(const at::Tensor& t, DeferredReader reader = nullptr);

/// A new deferred tensor of `sizes` and `dtype`.
at::Tensor deferred_tensor(at::IntArrayRef sizes, at::ScalarType dtype, DeferredReader reader);

/// Defers every parameter of `module` and its submodules (buffers, which
/// models compute rather than load, stay).
void defer_parameters(torch::nn::Module& module);

/// Whether `t` is a deferred placeholder.
bool is_deferred(const at::Tensor& t);

/// A deferred placeholder like `t` (deferred) but of `dtype`, with the same
/// reader (its values cast when read).
at::Tensor deferred_as(const at::Tensor& t, at::ScalarType dtype);

/// Reads elements [first, first + out.numel()) of deferred `t` into `out`
/// (1-D contiguous, t's dtype). A deferred tensor without a reader is an
/// InvalidArgument naming `name`.
void read_deferred(const at::Tensor& t, int64_t first, const at::Tensor& out, const char* name = "");

/// Replaces every deferred parameter and buffer of `module` by its values,
/// one tensor at a time.
void materialize(torch::nn::Module& module);

}  // namespace shardtrain
