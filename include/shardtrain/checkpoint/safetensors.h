// The safetensors format (Hugging Face): the interchange file for whole
// models. Layout: an 8-byte little-endian header length N, N bytes of JSON
// ({"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]},
// ..., "__metadata__": {"k": "v"}}, padded with spaces to a multiple of 8),
// then the raw little-endian data, offsets relative to its start.
//
// Hugging Face's GPT-2 keeps the weights of its Conv1D layers (attn.c_attn,
// attn.c_proj, mlp.c_fc, mlp.c_proj) as [in, out]; shardtrain's Linear
// layers keep [out, in]. With transpose_conv1d those four weights are
// transposed on the way out and on the way in, so files match HF's names,
// shapes and values.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "shardtrain/core/options.h"

namespace torch::nn {
class Module;
}

namespace shardtrain::checkpoint {

/// Whether `name` is the weight of a GPT-2 Conv1D layer (attn.c_attn,
/// attn.c_proj, mlp.c_fc, mlp.c_proj), stored transposed by Hugging Face.
bool is_conv1d_weight(const std::string& name);

/// One tensor of a safetensors file, as its header describes it.
struct SafetensorsEntry {
  std::string name;
  std::string dtype;  // "F32", "BF16", ...
  std::vector<int64_t> shape;
  /// Byte range relative to the start of the data section.
  int64_t begin = 0;
  int64_t end = 0;
};

/// Writes a safetensors file tensor by tensor: the header is written first
/// from the declared entries, then each write() streams one tensor, so the
/// whole model is never in memory. Writes to `path`.tmp and renames it
/// onto `path` in finish() (after an fsync).
class SafetensorsWriter {
 public:
  /// `entries`: name, dtype and shape of each tensor, in the order write()
  /// will be called (begin/end are computed). `metadata` becomes
  /// __metadata__ (string values only).
  SafetensorsWriter(const std::string& path, std::vector<SafetensorsEntry> entries,
                    const std::map<std::string, std::string>& metadata = {});
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  /// The next declared tensor: its name, dtype and shape must match.
  void write(const std::string& name, const at::Tensor& tensor);
  /// After the last write(): fsync, rename into place.
  void finish();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Writes `tensors` (in order) to `path`; each is transposed first when
/// transpose_conv1d and is_conv1d_weight(name).
void save_safetensors(const std::string& path,
                      const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                      bool transpose_conv1d = false,
                      const std::map<std::string, std::string>& metadata = {});

/// A parsed, validated safetensors file; tensors are read on demand.
class SafetensorsFile {
 public:
  /// Reads and validates the header: its length fits the file, it is a JSON
  /// object, dtypes are known, every shape matches its byte range, ranges
  /// lie in the data section and tile it without gaps or overlaps, and the
  /// file is not truncated. CheckpointError naming the file otherwise.
  explicit SafetensorsFile(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const;
  /// In the header's order.
  const std::vector<SafetensorsEntry>& entries() const;
  const std::map<std::string, std::string>& metadata() const;
  /// The entry called `name`, or null.
  const SafetensorsEntry* find(const std::string& name) const;
  /// Reads tensor `name` in its stored dtype and shape.
  at::Tensor read(const std::string& name) const;
  /// Reads elements [first, first + count) of tensor `name` (row-major) as a
  /// 1-D tensor of its stored dtype: only those bytes.
  at::Tensor read_range(const std::string& name, int64_t first, int64_t count) const;
  /// Reads elements [first, first + out.numel()) of tensor `name` into `out`
  /// (1-D contiguous, any floating dtype): straight into it when the dtypes
  /// agree, through a staging copy otherwise.
  void read_range_into(const std::string& name, int64_t first, const at::Tensor& out) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

struct SafetensorsLoadOptions {
  /// Transpose GPT-2 Conv1D weights ([in, out] in the file).
  ST_ARG(bool, transpose_conv1d) = false;
  /// true: tensors in the file that the module does not have are an error;
  /// false: they are ignored (e.g. HF's attn.bias mask buffers).
  ST_ARG(bool, strict) = true;
};

/// Loads the file at `path` into `module`'s parameters and buffers, matched
/// by named_parameters()/named_buffers() name, converting dtypes. Checks
/// every name and shape first and throws one CheckpointError listing the
/// missing, unexpected and mismatched names, before anything is copied.
void load_safetensors_into(torch::nn::Module& module, const std::string& path,
                           const SafetensorsLoadOptions& options = {});

/// Writes the parameters and buffers of complete checkpoint `checkpoint_dir`
/// (optimizer state left out) to `out` in safetensors format, reading and
/// writing one tensor at a time. Returns the number of tensors written.
int64_t consolidate_to_safetensors(const std::string& checkpoint_dir, const std::string& out,
                                   bool transpose_conv1d = true);

}  // namespace shardtrain::checkpoint
