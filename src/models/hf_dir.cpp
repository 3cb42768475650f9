// Hugging Face model directories: reading (one file, or shards through the
// index) and writing (config.json, one file or shards with the index).
#include "shardtrain/models/hf_dir.h"

#include <torch/torch.h>

#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <unordered_set>

#include "core/json.h"
#include "checkpoint/detail.h"
#include "core/file.h"
#include "shardtrain/checkpoint/safetensors.h"
#include "shardtrain/core/deferred.h"
#include "shardtrain/core/error.h"
#include "shardtrain/models/family.h"

namespace shardtrain::models {

namespace fs = std::filesystem;
using checkpoint::SafetensorsEntry;
using checkpoint::SafetensorsFile;

namespace {

constexpr const char* kIndexFile = "model.safetensors.index.json";
constexpr const char* kSingleFile = "model.safetensors";

std::string shape_text(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

}  // namespace

void remove_own_export(const std::string& file) {
  const fs::path path(file);
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) return;
  bool ours = false;
  try {
    if (path.extension() == ".json") {
      std::string text, why;
      ours = ::shardtrain::detail::read_regular_file(path.string(), int64_t{64} << 20, &text, &why) &&
             ::shardtrain::detail::parse_json_text(text).value("metadata", nlohmann::json::object()).value("producer", "") ==
                 "shardtrain";
    } else {
      const SafetensorsFile f(path.string());
      const auto it = f.metadata().find("producer");
      ours = it != f.metadata().end() && it->second.rfind("shardtrain", 0) == 0;
    }
  } catch (const std::exception&) {
    ours = false;
  }
  if (ours) fs::remove(path, ec);
}

namespace {

bool floating_dtype(const std::string& d) { return d == "F32" || d == "BF16" || d == "F16" || d == "F64"; }

}  // namespace

// ---- in -------------------------------------------------------------------------------------

HfWeights::HfWeights(const std::string& path) : path_(path) {
  std::error_code ec;
  if (!fs::is_directory(path, ec)) {
    files_.push_back(std::make_unique<SafetensorsFile>(path));
  } else {
    // Present but not a regular file (a FIFO, a device, a dangling link):
    // opened all the same, so the guarded reader's error says what it is.
    const auto present = [](const fs::path& p) { return ::shardtrain::detail::file_kind(p.string()) != "absent"; };
    const fs::path index = fs::path(path) / kIndexFile;
    if (present(index)) {
      std::string text, why;
      ST_CHECK(::shardtrain::detail::read_regular_file(index.string(), int64_t{64} << 20, &text, &why),
               CheckpointError, "cannot read '", index.string(), "': ", why);
      nlohmann::json j;
      try {
        j = ::shardtrain::detail::parse_json_text(text);
        (void)j.at("weight_map").items();
      } catch (const nlohmann::json::exception& e) {
        ST_CHECK(false, CheckpointError, "'", index.string(), "' is not a safetensors index (", e.what(),
                 "); hint: it should map each tensor name to its shard under \"weight_map\"");
      }
      std::map<std::string, size_t> file_of;
      for (const auto& [name, file] : j["weight_map"].items()) {
        ST_CHECK(file.is_string(), CheckpointError, "'", index.string(), "' maps '", name,
                 "' to a non-string file name");
        const std::string f = file.get<std::string>();
        ST_CHECK(f.find('/') == std::string::npos && f != ".." && !f.empty(), CheckpointError, "'",
                 index.string(), "' names shard '", f, "', which is not a plain file name beside it");
        auto it = file_of.find(f);
        if (it == file_of.end()) {
          const fs::path shard = fs::path(path) / f;
          ST_CHECK(present(shard), CheckpointError, "'", index.string(), "' names shard '",
                   f, "' (for tensor '", name, "'), which is missing from '", path,
                   "'; hint: download every file of the model");
          files_.push_back(std::make_unique<SafetensorsFile>(shard.string()));
          it = file_of.emplace(f, files_.size() - 1).first;
        }
        where_[name] = it->second;
        ST_CHECK(files_[it->second]->find(name) != nullptr, CheckpointError, "'", index.string(),
                 "' maps tensor '", name, "' to '", f, "', which does not hold it");
      }
      return;
    }
    const fs::path single = fs::path(path) / kSingleFile;
    ST_CHECK(present(single), CheckpointError, "'", path, "' holds neither ", kSingleFile,
             " nor ", kIndexFile, "; hint: point model.init_from at a Hugging Face model directory "
             "with safetensors weights (PyTorch .bin files are not read)");
    files_.push_back(std::make_unique<SafetensorsFile>(single.string()));
  }
  for (const auto& e : files_.front()->entries()) where_[e.name] = 0;
}

HfWeights::~HfWeights() = default;
HfWeights::HfWeights(HfWeights&&) noexcept = default;

const SafetensorsEntry* HfWeights::find(const std::string& name, std::string* file) const {
  const auto it = where_.find(name);
  if (it == where_.end()) return nullptr;
  if (file != nullptr) *file = files_[it->second]->path();
  return files_[it->second]->find(name);
}

std::vector<std::string> HfWeights::names() const {
  std::vector<std::string> out;
  for (const auto& [name, file] : where_) out.push_back(name);
  return out;
}

at::Tensor HfWeights::read(const std::string& name) const {
  const auto it = where_.find(name);
  ST_CHECK(it != where_.end(), CheckpointError, "'", path_, "' has no tensor '", name, "'");
  return files_[it->second]->read(name);
}

at::Tensor HfWeights::read_range(const std::string& name, int64_t first, int64_t count) const {
  const auto it = where_.find(name);
  ST_CHECK(it != where_.end(), CheckpointError, "'", path_, "' has no tensor '", name, "'");
  return files_[it->second]->read_range(name, first, count);
}

void HfWeights::read_range_into(const std::string& name, int64_t first, const at::Tensor& out) const {
  const auto it = where_.find(name);
  ST_CHECK(it != where_.end(), CheckpointError, "'", path_, "' has no tensor '", name, "'");
  files_[it->second]->read_range_into(name, first, out);
}

void load_hf_weights(torch::nn::Module& module, const std::shared_ptr<const HfWeights>& source,
                     const ModelFamily& family) {
  const HfWeights& weights = *source;
  std::vector<std::pair<std::string, at::Tensor>> targets;  // each tensor once (tied: first name)
  std::unordered_set<const void*> seen;
  for (const auto& p : module.named_parameters(true)) {
    if (seen.insert(p.value().unsafeGetTensorImpl()).second) targets.emplace_back(p.key(), p.value());
  }
  for (const auto& b : module.named_buffers(true)) {
    if (b.value().defined() && seen.insert(b.value().unsafeGetTensorImpl()).second) targets.emplace_back(b.key(), b.value());
  }
  const auto flip = [&](const std::string& name, const at::Tensor& t) {
    return t.dim() == 2 && family.hf_transposed(name);
  };
  std::vector<std::string> missing, mismatched, unexpected;
  std::set<std::string> wanted;
  for (const auto& [name, t] : targets) {
    wanted.insert(name);
    std::string file;
    const SafetensorsEntry* e = weights.find(name, &file);
    if (e == nullptr) {
      missing.push_back(name);
      continue;
    }
    auto want = t.sizes().vec();
    if (flip(name, t)) std::swap(want[0], want[1]);
    if (e->shape != want) {
      mismatched.push_back(name + " in " + fs::path(file).filename().string() + " (file " + shape_text(e->shape) +
                           ", model " + shape_text(want) + ")");
    } else if (t.is_floating_point() && !floating_dtype(e->dtype)) {
      mismatched.push_back(name + " in " + fs::path(file).filename().string() + " (dtype " + e->dtype +
                           ", expected F32, BF16 or F16)");
    }
  }
  for (const auto& name : weights.names()) {
    if (!wanted.count(name) && !family.hf_skipped(name)) unexpected.push_back(name);
  }
  if (!missing.empty() || !mismatched.empty() || !unexpected.empty()) {
    std::ostringstream os;
    os << "cannot load '" << weights.path() << "' into the " << enum_name(family.type()) << " model:";
    const auto list = [&](const char* what, const std::vector<std::string>& names) {
      if (names.empty()) return;
      os << " " << what << " (" << names.size() << "): ";
      for (size_t i = 0; i < names.size() && i < 8; ++i) os << (i ? ", " : "") << names[i];
      if (names.size() > 8) os << ", ...";
      os << ";";
    };
    list("missing from the files", missing);
    list("mismatched", mismatched);
    list("not in the model", unexpected);
    os << " Hint: build the model with the config the weights were made for (model.type auto reads "
          "the directory's config.json).";
    throw CheckpointError(os.str());
  }
  at::NoGradGuard no_grad;
  for (auto& [name, t] : targets) {
    if (!is_deferred(t)) {
      at::Tensor src = weights.read(name);
      if (flip(name, t)) src = src.t();
      t.copy_(src);
    } else if (!flip(name, t)) {
      // Row-major ranges of the model's tensor are ranges of the file's.
      defer(t, [source, name = name](int64_t first, const at::Tensor& out) {
        source->read_range_into(name, first, out);
      });
    } else {
      // Stored transposed: the range's rows come from columns of the file's
      // tensor, so the tensor is read whole (one tensor, never the model).
      defer(t, [source, name = name](int64_t first, const at::Tensor& out) {
        out.copy_(source->read(name).t().reshape({-1}).narrow(0, first, out.numel()));
      });
    }
  }
}

// ---- out -------------------------------------------------------------------------------------

std::string save_hf_dir(const std::string& dir, const std::string& config_json,
                        const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                        const ModelFamily* family, int64_t max_shard_bytes,
                        const std::map<std::string, std::string>& metadata) {
  // NaN or inf is refused before any shard or config.json is written (the
  // safetensors writer refuses it too, but only once earlier shards exist).
  for (const auto& [name, t] : tensors) {
    if (!t.is_floating_point() || t.numel() == 0) continue;
    const int64_t bad = t.numel() - at::isfinite(t).sum().item<int64_t>();
    ST_CHECK(bad == 0, CheckpointError, "refusing to write '", dir, "': tensor '", name, "' holds ", bad,
             " NaN or infinite values of ", t.numel(),
             "; nothing was written. Hint: the weights diverged (lower optimizer.lr, or use a "
             "checkpoint from before), or an adapter's lora_alpha / r is wrong");
  }
  fs::create_directories(dir);
  // Shards in tensor order, a new one when the next tensor would pass the cap
  // (a tensor larger than the cap gets a shard of its own).
  std::vector<std::vector<size_t>> shards(1);
  int64_t in_shard = 0, total = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const int64_t bytes = tensors[i].second.numel() * static_cast<int64_t>(tensors[i].second.element_size());
    if (!shards.back().empty() && in_shard + bytes > max_shard_bytes) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().push_back(i);
    in_shard += bytes;
    total += bytes;
  }
  const auto oriented = [&](size_t i) {
    const auto& [name, t] = tensors[i];
    return family != nullptr && t.dim() == 2 && family->hf_transposed(name) ? t.t().contiguous() : t.contiguous();
  };
  if (!config_json.empty()) checkpoint::detail::write_file_atomically((fs::path(dir) / "config.json").string(), config_json);
  if (shards.size() == 1) {
    std::vector<std::pair<std::string, at::Tensor>> out;
    for (size_t i : shards[0]) out.emplace_back(tensors[i].first, oriented(i));
    const std::string path = (fs::path(dir) / kSingleFile).string();
    checkpoint::save_safetensors(path, out, /*transpose_conv1d=*/false, metadata);
    remove_own_export((fs::path(dir) / kIndexFile).string());  // a stale index of ours would contradict the file
    return path;
  }
  nlohmann::json weight_map = nlohmann::json::object();
  for (size_t s = 0; s < shards.size(); ++s) {
    char name[64];
    std::snprintf(name, sizeof(name), "model-%05zu-of-%05zu.safetensors", s + 1, shards.size());
    std::vector<std::pair<std::string, at::Tensor>> out;
    for (size_t i : shards[s]) {
      out.emplace_back(tensors[i].first, oriented(i));
      weight_map[tensors[i].first] = name;
    }
    checkpoint::save_safetensors((fs::path(dir) / name).string(), out, /*transpose_conv1d=*/false, metadata);
  }
  const std::string index = (fs::path(dir) / kIndexFile).string();
  const nlohmann::json j = {{"metadata", {{"total_size", total}, {"producer", "shardtrain"}}},
                            {"weight_map", weight_map}};
  checkpoint::detail::write_file_atomically(index, j.dump(2) + "\n");
  remove_own_export((fs::path(dir) / kSingleFile).string());  // loaders prefer a single file to the index
  return index;
}

}  // namespace shardtrain::models
