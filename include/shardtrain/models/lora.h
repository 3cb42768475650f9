// LoRA: low-rank adapters on the Linear layers of any torch::nn::Module.
//
// apply_lora(model, options) freezes every parameter of `model` and gives each
// targeted torch::nn::Linear two trainable matrices, A [r, in] and B [out, r]:
//
//   y = W x + b + (alpha / r) * B(A(dropout(x)))
//
// A starts Kaiming-uniform (bound 1/sqrt(in), as PEFT), B starts at zero, so
// the adapted model computes exactly what the base computed until the first
// optimizer step. The adapters are registered on the Linear itself, so their
// names are the layer's plus `lora_A.weight` / `lora_B.weight`
// (h.0.attn.c_attn.lora_A.weight) and every strategy, checkpoint and
// optimizer sees them as ordinary parameters; the base weight keeps its name.
//
// With `quantize` int8 or nf4 the base weight is replaced by its quantized
// codes and scales (models/quantize.h), registered as frozen parameters of
// their own dtypes (qweight, qscale, ...), and dequantized on the fly in
// forward and again in backward, so no full-precision copy outlives a call.
//
// LibTorch's Linear::forward is not virtual, so a model routes its Linear
// calls through lora_forward(layer, x) (the built-in GPT does): without an
// adapter that is the layer's own forward. A user module does the same:
//
//   struct Net : torch::nn::Module {
//     torch::nn::Linear fc{nullptr};
//     Net() { fc = register_module("fc", torch::nn::Linear(64, 64)); }
//     torch::Tensor forward(torch::Tensor x) { return shardtrain::models::lora_forward(*fc, x); }
//   };
//   auto net = std::make_shared<Net>();
//   shardtrain::models::apply_lora(*net, LoraOptions().r(8).alpha(16).target_modules({"fc"}));
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "shardtrain/core/enum_names.h"
#include "shardtrain/core/options.h"

namespace at {
class Tensor;
}
namespace torch::nn {
class Module;
class LinearImpl;
}  // namespace torch::nn

namespace shardtrain::models {

/// How the frozen base weight of an adapted Linear is stored.
enum class LoraQuantize { None, Int8, Nf4 };
ST_ENUM_NAMES(LoraQuantize, {LoraQuantize::None, "none"}, {LoraQuantize::Int8, "int8"},
              {LoraQuantize::Nf4, "nf4"});

/// Which biases train: none, or every parameter whose name ends in "bias".
enum class LoraBias { None, All };
ST_ENUM_NAMES(LoraBias, {LoraBias::None, "none"}, {LoraBias::All, "all"});

struct LoraOptions {
  /// Rank of the adapters, >= 1 and at most min(in, out) of every targeted layer.
  ST_ARG(int64_t, r) = 8;
  /// The adapter's output is scaled by alpha / r.
  ST_ARG(double, alpha) = 16.0;
  /// Dropout probability on the adapter's input, in [0, 1).
  ST_ARG(double, dropout) = 0.0;
  /// A Linear is adapted when its module path equals a name or ends with
  /// "." + name (PEFT's rule): "c_attn" matches h.0.attn.c_attn.
  ST_ARG(std::vector<std::string>, target_modules) = {"c_attn", "c_proj", "c_fc"};
  ST_ARG(LoraQuantize, quantize) = LoraQuantize::None;
  /// nf4: quantize the per-block scales again (int8 per 256 scales).
  ST_ARG(bool, double_quant) = false;
  ST_ARG(LoraBias, train_bias) = LoraBias::None;
  /// Seed of A's initialisation (its own generator: the global one is untouched).
  ST_ARG(uint64_t, seed) = 0;
};

/// What apply_lora did.
struct LoraSummary {
  std::vector<std::string> adapted;  // module paths, in model order
  int64_t trainable = 0;             // elements that now require grad
  int64_t frozen = 0;                // elements that do not
};

/// Freezes `model` and adapts the Linear layers `options.target_modules`
/// names. Call it on every rank before the strategy's setup (and after
/// loading base weights). Throws ConfigError (naming the key lora.*) when a
/// target matches no Linear, r exceeds a layer's width, nf4 meets an input
/// width not divisible by 64, or the model is already adapted.
LoraSummary apply_lora(torch::nn::Module& model, const LoraOptions& options);

/// Quantizes, as `options.quantize()` says, the base weight of every
/// adapted layer that still holds one (apply_lora does this itself). A
/// tensor-parallel run adapts with quantize none, splits the layers, then
/// calls this: each rank quantizes its own block (nf4 then needs that
/// block's input width to be a multiple of 64: ConfigError otherwise).
void quantize_lora_bases(torch::nn::Module& model, const LoraOptions& options);

/// layer(x), plus its adapter when apply_lora attached one; x [..., in].
/// `with_bias` false leaves the bias out (a row-parallel layer adds it once,
/// after its partial products are summed).
at::Tensor lora_forward(torch::nn::LinearImpl& layer, const at::Tensor& x, bool with_bias = true);

/// Whether `layer` carries an adapter.
bool has_lora(const torch::nn::Module& layer);

/// The layer's base weight [out, in] in full precision: the weight itself, or
/// its quantized codes dequantized (a new tensor, without grad).
at::Tensor lora_base_weight(torch::nn::LinearImpl& layer);

}  // namespace shardtrain::models
