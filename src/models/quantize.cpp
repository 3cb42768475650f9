// int8 (row absmax) and nf4 (blockwise NormalFloat) weight quantization.
#include "shardtrain/models/quantize.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "shardtrain/core/error.h"

namespace shardtrain::models {

namespace {

// NF4 (Dettmers et al., 2023): 8 quantiles of N(0, 1) above zero and 7 below,
// each half normalised to [-1, 1], plus an exact zero.
constexpr float kNf4[16] = {
    -1.0f,
    -0.6961928009986877f,
    -0.5250730514526367f,
    -0.39491748809814453f,
    -0.28444138169288635f,
    -0.18477343022823334f,
    -0.09105003625154495f,
    0.0f,
    0.07958029955625534f,
    0.16093020141124725f,
    0.24611230194568634f,
    0.33791524171829224f,
    0.44070982933044434f,
    0.5626170039176941f,
    0.7229568362236023f,
    1.0f,
};

// A divisor that is 1 where the absmax is 0: an all-zero row or block
// quantizes to code 0 and dequantizes to exact zeros.
at::Tensor safe(const at::Tensor& absmax) {
  return at::where(absmax > 0, absmax, at::ones_like(absmax));
}

}  // namespace

at::Tensor nf4_code() { return at::tensor(at::ArrayRef<float>(kNf4, 16)); }

QuantizedWeight quantize_int8(const at::Tensor& weight) {
  ST_CHECK(weight.dim() == 2 && weight.is_floating_point(), InvalidArgument,
           "quantize_int8 expects a 2-D floating weight, got ", weight.sizes(), " ",
           weight.scalar_type());
  at::NoGradGuard no_grad;
  const at::Tensor w = weight.detach().to(at::kFloat);
  QuantizedWeight q;
  q.scales = w.abs().amax(/*dim=*/1);
  q.codes = (w * (127.0 / safe(q.scales)).unsqueeze(1)).round().clamp(-127, 127).to(at::kChar);
  return q;
}

at::Tensor dequantize_int8(const at::Tensor& codes, const at::Tensor& scales) {
  return codes.to(at::kFloat) * (scales.to(at::kFloat) / 127.0).unsqueeze(1);
}

QuantizedWeight quantize_nf4(const at::Tensor& weight, bool double_quant) {
  ST_CHECK(weight.is_floating_point() && weight.numel() % kNf4Block == 0, InvalidArgument,
           "quantize_nf4 expects a floating weight with a multiple of ", kNf4Block,
           " elements, got ", weight.sizes(), " ", weight.scalar_type());
  at::NoGradGuard no_grad;
  const at::Tensor blocks = weight.detach().reshape({-1, kNf4Block});
  const int64_t count = blocks.size(0);
  QuantizedWeight q;
  const at::Tensor absmax = at::empty({count}, at::TensorOptions().dtype(at::kFloat));
  q.codes = at::empty({count * kNf4Block / 2}, at::TensorOptions().dtype(at::kByte));
  // Nearest code value: the code is ascending, so count the midpoints below x.
  const at::Tensor code = nf4_code();
  const at::Tensor mids = (code.slice(0, 0, 15) + code.slice(0, 1, 16)) / 2;
  // In chunks of blocks, so the temporaries stay a few MB whatever the
  // weight's size (and are reused, not mapped afresh for each weight).
  constexpr int64_t kChunk = 8192;
  for (int64_t first = 0; first < count; first += kChunk) {
    const int64_t n = std::min(kChunk, count - first);
    const at::Tensor b = blocks.narrow(0, first, n).to(at::kFloat);
    at::Tensor a = absmax.narrow(0, first, n);
    at::amax_out(a, b.abs(), /*dim=*/1);
    const at::Tensor x = (b / safe(a).unsqueeze(1)).reshape({-1});
    const at::Tensor pairs = at::bucketize(x, mids, /*out_int32=*/true, /*right=*/false).view({-1, 2});
    q.codes.narrow(0, first * kNf4Block / 2, n * kNf4Block / 2)
        .copy_(pairs.select(1, 0) * 16 + pairs.select(1, 1));
  }
  if (!double_quant) {
    q.scales = absmax;
    return q;
  }
  // Double quantization: int8 of (absmax - mean), one fp32 scale per group.
  q.scales_mean = absmax.mean().reshape({1});
  const int64_t n = absmax.numel();
  const int64_t groups = (n + kScaleBlock - 1) / kScaleBlock;
  at::Tensor centred = at::zeros({groups * kScaleBlock}, absmax.options());
  centred.narrow(0, 0, n).copy_(absmax - q.scales_mean);
  const at::Tensor g = centred.view({groups, kScaleBlock});
  q.scales_scale = g.abs().amax(/*dim=*/1);
  q.scales_q = (g * (127.0 / safe(q.scales_scale)).unsqueeze(1))
                   .round()
                   .clamp(-127, 127)
                   .to(at::kChar)
                   .reshape({-1})
                   .narrow(0, 0, n)
                   .contiguous();
  return q;
}

at::Tensor nf4_scales(const QuantizedWeight& q) {
  if (!q.scales_q.defined()) return q.scales;
  const int64_t n = q.scales_q.numel();
  const at::Tensor per = (q.scales_scale.to(at::kFloat) / 127.0).repeat_interleave(kScaleBlock);
  return q.scales_q.to(at::kFloat) * per.narrow(0, 0, n) + q.scales_mean.to(at::kFloat);
}

namespace {

// The two code values of every byte, [256, 2]: dequantizing is then one
// gather per byte instead of unpacking nibbles (this runs in every forward
// and backward of a QLoRA layer).
const at::Tensor& nf4_byte_table() {
  static const at::Tensor table = [] {
    const at::Tensor byte = at::arange(256, at::kLong);
    const at::Tensor code = nf4_code();
    return at::stack({code.index_select(0, byte.div(16, "floor")), code.index_select(0, byte.remainder(16))}, 1)
        .contiguous();
  }();
  return table;
}

}  // namespace

at::Tensor dequantize_nf4(const at::Tensor& codes, const at::Tensor& scales,
                          at::IntArrayRef shape) {
  const at::Tensor values = nf4_byte_table().index_select(0, codes.to(at::kLong)).view({-1, kNf4Block});
  return (values * scales.to(at::kFloat).unsqueeze(1)).view(shape);
}

}  // namespace shardtrain::models
