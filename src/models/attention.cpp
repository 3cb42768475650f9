// Causal masks and grouped-query attention for the language-model families.
#include "models/attention.h"

#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <map>
#include <string>
#include <utility>

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

}  // namespace

at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& segment, double dropout, bool training) {
  const int64_t b = q.size(0), h = q.size(1), t = q.size(2), d = q.size(3);
  const int64_t kv = k.size(1), s = k.size(2);
  auto expand = [&](const at::Tensor& x) {  // [B, KV, S, d] -> [B*H, S, d]
    if (kv == h) return x.reshape({b * h, s, d});
    return x.unsqueeze(2).expand({b, kv, h / kv, s, d}).reshape({b * h, s, d});
  };
  // Scores = q k^T / sqrt(d) + mask in one batched GEMM: baddbmm starts from
  // the additive mask and adds alpha * q k^T to it, instead of a GEMM, a
  // scaling pass and a masking pass (and their backward passes).
  const at::ScalarType dtype = mask_dtype(q);
  at::Tensor mask;
  if (segment.defined()) {
    mask = segment_mask(segment, dtype).unsqueeze(1).expand({b, h, t, t}).reshape({b * h, t, t});
  } else {
    mask = causal_mask(s, dtype, q.device()).slice(0, s - t, s).expand({b * h, t, s});
  }
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  auto att = at::baddbmm(mask, q.reshape({b * h, t, d}), expand(k).transpose(1, 2),
                         /*beta=*/1.0, /*alpha=*/scale);
  att = at::softmax(att, -1);
  if (dropout > 0.0 && training) att = at::dropout(att, dropout, /*train=*/true);
  return at::bmm(att, expand(v)).view({b, h, t, d});
}

at::Tensor append_cache(at::Tensor& cached, const at::Tensor& x) {
  cached = cached.defined() ? at::cat({cached, x}, 2) : x;
  return cached;
}

}  // namespace shardtrain::models::detail
