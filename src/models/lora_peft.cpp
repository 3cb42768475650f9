// PEFT-layout adapter files: save, load into an adapted model, merge into a base.
#include "shardtrain/models/lora_peft.h"

#include <torch/torch.h>

#include "shardtrain/models/family.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "checkpoint/detail.h"
#include "checkpoint/json_int.h"
#include "core/file.h"
#include "core/json.h"
#include "shardtrain/models/family.h"
#include "shardtrain/models/hf_dir.h"
#include "shardtrain/checkpoint/safetensors.h"
#include "shardtrain/core/error.h"
#include "shardtrain/models/quantize.h"

namespace shardtrain::models {

namespace fs = std::filesystem;
using shardtrain::detail::str_cat;

namespace {

constexpr const char* kQuantizeKey = "shardtrain.quantize";
constexpr const char* kDoubleQuantKey = "shardtrain.double_quant";

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}
bool starts_with(const std::string& s, const std::string& head) { return s.rfind(head, 0) == 0; }

bool is_adapter(const std::string& name) {
  return ends_with(name, ".lora_A.weight") || ends_with(name, ".lora_B.weight");
}

std::string peft_name_list(const std::vector<std::string>& names) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < 8; ++i) out += (i ? ", " : "") + names[i];
  if (names.size() > 8) out += str_cat(", ... (", names.size() - 8, " more)");
  return out;
}

// adapter_config.json is a few hundred bytes; anything past this is not one.
constexpr int64_t kMaxAdapterConfigBytes = int64_t{1} << 20;
// PEFT's r is a small int; 2^20 is far beyond any adapter and keeps r * n exact.
constexpr int64_t kMaxAdapterRank = int64_t{1} << 20;

// What merging and loading need from adapter_config.json, every field
// checked: a wrong r or lora_alpha would otherwise give a wrong (or NaN)
// scale without a word.
struct AdapterConfig {
  std::string path;
  int64_t r = 0;
  double alpha = 0.0;
  bool rslora = false;
  bool fan_in_fan_out = false;
  double scale = 0.0;  // lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora
};

bool optional_bool(const nlohmann::json& cfg, const char* key, const std::string& path) {
  if (!cfg.contains(key) || cfg.at(key).is_null()) return false;
  ST_CHECK(cfg.at(key).is_boolean(), CheckpointError, "'", path, "': ", key, " is ",
           ::shardtrain::detail::json_excerpt(cfg.at(key)), "; expected true or false");
  return cfg.at(key).get<bool>();
}

AdapterConfig read_config(const std::string& dir) {
  AdapterConfig c;
  c.path = (fs::path(dir) / kPeftConfigFile).string();
  const std::string& path = c.path;
  std::string text, why;
  // The guarded reader: a FIFO or /dev/zero named as the config is refused,
  // never waited on or read without end.
  ST_CHECK(::shardtrain::detail::read_regular_file(path, kMaxAdapterConfigBytes, &text, &why),
           CheckpointError, "cannot read '", path, "': ", why,
           "; hint: pass the adapter directory a LoRA run wrote (<run.dir>/adapter)");
  nlohmann::json cfg;
  ST_CHECK(::shardtrain::detail::parse_json(text, &cfg, &why), CheckpointError, "'", path,
           "' is not valid JSON (", why, ")");
  ST_CHECK(cfg.is_object() && cfg.contains("peft_type") && cfg.at("peft_type") == "LORA" &&
               cfg.contains("r") && cfg.contains("lora_alpha"),
           CheckpointError, "'", path,
           "' is not a LoRA adapter config (needs peft_type LORA, r and lora_alpha)");
  ST_CHECK(checkpoint::detail::json_int(cfg.at("r"), 1, kMaxAdapterRank, &c.r), CheckpointError,
           "'", path, "': r is ", ::shardtrain::detail::json_excerpt(cfg.at("r")),
           "; expected a whole number in 1..", kMaxAdapterRank,
           " (the adapter's rank: the first dimension of every lora_A). Hint: the file is damaged "
           "or not the one written with this adapter");
  ST_CHECK(cfg.at("lora_alpha").is_number(), CheckpointError, "'", path, "': lora_alpha is ",
           ::shardtrain::detail::json_excerpt(cfg.at("lora_alpha")), "; expected a number");
  c.alpha = cfg.at("lora_alpha").get<double>();
  c.rslora = optional_bool(cfg, "use_rslora", path);
  c.fan_in_fan_out = optional_bool(cfg, "fan_in_fan_out", path);
  const double r = static_cast<double>(c.r);
  c.scale = c.rslora ? c.alpha / std::sqrt(r) : c.alpha / r;
  ST_CHECK(std::isfinite(c.scale) && c.scale > 0.0, CheckpointError, "'", path, "': lora_alpha ",
           c.alpha, " and r ", c.r, " give the scale ", c.scale,
           c.rslora ? " (lora_alpha / sqrt(r))" : " (lora_alpha / r)",
           "; it must be a finite number above 0. Hint: the file is damaged");
  return c;
}

// Every adapter pair must have the rank the config says: A [r, in], B [out, r].
void check_rank(const AdapterConfig& c, const std::string& layer, const at::Tensor& a,
                const at::Tensor& b) {
  ST_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(0) == c.r && b.size(1) == c.r, CheckpointError,
           "the adapter for '", layer, "' has lora_A ", a.sizes(), " and lora_B ", b.sizes(),
           ", but '", c.path, "' says r=", c.r, " (lora_A [r, in], lora_B [out, r]). Hint: the "
           "config and the tensors come from different adapters");
}

}  // namespace

void save_peft_adapter(const std::string& dir,
                       const std::vector<std::pair<std::string, at::Tensor>>& state,
                       const LoraOptions& options, const ModelFamily& family,
                       const std::string& base_model) {
  const std::string prefix = family.peft_prefix();
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& [name, t] : state) {
    const bool bias = options.train_bias() == LoraBias::All && ends_with(name, "bias");
    if (is_adapter(name) || bias) tensors.emplace_back(prefix + name, t.detach().contiguous());
  }
  ST_CHECK(!tensors.empty(), CheckpointError, "no LoRA adapter tensors to write to '", dir,
           "'; hint: apply_lora the model first");
  try {
    fs::create_directories(dir);
  } catch (const std::exception& e) {
    ST_CHECK(false, CheckpointError, "cannot create '", dir, "': ", e.what());
  }
  checkpoint::save_safetensors((fs::path(dir) / kPeftAdapterFile).string(), tensors,
                               /*transpose_conv1d=*/false,
                               {{"format", "pt"},
                                {"producer", "shardtrain"},
                                {kQuantizeKey, enum_name(options.quantize())},
                                {kDoubleQuantKey, options.double_quant() ? "true" : "false"}});
  nlohmann::json j;
  j["peft_type"] = "LORA";
  j["task_type"] = family.language_model() ? nlohmann::json("CAUSAL_LM") : nlohmann::json(nullptr);
  j["r"] = options.r();
  j["lora_alpha"] = options.alpha();
  j["lora_dropout"] = options.dropout();
  j["target_modules"] = options.target_modules();
  // GPT-2's Conv1D stores its weights [in, out]: PEFT transposes B A for it.
  j["fan_in_fan_out"] = family.hf_conv1d();
  j["bias"] = enum_name(options.train_bias());
  j["base_model_name_or_path"] = base_model;
  j["inference_mode"] = true;
  j["init_lora_weights"] = true;
  checkpoint::detail::write_file_atomically((fs::path(dir) / kPeftConfigFile).string(), j.dump(2) + "\n");
}

void load_peft_adapter(torch::nn::Module& model, const std::string& dir, const std::string& prefix,
                       const LoraOptions* options, bool stage_part) {
  if (options != nullptr) {
    const AdapterConfig cfg = read_config(dir);
    const double scale = cfg.scale;
    ST_CHECK(cfg.r == options->r() && std::abs(scale - options->alpha() / options->r()) <= 1e-12 * scale,
             CheckpointError, "the adapter in '", dir, "' has r=", cfg.r, " and scale ", scale,
             cfg.rslora ? " (use_rslora: lora_alpha / sqrt(r))" : " (lora_alpha / r)",
             ", but lora.r=", options->r(), " and lora.alpha=", options->alpha(), " give scale ",
             options->alpha() / options->r(), "; hint: set lora.r and lora.alpha to the adapter's (",
             kPeftConfigFile, ")");
  }
  const checkpoint::SafetensorsFile file((fs::path(dir) / kPeftAdapterFile).string());
  auto params = model.named_parameters(/*recurse=*/true);
  std::vector<std::string> unexpected, mismatched, missing;
  std::vector<std::pair<at::Tensor, std::string>> copies;
  for (const auto& e : file.entries()) {
    const std::string name = starts_with(e.name, prefix) ? e.name.substr(prefix.size()) : e.name;
    const at::Tensor* p = params.find(name);
    if (p == nullptr && stage_part && starts_with(e.name, prefix) && is_adapter(name) &&
        params.find(name.substr(0, name.rfind(".lora_")) + ".weight") == nullptr) {
      continue;  // the adapter of a layer another pipeline stage holds
    }
    if (p == nullptr || !starts_with(e.name, prefix)) {
      unexpected.push_back(e.name);
    } else if (p->sizes().vec() != e.shape) {
      mismatched.push_back(str_cat(name, " (file ", c10::IntArrayRef(e.shape), ", model ", p->sizes(), ")"));
    } else {
      copies.emplace_back(*p, e.name);
    }
  }
  for (const auto& p : params) {
    if (is_adapter(p.key()) && file.find(prefix + p.key()) == nullptr) missing.push_back(p.key());
  }
  ST_CHECK(unexpected.empty() && mismatched.empty() && missing.empty(), CheckpointError,
           "the adapter in '", dir, "' does not fit this model",
           unexpected.empty() ? "" : "; not in the model: " + peft_name_list(unexpected),
           mismatched.empty() ? "" : "; shapes differ: " + peft_name_list(mismatched),
           missing.empty() ? "" : "; missing from the file: " + peft_name_list(missing),
           ". Hint: lora.r, lora.target_modules and the model's sizes must be those the adapter "
           "was trained with (see its adapter_config.json)");
  torch::NoGradGuard no_grad;
  for (auto& [p, name] : copies) p.copy_(file.read(name).to(p.scalar_type()));
}

std::vector<std::pair<std::string, at::Tensor>> dequantize_lora_bases(
    const std::vector<std::pair<std::string, at::Tensor>>& state) {
  std::map<std::string, at::Tensor> by_name(state.begin(), state.end());
  const auto get = [&](const std::string& name) {
    const auto it = by_name.find(name);
    return it == by_name.end() ? at::Tensor() : it->second;
  };
  std::vector<std::pair<std::string, at::Tensor>> out;
  at::NoGradGuard no_grad;
  for (const auto& [name, t] : state) {
    if (ends_with(name, ".qscale") || ends_with(name, ".qscale_q") || ends_with(name, ".qscale_scale") ||
        ends_with(name, ".qscale_mean")) {
      continue;  // with the codes below
    }
    if (!ends_with(name, ".qweight")) {
      out.emplace_back(name, t);
      continue;
    }
    const std::string layer = name.substr(0, name.size() - std::strlen(".qweight"));
    const at::Tensor a = get(layer + ".lora_A.weight"), b = get(layer + ".lora_B.weight");
    ST_CHECK(a.defined() && b.defined(), CheckpointError, "quantized layer '", layer, "' has no adapter");
    if (t.scalar_type() == at::kChar) {
      out.emplace_back(layer + ".weight", dequantize_int8(t, get(layer + ".qscale")).to(a.scalar_type()));
    } else {
      QuantizedWeight q;
      q.scales = get(layer + ".qscale");
      q.scales_q = get(layer + ".qscale_q");
      q.scales_scale = get(layer + ".qscale_scale");
      q.scales_mean = get(layer + ".qscale_mean");
      out.emplace_back(layer + ".weight",
                       dequantize_nf4(t, nf4_scales(q), {b.size(0), a.size(1)}).to(a.scalar_type()));
    }
  }
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> merge_lora_state(
    const std::vector<std::pair<std::string, at::Tensor>>& quantized, const LoraOptions& options) {
  const std::vector<std::pair<std::string, at::Tensor>> state = dequantize_lora_bases(quantized);
  std::map<std::string, at::Tensor> by_name(state.begin(), state.end());
  const double scale = options.alpha() / static_cast<double>(options.r());
  std::vector<std::pair<std::string, at::Tensor>> out;
  at::NoGradGuard no_grad;
  for (const auto& [name, t] : state) {
    const std::string tail = ".lora_A.weight";
    if (ends_with(name, ".lora_B.weight") ||
        (ends_with(name, ".weight") && by_name.count(name.substr(0, name.size() - 7) + tail))) {
      continue;  // folded into the weight below
    }
    if (!ends_with(name, tail)) {
      out.emplace_back(name, t);
      continue;
    }
    const std::string layer = name.substr(0, name.size() - tail.size());
    const at::Tensor a = t.to(at::kFloat), b = by_name.at(layer + ".lora_B.weight").to(at::kFloat);
    const auto w = by_name.find(layer + ".weight");
    ST_CHECK(w != by_name.end(), CheckpointError, "adapted layer '", layer, "' has no base weight");
    out.emplace_back(layer + ".weight",
                     (w->second.to(at::kFloat) + at::matmul(b, a) * scale).to(w->second.scalar_type()));
  }
  return out;
}

namespace {

// How the adapter's base was quantized in training, from the adapter file's
// metadata: the merge quantizes and dequantizes the base weight the same way.
struct AdapterQuantization {
  LoraQuantize quantize = LoraQuantize::None;
  bool double_quant = false;
};

AdapterQuantization adapter_quantization(const checkpoint::SafetensorsFile& adapter) {
  const auto& meta = adapter.metadata();
  const auto qit = meta.find(kQuantizeKey);
  const LoraQuantize quantize =
      qit == meta.end() ? LoraQuantize::None : enum_from_name<LoraQuantize>(qit->second, kQuantizeKey);
  const auto dq = meta.find(kDoubleQuantKey);
  const bool double_quant = dq != meta.end() && dq->second == "true";
  return {quantize, double_quant};
}

// Base name of each adapted weight and replaced bias, found with or
// without GPT2LMHeadModel's "transformer." in either file.
std::string base_name_of(const HfWeights& base, const std::string& adapter_name) {
  std::string rest = adapter_name;
  if (starts_with(rest, kPeftModelPrefix)) rest = rest.substr(std::string(kPeftModelPrefix).size());
  std::vector<std::string> candidates = {rest};
  if (starts_with(rest, "transformer.")) candidates.push_back(rest.substr(12));
  else candidates.push_back("transformer." + rest);
  for (const auto& c : candidates) {
    if (base.find(c) != nullptr) return c;
  }
  return "";
}

// The adapter's tensors by the base tensor each one changes; every one of
// them must have a base tensor.
struct AdapterMatch {
  std::map<std::string, std::pair<std::string, std::string>> layers;  // base weight -> (A, B)
  std::map<std::string, std::string> biases;                          // base bias -> adapter name
};

AdapterMatch match_adapter(const checkpoint::SafetensorsFile& adapter, const HfWeights& base,
                           const std::string& adapter_dir, const std::string& base_path) {
  AdapterMatch m;
  std::vector<std::string> unmatched;
  for (const auto& e : adapter.entries()) {
    const bool a = ends_with(e.name, ".lora_A.weight"), b = ends_with(e.name, ".lora_B.weight");
    if (a || b) {
      const std::string layer = e.name.substr(0, e.name.size() - std::string(".lora_A.weight").size());
      const std::string w = base_name_of(base, layer + ".weight");
      if (w.empty()) {
        unmatched.push_back(layer);
        continue;
      }
      (a ? m.layers[w].first : m.layers[w].second) = e.name;
    } else {
      const std::string bname = base_name_of(base, e.name);
      if (bname.empty()) unmatched.push_back(e.name);
      else m.biases[bname] = e.name;
    }
  }
  ST_CHECK(unmatched.empty(), CheckpointError, "the adapter in '", adapter_dir,
           "' does not match the base '", base_path, "': no base tensor for ", peft_name_list(unmatched),
           ". Hint: merge into the base the adapter was trained from (its model.init_from)");
  return m;
}

// Base weight `t` of layer `name` with its adapter pair (A, B) folded in:
// W += scale B A, on the weight quantized and dequantized as in training.
at::Tensor merged_weight(const AdapterConfig& cfg, const checkpoint::SafetensorsFile& adapter,
                         const AdapterQuantization& q, const std::string& adapter_dir,
                         const std::string& base_path, const std::string& name,
                         const std::pair<std::string, std::string>& pair, const at::Tensor& t) {
  const double scale = cfg.scale;
  const bool fan_in_fan_out = cfg.fan_in_fan_out;
  ST_CHECK(!pair.first.empty() && !pair.second.empty(), CheckpointError,
           "the adapter in '", adapter_dir, "' has only one of lora_A / lora_B for '", name, "'");
  const at::Tensor a = adapter.read(pair.first).to(at::kFloat);
  const at::Tensor b = adapter.read(pair.second).to(at::kFloat);
  check_rank(cfg, name, a, b);
  at::Tensor w = (fan_in_fan_out ? t.t() : t).to(at::kFloat).contiguous();  // [out, in]
  ST_CHECK(t.dim() == 2 && a.dim() == 2 && b.dim() == 2 && a.size(1) == w.size(1) &&
               b.size(0) == w.size(0) && a.size(0) == b.size(1),
           CheckpointError, "the adapter for '", name, "' (A ", a.sizes(), ", B ", b.sizes(),
           ") does not fit the base weight ", t.sizes(), " in '", base_path,
           "'. Hint: merge into the base the adapter was trained from");
  if (q.quantize == LoraQuantize::Int8) {
    const QuantizedWeight qw = quantize_int8(w);
    w = dequantize_int8(qw.codes, qw.scales);
  } else if (q.quantize == LoraQuantize::Nf4) {
    const QuantizedWeight qw = quantize_nf4(w, q.double_quant);
    w = dequantize_nf4(qw.codes, nf4_scales(qw), w.sizes());
  }
  w = w + at::matmul(b, a) * scale;
  return (fan_in_fan_out ? w.t() : w).to(t.scalar_type()).contiguous();
}

// Writes the merged tensors to `out` in the base's layout.
void write_merged(const std::string& base_path, const std::string& out,
                  const std::vector<std::pair<std::string, at::Tensor>>& merged) {
  const std::map<std::string, std::string> metadata = {{"format", "pt"}, {"producer", "shardtrain lora merge"}};
  if (is_hf_dir(base_path)) {  // a directory in, a directory out, with the base's config.json
    std::string config_json, why;
    ST_CHECK(::shardtrain::detail::read_regular_file((fs::path(base_path) / "config.json").string(),
                                                     int64_t{16} << 20, &config_json, &why),
             CheckpointError, "cannot read '", base_path, "/config.json': ", why);
    save_hf_dir(out, config_json, merged, nullptr, kDefaultMaxShardBytes, metadata);
  } else {
    checkpoint::save_safetensors(out, merged, /*transpose_conv1d=*/false, metadata);
  }
}

}  // namespace

int64_t merge_peft_adapter(const std::string& base_path, const std::string& adapter_dir,
                           const std::string& out) {
  const AdapterConfig cfg = read_config(adapter_dir);
  const checkpoint::SafetensorsFile adapter((fs::path(adapter_dir) / kPeftAdapterFile).string());
  const HfWeights base(base_path);
  const AdapterQuantization quantization = adapter_quantization(adapter);
  const AdapterMatch match = match_adapter(adapter, base, adapter_dir, base_path);

  std::vector<std::pair<std::string, at::Tensor>> merged;
  at::NoGradGuard no_grad;
  for (const auto& name : base.names()) {
    const checkpoint::SafetensorsEntry e{name, "", {}, 0, 0};
    at::Tensor t = base.read(e.name);
    if (const auto it = match.layers.find(e.name); it != match.layers.end()) {
      t = merged_weight(cfg, adapter, quantization, adapter_dir, base_path, e.name, it->second, t);
    } else if (const auto bit = match.biases.find(e.name); bit != match.biases.end()) {
      t = adapter.read(bit->second).to(t.scalar_type()).reshape(t.sizes()).contiguous();
    }
    merged.emplace_back(e.name, t);
  }
  write_merged(base_path, out, merged);
  return static_cast<int64_t>(match.layers.size());
}

}  // namespace shardtrain::models
