// int8 (row absmax) and nf4 (blockwise NormalFloat) weight quantization.
#include "shardtrain/models/quantize.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

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

// Nearest code value: the code is ascending, so count the midpoints below x
// (what bucketize over the midpoints gives), block by block in one pass: the
// same float operations as the tensor form, at a fraction of its time.
void nf4_block_absmax(const float* x, int64_t blocks, float* absmax) {
  for (int64_t b = 0; b < blocks; ++b) {
    const float* v = x + b * kNf4Block;
    float m = 0.0f;
    for (int64_t i = 0; i < kNf4Block; ++i) m = std::max(m, std::abs(v[i]));
    absmax[b] = m;
  }
}

void nf4_encode(const float* x, const float* absmax, int64_t blocks, uint8_t* codes) {
  float mids[15];
  for (int i = 0; i < 15; ++i) mids[i] = (kNf4[i] + kNf4[i + 1]) / 2.0f;
  for (int64_t b = 0; b < blocks; ++b) {
    const float* v = x + b * kNf4Block;
    const float scale = absmax[b] > 0.0f ? absmax[b] : 1.0f;
    uint8_t* out = codes + b * kNf4Block / 2;
    for (int64_t i = 0; i < kNf4Block; i += 2) {
      uint8_t hi = 0, lo = 0;
      const float a = v[i] / scale, c = v[i + 1] / scale;
      for (const float mid : mids) {
        hi = static_cast<uint8_t>(hi + (a > mid));
        lo = static_cast<uint8_t>(lo + (c > mid));
      }
      out[i / 2] = static_cast<uint8_t>(hi * 16 + lo);
    }
  }
}

QuantizedWeight nf4_scales_of(const at::Tensor& absmax, bool double_quant) {
  at::NoGradGuard no_grad;
  QuantizedWeight q;
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

QuantizedWeight quantize_nf4(const at::Tensor& weight, bool double_quant) {
  ST_CHECK(weight.is_floating_point() && weight.numel() % kNf4Block == 0, InvalidArgument,
           "quantize_nf4 expects a floating weight with a multiple of ", kNf4Block,
           " elements, got ", weight.sizes(), " ", weight.scalar_type());
  at::NoGradGuard no_grad;
  const at::Tensor w = weight.detach().to(at::kFloat).contiguous();
  const int64_t count = w.numel() / kNf4Block;
  const at::Tensor absmax = at::empty({count}, at::TensorOptions().dtype(at::kFloat));
  const at::Tensor codes = at::empty({count * kNf4Block / 2}, at::TensorOptions().dtype(at::kByte));
  const float* src = w.data_ptr<float>();
  float* amax = absmax.data_ptr<float>();
  uint8_t* out = codes.data_ptr<uint8_t>();
  at::parallel_for(0, count, 1024, [&](int64_t begin, int64_t end) {
    nf4_block_absmax(src + begin * kNf4Block, end - begin, amax + begin);
    nf4_encode(src + begin * kNf4Block, amax + begin, end - begin, out + begin * kNf4Block / 2);
  });
  QuantizedWeight q = nf4_scales_of(absmax, double_quant);
  q.codes = codes;
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
