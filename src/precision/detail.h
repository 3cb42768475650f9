// Internals of the precision plugins, visible to tests.
#pragma once

#include <memory>

#include "shardtrain/precision/precision.h"

namespace shardtrain::precision::detail {

/// fp16-mixed without CUDA, for tests only: the very same plugin class as
/// Precision::create("fp16-mixed", ..., true) — same scale_loss,
/// unscale_and_check (local found-inf, then one MAX all-reduce), update and
/// scaler — except that autocast() returns a scope that does nothing, so the
/// loss-scaling path runs on CPU with real float16 gradients.
std::unique_ptr<Precision> make_fp16_mixed_for_tests(const LossScalerOptions& options = {});

/// What `auto` takes on a CPU (resolve_precision without a CUDA device),
/// given whether it has native bf16 and, when measured, its GEMM rates.
ResolvedPrecision auto_on_cpu(bool native_bf16, const GemmRates* rates);

}  // namespace shardtrain::precision::detail
