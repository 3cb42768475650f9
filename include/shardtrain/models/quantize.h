// Weight quantization for a frozen LoRA base (QLoRA).
//
// int8: per output channel (row) absmax. code = round(127 * w / absmax_row),
//       w' = code * absmax_row / 127. Codes int8 [out, in], scales fp32 [out].
// nf4:  the 16-value NormalFloat code of the QLoRA paper (quantiles of a
//       standard normal, normalised to [-1, 1], with an exact zero), in
//       blocks of kNf4Block consecutive elements of the row-major weight,
//       each block scaled by its absmax. Each element becomes the index of
//       the nearest code value; two indices per byte, the first element in
//       the high nibble. Codes uint8 [numel / 2], scales fp32 [numel / 64].
//       Double quantization stores the scales again as int8: the mean is
//       subtracted and each group of kScaleBlock scales keeps its own absmax
//       (a linear int8 code, where bitsandbytes uses a dynamic 8-bit map).
//
// All functions are pure tensor functions: no modules, no autograd.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace shardtrain::models {

/// Elements per nf4 block (one fp32 absmax each).
constexpr int64_t kNf4Block = 64;
/// Scales per group of the double quantization (one fp32 absmax each).
constexpr int64_t kScaleBlock = 256;

/// The 16 NF4 code values, ascending, as fp32 [16].
at::Tensor nf4_code();

/// A quantized weight: what a frozen base stores instead of its fp32 weight.
struct QuantizedWeight {
  at::Tensor codes;         // int8 [out, in] or uint8 [numel / 2]
  at::Tensor scales;        // fp32: [out] (int8) or [numel / 64] (nf4, no double quant)
  at::Tensor scales_q;      // nf4 double quant: int8 [numel / 64]
  at::Tensor scales_scale;  // nf4 double quant: fp32 [ceil(numel / 64 / 256)]
  at::Tensor scales_mean;   // nf4 double quant: fp32 [1]
};

/// Row-wise absmax int8 of a 2-D floating weight.
QuantizedWeight quantize_int8(const at::Tensor& weight);
at::Tensor dequantize_int8(const at::Tensor& codes, const at::Tensor& scales);

/// nf4 of a weight whose element count is a multiple of kNf4Block.
QuantizedWeight quantize_nf4(const at::Tensor& weight, bool double_quant);
/// quantize_nf4 in parts, for a weight read a range at a time (a deferred
/// base, each rank encoding only its slice): the absmax of each of `blocks`
/// blocks at `x`; the codes of `blocks` blocks at `x` (blocks * 32 bytes)
/// given their absmax; and the scales of a whole weight's absmaxes (codes
/// left undefined). quantize_nf4 is exactly these three in turn.
void nf4_block_absmax(const float* x, int64_t blocks, float* absmax);
void nf4_encode(const float* x, const float* absmax, int64_t blocks, uint8_t* codes);
QuantizedWeight nf4_scales_of(const at::Tensor& absmax, bool double_quant);
/// The nf4 scales, undoing the double quantization when there is one.
at::Tensor nf4_scales(const QuantizedWeight& q);
/// The fp32 weight of `shape` that nf4 codes and their (plain) scales encode.
at::Tensor dequantize_nf4(const at::Tensor& codes, const at::Tensor& scales,
                          at::IntArrayRef shape);

}  // namespace shardtrain::models
