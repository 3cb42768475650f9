// Causal, grouped-query attention for the language-model families: fused
// panels on the CPU in fp32 and bf16, an additive mask elsewhere.
#include "models/attention.h"

#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <ATen/record_function.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <string>
#include <type_traits>
#include <unordered_set>
#include <utility>
#include <vector>

#include "models/activation_kernels.h"
#include "models/activations.h"

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

// softmax(q k^T * scale) v over each query's keys for q [B*H, T, d] and k, v
// [B*H, S, d] of one dtype, fp32 or bf16, on the CPU. Query i sees keys
// starts[b, i] .. i + S - T (starts [B, T] from segment_starts; empty: from
// key 0).
//
// The work goes by panels: kPanel queries of a group of matrices small
// enough that a panel's scores stay in cache. A panel's scores are one
// batched GEMM against only the keys its last query sees, its softmax
// scales, masks and normalises each row in one pass (models/
// activation_kernels), and its output is one GEMM over the same keys. Only
// each row's maximum and 1 / sum are kept for backward, which computes the
// panel's weights again from them, then the gradients of the weights, the
// scores and q, and adds the panel's share to those of k and v. So no
// [T, S] matrix is ever materialised or kept, no mask either, and the GEMMs
// skip most of the upper triangle, where causal attention has nothing.
struct CausalAttention : public torch::autograd::Function<CausalAttention> {
  static constexpr int64_t kPanel = 128;
  static constexpr int64_t kPanelBytes = int64_t{1} << 19;  // a group's panel of scores

  // One panel: matrices [g0, g1) and queries [r0, r1), which see keys
  // [0, cols) at most; `per` and `ld` are a scratch buffer's strides.
  struct Panel {
    int64_t g0, g1, r0, r1, cols, per, ld;
    at::Tensor scratch(const at::Tensor& buffer) const {
      return buffer.slice(0, 0, g1 - g0).slice(1, 0, r1 - r0).slice(2, 0, cols);
    }
    at::Tensor rows(const at::Tensor& x) const { return x.slice(0, g0, g1).slice(1, r0, r1); }
    at::Tensor keys(const at::Tensor& x) const { return x.slice(0, g0, g1).slice(1, 0, cols); }
    // Where the row of matrix m, query i starts in a scratch buffer.
    int64_t offset(int64_t m, int64_t i) const { return (m - g0) * per + (i - r0) * ld; }
  };

  // The panels of one call and the scratch buffers they share.
  struct Panels {
    int64_t matrices, t, s, group, heads;
    const at::Tensor& starts;
    at::ScalarType dtype;

    Panels(const at::Tensor& q, const at::Tensor& k, int64_t heads, const at::Tensor& starts)
        : matrices(q.size(0)), t(q.size(1)), s(k.size(1)),
          group(std::max<int64_t>(1, kPanelBytes / (kPanel * s * static_cast<int64_t>(q.element_size())))),
          heads(heads), starts(starts), dtype(q.scalar_type()) {}

    at::Tensor buffer(const at::Tensor& like) const {
      return at::empty({std::min(group, matrices), std::min(kPanel, t), s}, like.options());
    }

    template <typename Fn>
    void each(const Fn& fn) const {
      const int64_t per = std::min(kPanel, t) * s;
      for (int64_t g0 = 0; g0 < matrices; g0 += group) {
        for (int64_t r0 = 0; r0 < t; r0 += kPanel) {
          const int64_t r1 = std::min(t, r0 + kPanel);
          fn(Panel{g0, std::min(matrices, g0 + group), r0, r1, r1 + s - t, per, s});
        }
      }
    }

    // fn(tag, matrix, query, lo, hi) for every row of a panel (the query
    // sees keys [lo, hi)), in parallel chunks; the tag is float for fp32 and
    // uint16_t for bf16.
    template <typename Fn>
    void each_row(const Panel& panel, const Fn& fn) const {
      const int64_t* start = starts.numel() > 0 ? starts.data_ptr<int64_t>() : nullptr;
      const int64_t rows = panel.r1 - panel.r0;
      const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / s);
      with_element_type(dtype, [&](auto tag) {
        at::parallel_for(0, (panel.g1 - panel.g0) * rows, grain, [&](int64_t first, int64_t last) {
          for (int64_t n = first; n < last; ++n) {
            const int64_t m = panel.g0 + n / rows, i = panel.r0 + n % rows;
            const int64_t lo = start ? start[(m / heads) * t + i] : 0;
            fn(tag, m, i, lo, i + s - t + 1);
          }
        });
      });
    }
  };

  // out = a @ b into `out`, a view of a larger buffer.
  static void gemm_into(at::Tensor out, const at::Tensor& a, const at::Tensor& b) { at::bmm_out(out, a, b); }

  // acc += a @ b; acc may be fp32 where a and b are bf16.
  static void gemm_add(at::Tensor acc, const at::Tensor& a, const at::Tensor& b) {
    if (acc.scalar_type() == a.scalar_type()) {
      acc.baddbmm_(a, b);
    } else {
      acc.add_(at::bmm(a, b));
    }
  }

  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, double scale, int64_t heads, const at::Tensor& starts) {
    RECORD_FUNCTION("fused::causal_attention", std::vector<c10::IValue>());
    // The inputs are in the compute dtype already; autocast must not recast.
    const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCPU);
    const Panels p(q, k, heads, starts);
    const at::Tensor scores = p.buffer(q), att = p.buffer(q);
    const at::Tensor stats = at::empty({p.matrices, p.t, 2}, q.options().dtype(at::kFloat));
    const at::Tensor out = at::empty_like(q);
    const float fscale = static_cast<float>(scale);
    p.each([&](const Panel& panel) {
      gemm_into(panel.scratch(scores), panel.rows(q), panel.keys(k).transpose(1, 2));
      p.each_row(panel, [&](auto tag, int64_t m, int64_t i, int64_t lo, int64_t hi) {
        using T = decltype(tag);
        const T* x = elements<T>(scores) + panel.offset(m, i);
        T* y = elements<T>(att) + panel.offset(m, i);
        float* row_stats = stats.data_ptr<float>() + (m * p.t + i) * 2;
        if constexpr (std::is_same_v<T, float>) {
          softmax_row_forward(x, y, panel.cols, lo, hi, fscale, row_stats);
        } else {
          thread_local std::vector<float> scratch;
          scratch.resize(static_cast<size_t>(panel.cols));
          softmax_row_forward(x, y, scratch.data(), panel.cols, lo, hi, fscale, row_stats);
        }
      });
      gemm_into(panel.rows(out), panel.scratch(att), panel.keys(v));
    });
    ctx->save_for_backward({q, k, v, stats, starts});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["heads"] = heads;
    return out;
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    RECORD_FUNCTION("fused::causal_attention_backward", std::vector<c10::IValue>());
    const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCPU);
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &stats = saved[3], &starts = saved[4];
    const float scale = static_cast<float>(ctx->saved_data["scale"].toDouble());
    const Panels p(q, k, ctx->saved_data["heads"].toInt(), starts);
    const at::Tensor dout = grads[0].to(q.scalar_type()).contiguous();
    // `work` holds the scores, then the gradient of the weights.
    const at::Tensor work = p.buffer(q), att = p.buffer(q), dscores = p.buffer(q);
    const at::Tensor dq = at::empty_like(q);
    // The gradients of k and v add up over the panels: in fp32 for bf16 too.
    const at::Tensor dk = at::zeros(k.sizes(), k.options().dtype(at::kFloat));
    const at::Tensor dv = at::zeros(v.sizes(), v.options().dtype(at::kFloat));
    p.each([&](const Panel& panel) {
      gemm_into(panel.scratch(work), panel.rows(q), panel.keys(k).transpose(1, 2));
      p.each_row(panel, [&](auto tag, int64_t m, int64_t i, int64_t lo, int64_t hi) {
        using T = decltype(tag);
        const int64_t at_row = panel.offset(m, i);
        softmax_row_again(elements<T>(work) + at_row, elements<T>(att) + at_row, panel.cols, lo, hi, scale,
                          stats.data_ptr<float>() + (m * p.t + i) * 2);
      });
      gemm_into(panel.scratch(work), panel.rows(dout), panel.keys(v).transpose(1, 2));
      p.each_row(panel, [&](auto tag, int64_t m, int64_t i, int64_t lo, int64_t hi) {
        using T = decltype(tag);
        const int64_t at_row = panel.offset(m, i);
        softmax_row_backward(elements<T>(att) + at_row, elements<T>(work) + at_row, elements<T>(dscores) + at_row,
                             panel.cols, lo, hi, scale);
      });
      gemm_into(panel.rows(dq), panel.scratch(dscores), panel.keys(k));
      gemm_add(panel.keys(dk), panel.scratch(dscores).transpose(1, 2), panel.rows(q));
      gemm_add(panel.keys(dv), panel.scratch(att).transpose(1, 2), panel.rows(dout));
    });
    return {dq, dk.to(k.scalar_type()), dv.to(v.scalar_type()), at::Tensor(), at::Tensor(), at::Tensor()};
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
  if (q.is_cpu() && fused_dtype && !drop) {
    const at::Tensor starts = segment.defined() ? segment_starts(segment) : at::empty({0}, at::kLong);
    if (!segment.defined() || starts.defined()) {
      const auto in = [&](const at::Tensor& x) { return x.to(dtype).contiguous(); };
      const at::Tensor out = CausalAttention::apply(in(q.reshape({b * h, t, d})), in(expand(k)), in(expand(v)),
                                                    scale, h, starts);
      return out.view({b, h, t, d});
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
