// LoRA adapters attached to Linear layers in place, and their forward.
#include "shardtrain/models/lora.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <cmath>
#include <cstring>

#include "shardtrain/core/deferred.h"
#include "shardtrain/core/error.h"
#include "shardtrain/models/quantize.h"

namespace shardtrain::models {

namespace {

using shardtrain::detail::str_cat;

// Module keeps its parameter table protected and has no way to remove one;
// a quantized base must drop its fp32 weight, so reach the table through a
// pointer to member named from a derived class.
struct ParameterTable : torch::nn::Module {
  static torch::OrderedDict<std::string, at::Tensor>& of(torch::nn::Module& m) {
    return m.*(&ParameterTable::parameters_);
  }
};

constexpr const char* kStateName = "lora_state";

QuantizedWeight quantize(const at::Tensor& weight, const LoraOptions& options) {
  return options.quantize() == LoraQuantize::Int8 ? quantize_int8(weight)
                                                  : quantize_nf4(weight, options.double_quant());
}

// What the deferred readers of quantized bases read from. int8 quantizes a
// weight whole, on first read. nf4 makes one streamed pass over a weight for
// each block's absmax and the scales they give (the double quantization's
// mean needs every block), then encodes codes only for the blocks a reader
// asks for: a sharded strategy reads its slice, and each rank encodes its
// slice alone. A sharded strategy reads a layer's codes, then its scales (one
// flat per dtype), so each weight's entry is kept until the layer's seven
// projections have passed; an nf4 entry is a 64th of the fp32 weight.
class QuantizedCache {
 public:
  const QuantizedWeight& get(const at::Tensor& weight, const LoraOptions& options) {
    return entry(weight, options).q;
  }

  // nf4 codes [first, first + dst.numel()) (bytes, two elements each) of
  // deferred `weight` into dst, encoding only the blocks they lie in.
  void nf4_codes(const at::Tensor& weight, const LoraOptions& options, int64_t first, const at::Tensor& dst) {
    const float* absmax = entry(weight, options).absmax.data_ptr<float>();
    constexpr int64_t kBytesPerBlock = kNf4Block / 2;
    uint8_t* out = dst.data_ptr<uint8_t>();
    const int64_t end = first + dst.numel();
    for (int64_t pos = first; pos < end;) {
      const int64_t block = pos / kBytesPerBlock;
      const int64_t n = std::min(kChunkBlocks, (end + kBytesPerBlock - 1) / kBytesPerBlock - block);
      if (codes_.numel() < n * kBytesPerBlock) codes_ = at::empty({n * kBytesPerBlock}, at::kByte);
      uint8_t* codes = codes_.data_ptr<uint8_t>();
      const float* x = read_blocks(weight, block, n);
      at::parallel_for(0, n, 1024, [&](int64_t b, int64_t e) {
        nf4_encode(x + b * kNf4Block, absmax + block + b, e - b, codes + b * kBytesPerBlock);
      });
      const int64_t take = std::min(end, (block + n) * kBytesPerBlock) - pos;
      std::memcpy(out + (pos - first), codes + (pos - block * kBytesPerBlock), static_cast<size_t>(take));
      pos += take;
    }
  }

 private:
  static constexpr size_t kKept = 8;
  static constexpr int64_t kChunkBlocks = 16384;  // 1M elements, 4 MB of fp32 at a time
  static constexpr const char* kWhat = "a quantized LoRA base weight";

  struct Entry {
    QuantizedWeight q;  // nf4: the scales alone; codes come from nf4_codes
    at::Tensor absmax;  // nf4: each block's
  };

  Entry& entry(const at::Tensor& weight, const LoraOptions& options) {
    const void* key = weight.unsafeGetTensorImpl();
    for (auto& [k, e] : entries_) {
      if (k == key) return e;
    }
    Entry e;
    if (options.quantize() == LoraQuantize::Int8) {
      const at::Tensor values = at::empty(weight.sizes(), weight.options().requires_grad(false));
      read_deferred(weight, 0, values.view({-1}), kWhat);
      e.q = quantize(values, options);
    } else {
      const int64_t blocks = weight.numel() / kNf4Block;
      e.absmax = at::empty({blocks}, at::TensorOptions().dtype(at::kFloat));
      for (int64_t b = 0; b < blocks; b += kChunkBlocks) {
        const int64_t n = std::min(kChunkBlocks, blocks - b);
        const float* x = read_blocks(weight, b, n);
        float* amax = e.absmax.data_ptr<float>() + b;
        at::parallel_for(0, n, 1024, [&](int64_t lo, int64_t hi) {
          nf4_block_absmax(x + lo * kNf4Block, hi - lo, amax + lo);
        });
      }
      e.q = nf4_scales_of(e.absmax, options.double_quant());
    }
    if (entries_.size() >= kKept) entries_.erase(entries_.begin());
    entries_.emplace_back(key, std::move(e));
    return entries_.back().second;
  }

  // Blocks [block, block + n) of `weight` as fp32, in memory reused from call to call.
  const float* read_blocks(const at::Tensor& weight, int64_t block, int64_t n) {
    const int64_t numel = n * kNf4Block;
    if (raw_.numel() < numel || raw_.scalar_type() != weight.scalar_type()) {
      raw_ = at::empty({numel}, weight.options().requires_grad(false));
    }
    const at::Tensor view = raw_.narrow(0, 0, numel);
    read_deferred(weight, block * kNf4Block, view, kWhat);
    if (weight.scalar_type() == at::kFloat) return view.data_ptr<float>();
    if (floats_.numel() < numel) floats_ = at::empty({numel}, at::kFloat);
    floats_.narrow(0, 0, numel).copy_(view);
    return floats_.data_ptr<float>();
  }

  std::vector<std::pair<const void*, Entry>> entries_;
  at::Tensor raw_, floats_, codes_;
};

// Deferred tensors shaped as the quantization of deferred `weight` will be,
// each reading its part of that quantization: the weight is read and
// quantized when first asked for, tensor by tensor, never the whole base.
QuantizedWeight deferred_quantization(const at::Tensor& weight, const LoraOptions& options,
                                      const std::shared_ptr<QuantizedCache>& cache) {
  const int64_t out = weight.size(0), in = weight.size(1), numel = weight.numel();
  using Part = at::Tensor QuantizedWeight::*;
  const auto make = [&](std::vector<int64_t> shape, at::ScalarType dtype, Part part) {
    auto reader = [cache, weight, options, part](int64_t first, const at::Tensor& dst) {
      if (part == &QuantizedWeight::codes && options.quantize() == LoraQuantize::Nf4) {
        cache->nf4_codes(weight, options, first, dst);
        return;
      }
      const QuantizedWeight& q = cache->get(weight, options);
      dst.copy_((q.*part).reshape({-1}).narrow(0, first, dst.numel()));
    };
    return deferred_tensor(shape, dtype, std::move(reader));
  };
  QuantizedWeight q;
  if (options.quantize() == LoraQuantize::Int8) {
    q.codes = make({out, in}, at::kChar, &QuantizedWeight::codes);
    q.scales = make({out}, at::kFloat, &QuantizedWeight::scales);
  } else if (!options.double_quant()) {
    q.codes = make({numel / 2}, at::kByte, &QuantizedWeight::codes);
    q.scales = make({numel / kNf4Block}, at::kFloat, &QuantizedWeight::scales);
  } else {
    const int64_t blocks = numel / kNf4Block;
    q.codes = make({numel / 2}, at::kByte, &QuantizedWeight::codes);
    q.scales_q = make({blocks}, at::kChar, &QuantizedWeight::scales_q);
    const int64_t groups = (blocks + kScaleBlock - 1) / kScaleBlock;
    q.scales_scale = make({groups}, at::kFloat, &QuantizedWeight::scales_scale);
    q.scales_mean = make({1}, at::kFloat, &QuantizedWeight::scales_mean);
  }
  return q;
}

// What the forward of an adapted layer needs besides its parameters. A child
// module without parameters, so it lives and dies with the layer and never
// shows in a state dict.
class LoraStateImpl : public torch::nn::Module {
 public:
  LoraStateImpl() : torch::nn::Module("shardtrain::models::LoraState") {}
  double scale = 1.0;
  double dropout = 0.0;
  LoraQuantize quantize = LoraQuantize::None;
  int64_t in = 0, out = 0;
  std::shared_ptr<torch::nn::LinearImpl> a, b;
  // Quantized base (the tensors registered on the layer).
  at::Tensor qweight, qscale, qscale_q, qscale_scale, qscale_mean;

  at::Tensor scales() const {
    QuantizedWeight q;
    q.scales = qscale;
    q.scales_q = qscale_q;
    q.scales_scale = qscale_scale;
    q.scales_mean = qscale_mean;
    return quantize == LoraQuantize::Nf4 ? nf4_scales(q) : qscale;
  }

  at::Tensor dequantized() const { return dequantize(quantize, qweight, scales(), out, in); }

  static at::Tensor dequantize(LoraQuantize kind, const at::Tensor& codes, const at::Tensor& scales,
                               int64_t out, int64_t in) {
    at::NoGradGuard no_grad;
    if (kind == LoraQuantize::Int8) return dequantize_int8(codes, scales);
    return dequantize_nf4(codes, scales, {out, in});
  }
};

LoraStateImpl* state_of(const torch::nn::Module& layer) {
  for (const auto& child : layer.named_children()) {
    if (child.key() == kStateName) return dynamic_cast<LoraStateImpl*>(child.value().get());
  }
  return nullptr;
}

// y = x W^T with W dequantized from frozen codes in forward and again in
// backward: only the codes and (plain) scales are saved, never an fp32 W.
struct DequantLinear : public torch::autograd::Function<DequantLinear> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& codes, const at::Tensor& scales, int64_t kind,
                            int64_t out, int64_t in) {
    ctx->save_for_backward({codes, scales});
    ctx->saved_data["kind"] = kind;
    ctx->saved_data["out"] = out;
    ctx->saved_data["in"] = in;
    const auto q = static_cast<LoraQuantize>(kind);
    const at::Tensor w = LoraStateImpl::dequantize(q, codes, scales, out, in).to(x.scalar_type());
    return at::matmul(x, w.t());
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto q = static_cast<LoraQuantize>(ctx->saved_data["kind"].toInt());
    const at::Tensor w = LoraStateImpl::dequantize(q, saved[0], saved[1], ctx->saved_data["out"].toInt(),
                                                   ctx->saved_data["in"].toInt())
                             .to(grads[0].scalar_type());
    return {at::matmul(grads[0], w), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};

bool matches(const std::string& path, const std::vector<std::string>& targets) {
  for (const auto& t : targets) {
    if (path == t) return true;
    if (path.size() > t.size() && path.compare(path.size() - t.size(), t.size(), t) == 0 &&
        path[path.size() - t.size() - 1] == '.')
      return true;
  }
  return false;
}

std::string list(const std::vector<std::string>& names, size_t max = 12) {
  std::string out = "[";
  for (size_t i = 0; i < names.size() && i < max; ++i) out += (i ? ", " : "") + names[i];
  if (names.size() > max) out += str_cat(", ... (", names.size() - max, " more)");
  return out + "]";
}

void check_options(const LoraOptions& o) {
  ST_CHECK(o.r() >= 1, ConfigError, "lora.r=", o.r(),
           " must be >= 1 to adapt a model; hint: set lora.r to the adapter rank, e.g. 8 (0 turns "
           "LoRA off in the config)");
  ST_CHECK(o.alpha() > 0, ConfigError, "lora.alpha=", o.alpha(),
           " must be > 0; hint: the adapter is scaled by alpha / r, e.g. alpha 16 with r 8");
  ST_CHECK(o.dropout() >= 0 && o.dropout() < 1, ConfigError, "lora.dropout=", o.dropout(),
           " must be in [0, 1)");
  ST_CHECK(!o.target_modules().empty(), ConfigError,
           "lora.target_modules is empty; hint: name the Linear layers to adapt, e.g. [c_attn, "
           "c_proj, c_fc]");
}

}  // namespace

bool has_lora(const torch::nn::Module& layer) { return state_of(layer) != nullptr; }

LoraSummary apply_lora(torch::nn::Module& model, const LoraOptions& options) {
  check_options(options);
  // Find and check every target before changing anything.
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::LinearImpl>>> targets;
  std::vector<std::string> linear_paths;
  for (const auto& item : model.named_modules(/*name_prefix=*/"", /*include_self=*/false)) {
    auto linear = std::dynamic_pointer_cast<torch::nn::LinearImpl>(item.value());
    if (!linear) continue;
    linear_paths.push_back(item.key());
    if (!matches(item.key(), options.target_modules())) continue;
    ST_CHECK(!has_lora(*linear), ConfigError, "layer '", item.key(),
             "' already has a LoRA adapter; hint: call apply_lora once per model");
    const int64_t in = linear->options.in_features(), out = linear->options.out_features();
    ST_CHECK(options.r() <= std::min(in, out), ConfigError, "lora.r=", options.r(),
             " exceeds the width of layer '", item.key(), "' (", out, " x ", in,
             "); hint: set lora.r to at most ", std::min(in, out),
             " or leave this layer out of lora.target_modules");
    ST_CHECK(options.quantize() != LoraQuantize::Nf4 || in % kNf4Block == 0, ConfigError,
             "lora.quantize=nf4 needs every adapted layer's input width to be a multiple of the "
             "block size ", kNf4Block, ", but layer '", item.key(), "' has ", in,
             "; hint: use lora.quantize=int8, or leave this layer out of lora.target_modules");
    ST_CHECK(linear->weight.defined() && linear->weight.is_floating_point(), ConfigError,
             "layer '", item.key(), "' has no floating point weight to adapt");
    targets.emplace_back(item.key(), linear);
  }
  ST_CHECK(!targets.empty(), ConfigError, "lora.target_modules ", list(options.target_modules()),
           " matched no Linear layer; the model's Linear layers are ", list(linear_paths),
           "; hint: name layers by their last path component (c_attn) or their full path");

  torch::NoGradGuard no_grad;
  // Freeze the whole base; biases train only with train_bias=all.
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    const std::string& name = item.key();
    const bool bias = name.size() >= 4 && name.compare(name.size() - 4, 4, "bias") == 0;
    item.value().set_requires_grad(options.train_bias() == LoraBias::All && bias &&
                                   item.value().is_floating_point());
  }

  auto gen = at::detail::createCPUGenerator(options.seed());
  LoraSummary summary;
  for (auto& [path, layer] : targets) {
    const int64_t in = layer->options.in_features(), out = layer->options.out_features();
    const auto wopts = layer->weight.options();
    auto state = std::make_shared<LoraStateImpl>();
    state->scale = options.alpha() / static_cast<double>(options.r());
    state->dropout = options.dropout();
    // PEFT's init: kaiming_uniform_(a=sqrt(5)) gives the bound 1/sqrt(fan_in).
    state->a = torch::nn::Linear(torch::nn::LinearOptions(in, options.r()).bias(false)).ptr();
    state->b = torch::nn::Linear(torch::nn::LinearOptions(options.r(), out).bias(false)).ptr();
    const double bound = 1.0 / std::sqrt(static_cast<double>(in));
    state->a->weight.set_data(at::empty({options.r(), in}, wopts).uniform_(-bound, bound, gen));
    state->b->weight.set_data(at::zeros({out, options.r()}, wopts));
    state->a->weight.set_requires_grad(true);
    state->b->weight.set_requires_grad(true);
    layer->register_module("lora_A", state->a);
    layer->register_module("lora_B", state->b);
    layer->register_module(kStateName, state);
    summary.adapted.push_back(path);
  }
  quantize_lora_bases(model, options);
  for (const auto& p : model.parameters(/*recurse=*/true)) {
    (p.requires_grad() ? summary.trainable : summary.frozen) += p.numel();
  }
  return summary;
}

void quantize_lora_bases(torch::nn::Module& model, const LoraOptions& options) {
  if (options.quantize() == LoraQuantize::None) return;
  torch::NoGradGuard no_grad;
  const auto cache = std::make_shared<QuantizedCache>();
  for (const auto& item : model.named_modules(/*name_prefix=*/"", /*include_self=*/false)) {
    auto* layer = dynamic_cast<torch::nn::LinearImpl*>(item.value().get());
    LoraStateImpl* state = layer == nullptr ? nullptr : state_of(*layer);
    if (state == nullptr || state->quantize != LoraQuantize::None) continue;
    // The widths of the weight as it is now: a tensor-parallel rank's block.
    const int64_t out = layer->weight.size(0), in = layer->weight.size(1);
    ST_CHECK(options.quantize() != LoraQuantize::Nf4 || in % kNf4Block == 0, ConfigError,
             "lora.quantize=nf4 needs every adapted layer's input width to be a multiple of the "
             "block size ", kNf4Block, ", but layer '", item.key(), "' has ", in,
             in == layer->options.in_features() ? "" : " on each rank (its input split by distributed.tensor_parallel)",
             "; hint: use lora.quantize=int8, or leave this layer out of lora.target_modules");
    // A deferred base is quantized as it is read, tensor by tensor.
    const QuantizedWeight q = is_deferred(layer->weight)
                                  ? deferred_quantization(layer->weight.detach(), options, cache)
                                  : quantize(layer->weight, options);
    ParameterTable::of(*layer).erase("weight");
    layer->weight = at::Tensor();
    state->quantize = options.quantize();
    state->in = in;
    state->out = out;
    state->qweight = layer->register_parameter("qweight", q.codes, false);
    if (q.scales_q.defined()) {
      state->qscale_q = layer->register_parameter("qscale_q", q.scales_q, false);
      state->qscale_scale = layer->register_parameter("qscale_scale", q.scales_scale, false);
      state->qscale_mean = layer->register_parameter("qscale_mean", q.scales_mean, false);
    } else {
      state->qscale = layer->register_parameter("qscale", q.scales, false);
    }
  }
}

at::Tensor lora_forward(torch::nn::LinearImpl& layer, const at::Tensor& x, bool with_bias) {
  // at::linear, not LibTorch's Linear::forward: for [B, T, in] inputs the
  // latter runs a GEMM and then adds the bias in a pass of its own, where
  // at::linear folds the bias into the GEMM (addmm), as PyTorch does.
  const at::Tensor bias = with_bias ? layer.bias : at::Tensor();
  const LoraStateImpl* s = state_of(layer);
  if (s == nullptr) return at::linear(x, layer.weight, bias);
  at::Tensor y;
  if (s->quantize == LoraQuantize::None) {
    y = at::linear(x, layer.weight, bias);
  } else {
    y = DequantLinear::apply(x, s->qweight, s->scales(), static_cast<int64_t>(s->quantize), s->out,
                             s->in);
    if (bias.defined()) y = y + bias;
  }
  const at::Tensor h =
      s->dropout > 0 && layer.is_training() ? torch::dropout(x, s->dropout, /*train=*/true) : x;
  const at::Tensor delta = torch::nn::functional::linear(
      torch::nn::functional::linear(h, s->a->weight), s->b->weight);
  return y + delta * s->scale;
}

at::Tensor lora_base_weight(torch::nn::LinearImpl& layer) {
  const LoraStateImpl* s = state_of(layer);
  if (s == nullptr || s->quantize == LoraQuantize::None) return layer.weight.detach().clone();
  return s->dequantized();
}

}  // namespace shardtrain::models
