#include "shardtrain/core/deferred.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <unordered_set>

#include "shardtrain/core/error.h"

namespace shardtrain {

namespace {

// What a placeholder's storage holds: its one (zero) element and the reader.
// The storage owns it, so the reader lives exactly as long as the placeholder.
struct Placeholder {
  alignas(16) unsigned char element[16] = {};
  DeferredReader reader;
};

void free_placeholder(void* ctx) { delete static_cast<Placeholder*>(ctx); }

at::Tensor placeholder(at::IntArrayRef sizes, at::ScalarType dtype, DeferredReader reader) {
  auto* p = new Placeholder;
  p->reader = std::move(reader);
  const size_t element_size = c10::elementSize(dtype);
  c10::Storage storage(c10::Storage::use_byte_size_t(), element_size,
                       c10::DataPtr(p->element, p, &free_placeholder, c10::Device(c10::kCPU)),
                       /*allocator=*/nullptr, /*resizable=*/false);
  const std::vector<int64_t> strides(sizes.size(), 0);
  return at::empty({0}, at::TensorOptions().dtype(dtype)).set_(storage, 0, sizes, strides);
}

const Placeholder* placeholder_of(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) return nullptr;
  const c10::DataPtr& ptr = t.storage().data_ptr();
  if (ptr.get_deleter() != &free_placeholder) return nullptr;
  return static_cast<const Placeholder*>(ptr.get_context());
}

template <typename Fn>
void for_each_tensor(torch::nn::Module& module, bool buffers, Fn&& fn) {
  std::unordered_set<const void*> seen;  // tied tensors once
  for (auto& p : module.named_parameters(/*recurse=*/true)) {
    if (p.value().defined() && seen.insert(p.value().unsafeGetTensorImpl()).second) fn(p.key(), p.value());
  }
  if (!buffers) return;
  for (auto& b : module.named_buffers(/*recurse=*/true)) {
    if (b.value().defined() && seen.insert(b.value().unsafeGetTensorImpl()).second) fn(b.key(), b.value());
  }
}

}  // namespace

at::Tensor deferred_tensor(at::IntArrayRef sizes, at::ScalarType dtype, DeferredReader reader) {
  return placeholder(sizes, dtype, std::move(reader));
}

void defer(const at::Tensor& t, DeferredReader reader) {
  at::Tensor var = t;  // set_data changes the shared TensorImpl, so every holder sees it
  var.set_data(placeholder(t.sizes(), t.scalar_type(), std::move(reader)));
}

void defer_parameters(torch::nn::Module& module) {
  for_each_tensor(module, /*buffers=*/false, [](const std::string&, const at::Tensor& t) { defer(t); });
}

bool is_deferred(const at::Tensor& t) { return placeholder_of(t) != nullptr; }

at::Tensor deferred_as(const at::Tensor& t, at::ScalarType dtype) {
  const Placeholder* p = placeholder_of(t);
  ST_CHECK(p != nullptr, InvalidArgument, "deferred_as: the tensor is not deferred");
  DeferredReader reader;
  if (p->reader) {
    reader = [inner = p->reader, from = t.scalar_type()](int64_t first, const at::Tensor& out) {
      if (out.scalar_type() == from) return inner(first, out);
      const at::Tensor staged = at::empty({out.numel()}, out.options().dtype(from));
      inner(first, staged);
      out.copy_(staged);
    };
  }
  return placeholder(t.sizes(), dtype, std::move(reader));
}

void read_deferred(const at::Tensor& t, int64_t first, const at::Tensor& out, const char* name) {
  const Placeholder* p = placeholder_of(t);
  ST_CHECK(p != nullptr && p->reader, InvalidArgument, "tensor '", name,
           "' is deferred but nothing says where its values come from; hint: load the model's "
           "weights (model.init_from) before training it, or build it without deferring");
  ST_CHECK(first >= 0 && first + out.numel() <= t.numel() && out.dim() == 1 && out.is_contiguous() &&
               out.scalar_type() == t.scalar_type(),
           InvalidArgument, "read_deferred: elements [", first, ", ", first + out.numel(),
           ") of tensor '", name, "' (", t.numel(), " elements, ", t.scalar_type(), ") into a ",
           out.scalar_type(), " buffer");
  if (out.numel() > 0) p->reader(first, out);
}

void materialize(torch::nn::Module& module) {
  at::NoGradGuard no_grad;
  for_each_tensor(module, /*buffers=*/true, [](const std::string& name, const at::Tensor& t) {
    if (!is_deferred(t)) return;
    const at::Tensor values = at::empty(t.sizes(), t.options().requires_grad(false));
    read_deferred(t, 0, values.view({-1}), name.c_str());
    at::Tensor var = t;
    var.set_data(values);
  });
}

}  // namespace shardtrain
