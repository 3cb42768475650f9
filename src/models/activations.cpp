// Autograd functions over the fused activation loops (activations.h).
#include "models/activations.h"

#include <ATen/record_function.h>
#include <torch/torch.h>

#include <algorithm>
#include <vector>

#include "models/activation_kernels.h"
#include "shardtrain/core/error.h"

namespace shardtrain::models::detail {

namespace {

constexpr int64_t kGrain = int64_t{1} << 15;

bool fusable(const at::Tensor& x) {
  return x.is_cpu() && x.is_contiguous() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16);
}

// fn(element type tag, first, count) over `n` elements in parallel chunks,
// the tag float for fp32 tensors and uint16_t for bf16 ones.
template <typename Fn>
void for_chunks(const at::Tensor& like, const Fn& fn) {
  with_element_type(like.scalar_type(), [&](auto tag) {
    at::parallel_for(0, like.numel(), kGrain, [&](int64_t b, int64_t e) { fn(tag, b, e - b); });
  });
}

struct FusedGelu : public torch::autograd::Function<FusedGelu> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x) {
    // Named as LibTorch's own GELU ops are (in a namespace of their own: the
    // profile takes shardtrain:: ranges for phases), so a profile shows these loops.
    RECORD_FUNCTION("fused::gelu", std::vector<c10::IValue>());
    ctx->save_for_backward({x});
    at::Tensor y = at::empty_like(x);
    for_chunks(x, [&](auto tag, int64_t i, int64_t n) {
      using T = decltype(tag);
      gelu_tanh_forward(elements<T>(x) + i, elements<T>(y) + i, n);
    });
    return y;
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    RECORD_FUNCTION("fused::gelu_backward", std::vector<c10::IValue>());
    const at::Tensor x = ctx->get_saved_variables()[0];
    const at::Tensor dy = grads[0].to(x.scalar_type()).contiguous();
    at::Tensor dx = at::empty_like(x);
    for_chunks(x, [&](auto tag, int64_t i, int64_t n) {
      using T = decltype(tag);
      gelu_tanh_backward(elements<T>(x) + i, elements<T>(dy) + i, elements<T>(dx) + i, n);
    });
    return {dx};
  }
};

struct FusedSwiGlu : public torch::autograd::Function<FusedSwiGlu> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& g, const at::Tensor& u) {
    RECORD_FUNCTION("fused::swiglu", std::vector<c10::IValue>());
    ctx->save_for_backward({g, u});
    at::Tensor y = at::empty_like(g);
    for_chunks(g, [&](auto tag, int64_t i, int64_t n) {
      using T = decltype(tag);
      swiglu_forward(elements<T>(g) + i, elements<T>(u) + i, elements<T>(y) + i, n);
    });
    return y;
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    RECORD_FUNCTION("fused::swiglu_backward", std::vector<c10::IValue>());
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &g = saved[0], &u = saved[1];
    const at::Tensor dy = grads[0].to(g.scalar_type()).contiguous();
    at::Tensor dg = at::empty_like(g), du = at::empty_like(u);
    for_chunks(g, [&](auto tag, int64_t i, int64_t n) {
      using T = decltype(tag);
      swiglu_backward(elements<T>(g) + i, elements<T>(u) + i, elements<T>(dy) + i, elements<T>(dg) + i,
                      elements<T>(du) + i, n);
    });
    return {dg, du};
  }
};

// Cross-entropy summed over rows, from each row's log-sum-exp: the forward
// keeps it (one float per row) beside the logits, and backward writes
// softmax - one-hot straight into the gradient. LibTorch's way keeps the
// log-softmax (another [N, V] tensor), and its backward fills a zero
// [N, V] gradient, scatters into it and makes a third [N, V] pass; under
// autocast it first copies bf16 logits to fp32.
struct FusedCrossEntropy : public torch::autograd::Function<FusedCrossEntropy> {
  // fn(element type tag, row, its logits, its target) for every row, in
  // parallel chunks.
  template <typename Fn>
  static void each_row(const at::Tensor& logits, const int64_t* target, const Fn& fn) {
    const int64_t rows = logits.size(0), vocab = logits.size(1);
    with_element_type(logits.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      const T* x = elements<T>(logits);
      at::parallel_for(0, rows, std::max<int64_t>(1, kGrain / std::max<int64_t>(vocab, 1)),
                       [&](int64_t first, int64_t last) {
                         for (int64_t r = first; r < last; ++r) fn(tag, r, x + r * vocab, target[r]);
                       });
    });
  }

  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& logits,
                            const at::Tensor& target, int64_t ignore_index) {
    RECORD_FUNCTION("fused::cross_entropy", std::vector<c10::IValue>());
    const int64_t rows = logits.size(0), vocab = logits.size(1);
    const at::Tensor targets = target.to(at::kLong).contiguous();
    const int64_t* t = targets.data_ptr<int64_t>();
    for (int64_t r = 0; r < rows; ++r) {
      ST_CHECK(t[r] == ignore_index || (t[r] >= 0 && t[r] < vocab), InvalidArgument, "cross-entropy: target ",
               t[r], " of row ", r, " is outside the vocabulary [0, ", vocab, ") and is not the ignore index ",
               ignore_index, "; check the data's token ids against model.vocab_size");
    }
    const at::Tensor lse = at::zeros({rows}, at::kFloat);
    std::vector<double> losses(static_cast<size_t>(rows), 0.0);
    each_row(logits, t, [&](auto, int64_t r, const auto* x, int64_t target_id) {
      if (target_id == ignore_index) return;
      thread_local std::vector<float> scratch;
      scratch.resize(static_cast<size_t>(vocab));
      losses[static_cast<size_t>(r)] =
          cross_entropy_row_forward(x, scratch.data(), vocab, target_id, lse.data_ptr<float>() + r);
    });
    double sum = 0.0;
    for (const double l : losses) sum += l;
    ctx->save_for_backward({logits, targets, lse});
    ctx->saved_data["ignore_index"] = ignore_index;
    return at::scalar_tensor(sum, at::kFloat);
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    RECORD_FUNCTION("fused::cross_entropy_backward", std::vector<c10::IValue>());
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &logits = saved[0], &targets = saved[1], &lse = saved[2];
    const int64_t ignore_index = ctx->saved_data["ignore_index"].toInt();
    const int64_t vocab = logits.size(1);
    const float g = grads[0].item<float>();
    at::Tensor dx = at::empty_like(logits);
    each_row(logits, targets.data_ptr<int64_t>(), [&](auto tag, int64_t r, const auto* x, int64_t target_id) {
      using T = decltype(tag);
      T* row = elements<T>(dx) + r * vocab;
      if (target_id == ignore_index) {
        std::fill(row, row + vocab, T{0});
      } else {
        cross_entropy_row_backward(x, row, vocab, lse.data_ptr<float>()[r], g, target_id);
      }
    });
    return {dx, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor gelu_tanh(const at::Tensor& x) {
  return fusable(x) ? FusedGelu::apply(x) : torch::gelu(x, "tanh");
}

at::Tensor swiglu(const at::Tensor& g, const at::Tensor& u) {
  const bool fused = fusable(g) && u.is_contiguous() && g.sizes() == u.sizes() && g.scalar_type() == u.scalar_type();
  return fused ? FusedSwiGlu::apply(g, u) : at::silu(g) * u;
}

at::Tensor cross_entropy_sum(const at::Tensor& logits, const at::Tensor& target, int64_t ignore_index) {
  if (fusable(logits) && logits.dim() == 2 && target.dim() == 1 && target.size(0) == logits.size(0) &&
      logits.size(1) > 0) {
    return FusedCrossEntropy::apply(logits, target, ignore_index);
  }
  namespace F = torch::nn::functional;
  return F::cross_entropy(logits, target,
                          F::CrossEntropyFuncOptions().reduction(torch::kSum).ignore_index(ignore_index));
}

}  // namespace shardtrain::models::detail
