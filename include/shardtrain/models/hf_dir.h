// Hugging Face model directories in and out.
//
// In: `config.json` plus `model.safetensors`, or the shards that
// `model.safetensors.index.json` names (its `weight_map`), tensors in F32,
// BF16 or F16; or a single .safetensors file. Tensors are read one at a time,
// or as element ranges of one tensor (a rank's shard), never the whole model.
//
// Out: `config.json` and `model.safetensors`, or past `max_shard_bytes`
// the shards `model-00001-of-00003.safetensors` ... with the index, as
// transformers writes them, so `AutoModelForCausalLM.from_pretrained(dir)`
// loads the directory.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace torch::nn {
class Module;
}
namespace shardtrain::checkpoint {
class SafetensorsFile;
struct SafetensorsEntry;
}  // namespace shardtrain::checkpoint

namespace shardtrain::models {

class ModelFamily;

/// The tensors of a Hugging Face directory (or one safetensors file).
class HfWeights {
 public:
  /// Opens every file and checks the index: a shard the index names that is
  /// missing, or a tensor it maps to a file that lacks it, is a
  /// CheckpointError naming both.
  explicit HfWeights(const std::string& path);
  ~HfWeights();
  HfWeights(HfWeights&&) noexcept;

  /// The entry of tensor `name` and the file holding it; null when absent.
  const checkpoint::SafetensorsEntry* find(const std::string& name, std::string* file = nullptr) const;
  /// Every tensor name, sorted.
  std::vector<std::string> names() const;
  /// Tensor `name` in its stored dtype and shape.
  at::Tensor read(const std::string& name) const;
  /// Elements [first, first + count) of tensor `name` in row-major order,
  /// stored dtype, as a 1-D tensor; only those bytes are read.
  at::Tensor read_range(const std::string& name, int64_t first, int64_t count) const;
  /// The same range into `out` (1-D contiguous, any floating dtype, cast
  /// when it is not the stored one), without a staging copy when it is.
  void read_range_into(const std::string& name, int64_t first, const at::Tensor& out) const;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::vector<std::unique_ptr<checkpoint::SafetensorsFile>> files_;
  std::map<std::string, size_t> where_;
};

/// Checks `module`'s parameters and buffers against `weights` (every name
/// present, shapes equal after the family's transposes, floating dtypes
/// F32/BF16/F16 for floating tensors) and throws one CheckpointError listing
/// missing, unexpected and mismatched tensors with the file; then copies
/// tensor by tensor. Deferred tensors (core/deferred.h) are not read: they
/// get a reader of `weights` instead, so that whoever keeps them (a sharded
/// strategy keeps slices) reads only what it keeps.
void load_hf_weights(torch::nn::Module& module, const std::shared_ptr<const HfWeights>& weights,
                     const ModelFamily& family);

/// Writes `dir`/config.json (unless `config_json` is empty) and the tensors,
/// one file or shards of at most `max_shard_bytes` with an index; each file
/// written aside and renamed into place, the index last. 2-D tensors the
/// family stores transposed are transposed (family null: none). Returns the
/// path of the single file, or of the index.
std::string save_hf_dir(const std::string& dir, const std::string& config_json,
                        const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                        const ModelFamily* family, int64_t max_shard_bytes,
                        const std::map<std::string, std::string>& metadata = {});

/// Removes the file at `path` when it is an earlier export of ours (a
/// safetensors file or index whose metadata names shardtrain as producer);
/// anything else is left alone.
void remove_own_export(const std::string& path);

/// transformers' default shard cap: 5 GB.
constexpr int64_t kDefaultMaxShardBytes = int64_t{5} * 1000 * 1000 * 1000;

}  // namespace shardtrain::models
