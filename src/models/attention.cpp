// Causal, grouped-query attention for the language-model families: fused
// panels on the CPU (computed in fp32, for bf16 too), an additive mask
// elsewhere.
#include "models/attention.h"

#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <ATen/record_function.h>
#include <dlfcn.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "models/activation_kernels.h"
#include "shardtrain/core/error.h"

namespace shardtrain::models::detail {

namespace {

// The additive causal mask [T, T]: 0 on and below the diagonal, -inf above.
// One mask per dtype and device (per thread), as large as the largest T
// asked for; smaller T get its top-left corner.
at::Tensor causal_mask(int64_t t, at::ScalarType dtype, const at::Device& device) {
  thread_local std::map<std::pair<at::ScalarType, std::string>, at::Tensor> masks;
  auto& mask = masks[{dtype, device.str()}];
  if (!mask.defined() || mask.size(0) < t) {
    at::NoGradGuard no_grad;
    mask = at::full({t, t}, -std::numeric_limits<double>::infinity(),
                    at::TensorOptions().dtype(dtype).device(device))
               .triu(/*diagonal=*/1);
  }
  return mask.size(0) == t ? mask : mask.slice(0, 0, t).slice(1, 0, t);
}

// The dtype the attention scores are computed in: autocast's when it is on
// for x's device (so autocast does not cast the mask on every call), else x's.
at::ScalarType mask_dtype(const at::Tensor& x) {
  if (x.is_cpu() && at::autocast::is_cpu_enabled()) return at::autocast::get_autocast_cpu_dtype();
  if (x.is_cuda() && at::autocast::is_enabled()) return at::autocast::get_autocast_gpu_dtype();
  return x.scalar_type();
}

// The additive mask [B, T, T] of packed rows: query i sees key j when j <= i
// and both lie in the same segment.
at::Tensor segment_mask(const at::Tensor& segment, at::ScalarType dtype) {
  at::NoGradGuard no_grad;
  const int64_t t = segment.size(1);
  const auto same = segment.unsqueeze(2).eq(segment.unsqueeze(1));  // [B, T, T]
  const auto causal = at::ones({t, t}, segment.options().dtype(at::kBool)).tril();
  const auto zeros = at::zeros({}, segment.options().dtype(dtype));
  return at::where(same.logical_and(causal), zeros,
                   at::full({}, -std::numeric_limits<double>::infinity(), zeros.options()));
}

// For each position of packed rows [B, T], where the run of its segment
// starts; undefined where a segment id comes back after another in a row
// (its keys are then no one range, and the mask applies).
at::Tensor segment_starts(const at::Tensor& segment) {
  const at::Tensor ids = segment.to(at::kLong).contiguous();
  at::Tensor starts = at::empty_like(ids);
  const int64_t rows = ids.size(0), t = ids.size(1);
  const int64_t* id = ids.data_ptr<int64_t>();
  int64_t* start = starts.data_ptr<int64_t>();
  std::unordered_set<int64_t> seen;
  for (int64_t r = 0; r < rows; ++r, id += t, start += t) {
    seen.clear();
    for (int64_t i = 0; i < t; ++i) {
      if (i == 0 || id[i] != id[i - 1]) {
        if (!seen.insert(id[i]).second) return {};
        start[i] = i;
      } else {
        start[i] = start[i - 1];
      }
    }
  }
  return starts;
}

// c [m, n] = a b + beta c for row-major fp32 matrices with row strides
// lda, ldb, ldc: a [m, k], or stored [k, m] when `ta`; b [k, n], or stored
// [n, k] when `tb`. The BLAS LibTorch multiplies with, called directly on
// raw strided matrices: no tensor views, no dispatch, no copies.
void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
          int64_t ldb, float beta, float* c, int64_t ldc) {
  using Sgemm = void (*)(const char*, const char*, const int*, const int*, const int*, const float*,
                         const float*, const int*, const float*, const int*, const float*, float*, const int*);
  static const Sgemm sgemm = [] {
    const auto fn = reinterpret_cast<Sgemm>(dlsym(RTLD_DEFAULT, "sgemm_"));
    ST_CHECK(fn != nullptr, Error, "causal attention: no BLAS sgemm_ is loaded beside LibTorch; "
             "install the BLAS LibTorch was built with (libopenblas0)");
    return fn;
  }();
  // Column-major BLAS sees each row-major matrix transposed: c^T = b^T a^T.
  const char transa = ta ? 'T' : 'N', transb = tb ? 'T' : 'N';
  const int cm = static_cast<int>(n), cn = static_cast<int>(m), ck = static_cast<int>(k);
  const int la = static_cast<int>(ldb), lb = static_cast<int>(lda), lc = static_cast<int>(ldc);
  const float one = 1.0f;
  sgemm(&transb, &transa, &cm, &cn, &ck, &one, b, &la, a, &lb, &beta, c, &lc);
}

// A stack of fp32 matrices x [B, H, rows, d], each row's d elements
// contiguous: matrix (b, h), row i at at(b, h) + i * ld.
struct Stack {
  float* data;
  int64_t sb, sh, ld;
  explicit Stack(const at::Tensor& x)
      : data(x.data_ptr<float>()), sb(x.stride(0)), sh(x.stride(1)),
        ld(std::max(x.stride(2), x.size(3))) {}
  float* at(int64_t b, int64_t h, int64_t i = 0) const { return data + b * sb + h * sh + i * ld; }
};

// x as the fused attention reads it: fp32, each row's elements contiguous
// and rows apart (the heads of a projection's output are, as views).
at::Tensor as_stack(const at::Tensor& x) {
  const at::Tensor y = x.to(at::kFloat);
  const bool rows_apart = y.size(2) <= 1 || y.stride(2) >= y.size(3);
  return y.stride(3) == 1 && rows_apart ? y : y.contiguous();
}

// softmax(q k^T * scale) v for q [B, H, T, d] and k, v [B, KV, S, d] in
// fp32 on the CPU, any strides as_stack() allows (views of the projections'
// outputs need no copy). Query head h reads key/value head h / (H / KV).
// Query i sees keys starts[b, i] .. i + S - T (starts [B, T] from
// segment_starts; empty: from key 0). The output is laid out [B, T, H, d]
// (viewed [B, H, T, d]), as the output projection reads it.
//
// The work goes by panels of kPanel queries of one matrix: its scores
// (one GEMM against only the keys its last query sees) stay in cache, its
// softmax scales, masks and normalises each row in one pass (models/
// activation_kernels), and its output is one GEMM over the same keys. Only
// each row's maximum and 1 / sum are kept for backward, which computes the
// panel's weights again from them, then the gradients of the weights, the
// scores and q, and adds the panel's share to those of k and v. So no
// [T, S] matrix is ever materialised or kept, no mask either, and the GEMMs
// skip most of the upper triangle, where causal attention has nothing.
struct CausalAttention : public torch::autograd::Function<CausalAttention> {
  static constexpr int64_t kPanel = 128;

  // Queries [r0, r1) of matrix (b, h), which see keys [0, cols) at most,
  // those of key/value head g.
  struct Panel {
    int64_t b, h, g, r0, r1, cols;
    int64_t rows() const { return r1 - r0; }
  };

  struct Shape {
    int64_t batch, heads, kv_heads, t, s, d;
    explicit Shape(const at::Tensor& q, const at::Tensor& k)
        : batch(q.size(0)), heads(q.size(1)), kv_heads(k.size(1)), t(q.size(2)), s(k.size(2)), d(q.size(3)) {}

    // Room for one panel's rows of scores.
    at::Tensor scratch() const { return at::empty({std::min(kPanel, t) * s}, at::kFloat); }

    template <typename Fn>
    void each(const Fn& fn) const {
      for (int64_t b = 0; b < batch; ++b) {
        for (int64_t h = 0; h < heads; ++h) {
          for (int64_t r0 = 0; r0 < t; r0 += kPanel) {
            const int64_t r1 = std::min(t, r0 + kPanel);
            fn(Panel{b, h, h / (heads / kv_heads), r0, r1, r1 + s - t});
          }
        }
      }
    }

    // out [rows, cols] = a b^T for a panel: a's rows are its queries' (of
    // head h), b's its keys' (of head g). The scores q k^T (unscaled), or in
    // backward dout v^T, the gradient of the weights.
    void scores(const Panel& p, const Stack& a, const Stack& b, float* out) const {
      gemm(false, true, p.rows(), p.cols, d, a.at(p.b, p.h, p.r0), a.ld, b.at(p.b, p.g), b.ld, 0.0f, out, p.cols);
    }

    // The first of a panel's matrix's rows of stats [B, H, T, 2].
    float* stats_of(const at::Tensor& stats, const Panel& p) const {
      return stats.data_ptr<float>() + (p.b * heads + p.h) * t * 2;
    }

    // fn(row, query, lo, hi) for every row of a panel (row: its index in the
    // panel; the query sees keys [lo, hi)), in parallel chunks.
    template <typename Fn>
    void each_row(const Panel& p, const at::Tensor& starts, const Fn& fn) const {
      const int64_t* start = starts.numel() > 0 ? starts.data_ptr<int64_t>() + p.b * t : nullptr;
      const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / s);
      at::parallel_for(0, p.rows(), grain, [&](int64_t first, int64_t last) {
        for (int64_t r = first; r < last; ++r) {
          const int64_t i = p.r0 + r;
          fn(r, i, start ? start[i] : 0, i + s - t + 1);
        }
      });
    }
  };

  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, double scale, const at::Tensor& starts) {
    RECORD_FUNCTION("fused::causal_attention", std::vector<c10::IValue>());
    const Shape n(q, k);
    const at::Tensor out = at::empty({n.batch, n.t, n.heads, n.d}, q.options()).transpose(1, 2);
    const at::Tensor stats = at::empty({n.batch, n.heads, n.t, 2}, q.options());
    const at::Tensor scores_buffer = n.scratch(), att_buffer = n.scratch();
    float *scores = scores_buffer.data_ptr<float>(), *att = att_buffer.data_ptr<float>();
    const Stack Q(q), K(k), V(v), O(out);
    const float fscale = static_cast<float>(scale);
    n.each([&](const Panel& p) {
      n.scores(p, Q, K, scores);
      float* row_stats = n.stats_of(stats, p);
      n.each_row(p, starts, [&](int64_t r, int64_t i, int64_t lo, int64_t hi) {
        softmax_row_forward(scores + r * p.cols, att + r * p.cols, p.cols, lo, hi, fscale, row_stats + i * 2);
      });
      gemm(false, false, p.rows(), n.d, p.cols, att, p.cols, V.at(p.b, p.g), V.ld, 0.0f, O.at(p.b, p.h, p.r0),
           O.ld);
    });
    ctx->save_for_backward({q, k, v, stats, starts});
    ctx->saved_data["scale"] = scale;
    return out;
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    RECORD_FUNCTION("fused::causal_attention_backward", std::vector<c10::IValue>());
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &stats = saved[3], &starts = saved[4];
    const float scale = static_cast<float>(ctx->saved_data["scale"].toDouble());
    const Shape n(q, k);
    const at::Tensor dout = as_stack(grads[0]);
    const at::Tensor dq = at::empty({n.batch, n.t, n.heads, n.d}, q.options()).transpose(1, 2);
    // The gradients of k and v add up over the panels (and over the query
    // heads that share a key/value head).
    const at::Tensor dk = at::zeros({n.batch, n.kv_heads, n.s, n.d}, k.options());
    const at::Tensor dv = at::zeros({n.batch, n.kv_heads, n.s, n.d}, v.options());
    // `work` holds the scores, then the gradient of the weights.
    const at::Tensor work_buffer = n.scratch(), att_buffer = n.scratch(), dscores_buffer = n.scratch();
    float *work = work_buffer.data_ptr<float>(), *att = att_buffer.data_ptr<float>(),
          *dscores = dscores_buffer.data_ptr<float>();
    const Stack Q(q), K(k), V(v), dO(dout), dQ(dq), dK(dk), dV(dv);
    n.each([&](const Panel& p) {
      const int64_t rows = p.rows(), cols = p.cols;
      n.scores(p, Q, K, work);
      const float* row_stats = n.stats_of(stats, p);
      n.each_row(p, starts, [&](int64_t r, int64_t i, int64_t lo, int64_t hi) {
        softmax_row_again(work + r * cols, att + r * cols, cols, lo, hi, scale, row_stats + i * 2);
      });
      n.scores(p, dO, V, work);
      n.each_row(p, starts, [&](int64_t r, int64_t, int64_t lo, int64_t hi) {
        softmax_row_backward(att + r * cols, work + r * cols, dscores + r * cols, cols, lo, hi, scale);
      });
      gemm(false, false, rows, n.d, cols, dscores, cols, K.at(p.b, p.g), K.ld, 0.0f, dQ.at(p.b, p.h, p.r0),
           dQ.ld);
      gemm(true, false, cols, n.d, rows, dscores, cols, Q.at(p.b, p.h, p.r0), Q.ld, 1.0f, dK.at(p.b, p.g),
           dK.ld);
      gemm(true, false, cols, n.d, rows, att, cols, dO.at(p.b, p.h, p.r0), dO.ld, 1.0f, dV.at(p.b, p.g), dV.ld);
    });
    return {dq, dk, dv, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& segment, double dropout, bool training) {
  const int64_t b = q.size(0), h = q.size(1), t = q.size(2), d = q.size(3);
  const int64_t kv = k.size(1), s = k.size(2);
  auto expand = [&](const at::Tensor& x) {  // [B, KV, S, d] -> [B*H, S, d]
    if (kv == h) return x.reshape({b * h, s, d});
    return x.unsqueeze(2).expand({b, kv, h / kv, s, d}).reshape({b * h, s, d});
  };
  const at::ScalarType dtype = mask_dtype(q);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const bool drop = dropout > 0.0 && training;
  // On the CPU in fp32 and bf16, without dropout: the fused panels.
  const bool fused_dtype = dtype == at::kFloat || dtype == at::kBFloat16;
  if (q.is_cpu() && fused_dtype && !drop && q.numel() > 0 && d > 0) {
    const at::Tensor starts = segment.defined() ? segment_starts(segment) : at::empty({0}, at::kLong);
    if (!segment.defined() || starts.defined()) {
      // In fp32 for bf16 too (docs/performance.md): its output is rounded
      // to bf16 once.
      return CausalAttention::apply(as_stack(q), as_stack(k), as_stack(v), scale, starts).to(dtype);
    }
  }
  // Elsewhere, scores = q k^T / sqrt(d) + mask in one batched GEMM: baddbmm
  // starts from the additive mask and adds alpha * q k^T to it, instead of a
  // GEMM, a scaling pass and a masking pass (and their backward passes).
  const at::Tensor mask =
      segment.defined() ? segment_mask(segment, dtype).unsqueeze(1).expand({b, h, t, t}).reshape({b * h, t, t})
                        : causal_mask(s, dtype, q.device()).slice(0, s - t, s).expand({b * h, t, s});
  at::Tensor att = at::softmax(
      at::baddbmm(mask, q.reshape({b * h, t, d}), expand(k).transpose(1, 2), /*beta=*/1.0, /*alpha=*/scale), -1);
  if (drop) att = at::dropout(att, dropout, /*train=*/true);
  return at::bmm(att, expand(v)).view({b, h, t, d});
}

at::Tensor append_cache(at::Tensor& cached, const at::Tensor& x) {
  cached = cached.defined() ? at::cat({cached, x}, 2) : x;
  return cached;
}

}  // namespace shardtrain::models::detail
