// safetensors reading and writing, streamed tensor by tensor, and the export
// of a sharded checkpoint to one safetensors file.
#include "shardtrain/checkpoint/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include "core/json.h"
#include "checkpoint/detail.h"
#include "checkpoint/json_int.h"
#include "core/file.h"
#include "shardtrain/checkpoint/checkpoint.h"
#include "shardtrain/core/error.h"

namespace shardtrain::checkpoint {

namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;
using namespace detail;

namespace {

// The safetensors reference implementation refuses headers above 100 MB.
constexpr int64_t kMaxHeaderBytes = int64_t{100} << 20;

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::ostringstream os;
  os << c10::IntArrayRef(shape);
  return os.str();
}

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// A name or dtype from a file, as a message shows it: cut short, since a
// hostile header can make it megabytes long.
std::string cut(const std::string& s) { return s.size() <= 80 ? s : s.substr(0, 80) + "..."; }

std::vector<int64_t> transposed(const std::vector<int64_t>& shape) {
  return shape.size() == 2 ? std::vector<int64_t>{shape[1], shape[0]} : shape;
}

}  // namespace

bool is_conv1d_weight(const std::string& name) {
  return ends_with(name, "attn.c_attn.weight") || ends_with(name, "attn.c_proj.weight") ||
         ends_with(name, "mlp.c_fc.weight") || ends_with(name, "mlp.c_proj.weight");
}

// ---- writing ------------------------------------------------------------------------

struct SafetensorsWriter::Impl {
  std::string path;
  std::string tmp;
  std::unique_ptr<OutFile> out;
  std::vector<SafetensorsEntry> entries;
  size_t next = 0;
  bool finished = false;
};

SafetensorsWriter::SafetensorsWriter(const std::string& path, std::vector<SafetensorsEntry> entries,
                                     const std::map<std::string, std::string>& metadata)
    : impl_(std::make_unique<Impl>()) {
  impl_->path = path;
  Json header = Json::object();
  if (!metadata.empty()) {
    Json meta = Json::object();
    for (const auto& [k, v] : metadata) meta[k] = v;
    header["__metadata__"] = std::move(meta);
  }
  int64_t offset = 0;
  std::unordered_set<std::string> names;
  for (auto& e : entries) {
    ST_CHECK(e.name != "__metadata__" && names.insert(e.name).second, InvalidArgument,
             "safetensors tensor name '", e.name, "' is reserved or repeated");
    const int64_t es = dtype_bytes(e.dtype);
    ST_CHECK(es > 0, InvalidArgument, "safetensors tensor '", e.name, "' has unknown dtype '",
             e.dtype, "'");
    e.begin = offset;
    e.end = offset + numel_of(e.shape) * es;
    offset = e.end;
    header[e.name] = Json{{"dtype", e.dtype}, {"shape", e.shape}, {"data_offsets", {e.begin, e.end}}};
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // data starts 8-byte aligned
  impl_->entries = std::move(entries);
  impl_->out = OutFile::beside(path, int64_t{1} << 20);
  impl_->tmp = impl_->out->path();
  unsigned char len[8];
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(n >> (8 * i));
  try {
    impl_->out->write(len, 8);
    impl_->out->write(text.data(), text.size());
  } catch (...) {
    // No destructor runs for a constructor that throws: remove the file here.
    impl_->out.reset();
    std::error_code ec;
    fs::remove(impl_->tmp, ec);
    throw;
  }
}

SafetensorsWriter::~SafetensorsWriter() {
  if (!impl_->finished) {
    impl_->out.reset();
    std::error_code ec;
    fs::remove(impl_->tmp, ec);
  }
}

void SafetensorsWriter::write(const std::string& name, const at::Tensor& tensor) {
  ST_CHECK(impl_->next < impl_->entries.size(), InvalidArgument, "safetensors: tensor '", name,
           "' written after the last declared one");
  const SafetensorsEntry& e = impl_->entries[impl_->next];
  ST_CHECK(e.name == name && dtype_name(tensor.scalar_type()) == e.dtype &&
               tensor.sizes().vec() == e.shape,
           InvalidArgument, "safetensors: expected tensor '", e.name, "' ", e.dtype, " ",
           shape_str(e.shape), ", got '", name, "' ", dtype_name(tensor.scalar_type()), " ",
           tensor.sizes());
  const at::Tensor data = tensor.detach().to(at::kCPU).contiguous();
  // A model with NaN or inf in it is no model: refused before a byte of it
  // lands, whoever exports (the trained model, a LoRA merge, consolidate).
  if (data.is_floating_point() && data.numel() > 0) {
    const int64_t bad = data.numel() - at::isfinite(data).sum().item<int64_t>();
    ST_CHECK(bad == 0, CheckpointError, "refusing to write '", impl_->path, "': tensor '", name,
             "' holds ", bad, " NaN or infinite values of ", data.numel(),
             "; nothing was written. Hint: the weights diverged (lower optimizer.lr, or use a "
             "checkpoint from before), or an adapter's lora_alpha / r is wrong");
  }
  if (data.numel() > 0) impl_->out->write(data.data_ptr(), static_cast<size_t>(data.nbytes()));
  ++impl_->next;
}

void SafetensorsWriter::finish() {
  ST_CHECK(impl_->next == impl_->entries.size(), InvalidArgument, "safetensors: only ",
           impl_->next, " of ", impl_->entries.size(), " declared tensors were written");
  impl_->out->close_and_sync();
  impl_->out.reset();
  std::error_code ec;
  fs::rename(impl_->tmp, impl_->path, ec);
  ST_CHECK(!ec, CheckpointError, "cannot rename '", impl_->tmp, "' to '", impl_->path, "': ",
           ec.message());
  const auto parent = fs::path(impl_->path).parent_path();
  fsync_dir(parent.empty() ? "." : parent.string());
  impl_->finished = true;
}

void save_safetensors(const std::string& path,
                      const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                      bool transpose_conv1d, const std::map<std::string, std::string>& metadata) {
  const auto flip = [&](const std::string& name, const at::Tensor& t) {
    return transpose_conv1d && is_conv1d_weight(name) && t.dim() == 2;
  };
  std::vector<SafetensorsEntry> entries;
  for (const auto& [name, t] : tensors) {
    SafetensorsEntry e;
    e.name = name;
    e.dtype = dtype_name(t.scalar_type());
    e.shape = flip(name, t) ? transposed(t.sizes().vec()) : t.sizes().vec();
    entries.push_back(std::move(e));
  }
  SafetensorsWriter writer(path, std::move(entries), metadata);
  for (const auto& [name, t] : tensors) writer.write(name, flip(name, t) ? t.t() : t);
  writer.finish();
}

// ---- reading ------------------------------------------------------------------------

struct SafetensorsFile::Impl {
  std::string path;
  int fd = -1;
  int64_t data_start = 0;
  std::vector<SafetensorsEntry> entries;
  std::map<std::string, std::string> metadata;
  std::unordered_map<std::string, size_t> index;
  ~Impl() {
    if (fd >= 0) ::close(fd);
  }
};

namespace {

// The header's JSON text, read from an open file of `size` bytes after its
// 8-byte little-endian length; *data_start is where the data section begins.
std::string read_header_text(int fd, int64_t size, const std::string& path, const std::string& where,
                             int64_t* data_start) {
  ST_CHECK(size >= 8, CheckpointError, where, " has ", size,
           " bytes: too short for the 8-byte header length. Hint: it is not a safetensors file.");
  unsigned char len[8];
  pread_exact(fd, len, 8, 0, path);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | len[i];
  ST_CHECK(n >= 2 && n <= static_cast<uint64_t>(kMaxHeaderBytes) &&
               static_cast<int64_t>(n) <= size - 8,
           CheckpointError, where, " declares a header of ", n, " bytes but the file has ", size,
           " bytes (the header must be 2 .. 100 MB and fit in the file). Hint: the file is "
           "truncated or not a safetensors file.");
  std::string text(static_cast<size_t>(n), '\0');
  pread_exact(fd, text.data(), text.size(), 8, path);
  *data_start = 8 + static_cast<int64_t>(n);
  return text;
}

// The header's __metadata__: an object of strings.
void read_metadata(const Json& value, const std::string& where, std::map<std::string, std::string>& metadata) {
  ST_CHECK(value.is_object(), CheckpointError, where, ": __metadata__ is not an object");
  for (const auto& [k, v] : value.items()) {
    ST_CHECK(v.is_string(), CheckpointError, where, ": __metadata__ value '", k,
             "' is not a string");
    metadata[k] = v.get<std::string>();
  }
}

// One tensor's header entry: a known dtype, a shape of whole numbers, and
// data offsets that hold exactly its bytes inside the data section.
SafetensorsEntry read_entry(const std::string& key, const Json& value, const std::string& where,
                            int64_t data_bytes) {
  const std::string tw = where + " tensor '" + cut(key) + "'";
  ST_CHECK(value.is_object() && value.contains("dtype") && value.contains("shape") &&
               value.contains("data_offsets"),
           CheckpointError, tw, " needs dtype, shape and data_offsets");
  SafetensorsEntry e;
  e.name = key;
  e.dtype = value.at("dtype").get<std::string>();
  const int64_t es = dtype_bytes(e.dtype);
  ST_CHECK(es > 0, CheckpointError, tw, " has unknown dtype '", cut(e.dtype),
           "'; known: F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL");
  // Whole numbers only: nlohmann would truncate 2.9 to 2 and read true as 1.
  std::vector<int64_t> offsets;
  ST_CHECK(json_int_list(value.at("shape"), &e.shape), CheckpointError, tw, " has shape ",
           ::shardtrain::detail::json_excerpt(value.at("shape")), ": expected a list of whole numbers");
  ST_CHECK(json_int_list(value.at("data_offsets"), &offsets) && offsets.size() == 2,
           CheckpointError, tw, " has data_offsets ", ::shardtrain::detail::json_excerpt(value.at("data_offsets")),
           ": expected [begin, end], two whole numbers");
  e.begin = offsets[0];
  e.end = offsets[1];
  int64_t numel = 1;
  for (int64_t d : e.shape) {
    ST_CHECK(d >= 0 && !__builtin_mul_overflow(numel, d, &numel), CheckpointError, tw,
             " has an impossible shape ", shape_str(e.shape));
  }
  int64_t nbytes = 0;
  ST_CHECK(!__builtin_mul_overflow(numel, es, &nbytes), CheckpointError, tw, " is too large");
  ST_CHECK(e.begin >= 0 && e.begin <= e.end, CheckpointError, tw, " has data_offsets [",
           e.begin, ", ", e.end, "]: begin must be >= 0 and <= end");
  ST_CHECK(e.end - e.begin == nbytes, CheckpointError, tw, " has ", e.end - e.begin,
           " bytes of data but ", e.dtype, " ", shape_str(e.shape), " needs ", nbytes);
  ST_CHECK(e.end <= data_bytes, CheckpointError, tw, " has data_offsets [", e.begin, ", ",
           e.end, "] beyond the ", data_bytes,
           " bytes of data in the file: it is truncated or the header is wrong.");
  return e;
}

// The tensors must tile the data section: no gaps, no overlaps, nothing after.
void check_tiling(const std::vector<SafetensorsEntry>& entries, const std::string& where, int64_t data_bytes) {
  std::vector<const SafetensorsEntry*> sorted;
  for (const auto& e : entries) sorted.push_back(&e);
  std::sort(sorted.begin(), sorted.end(), [](const SafetensorsEntry* a, const SafetensorsEntry* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  int64_t next = 0;
  for (const auto* e : sorted) {
    ST_CHECK(e->begin == next, CheckpointError, where, ": tensor '", e->name, "' starts at byte ",
             e->begin, " of the data but the previous one ends at ", next,
             " (tensors must be contiguous and must not overlap)");
    next = e->end;
  }
  ST_CHECK(next == data_bytes, CheckpointError, where, ": the tensors hold ", next,
           " bytes but the file has ", data_bytes, " bytes of data after the header");
}

}  // namespace

SafetensorsFile::SafetensorsFile(const std::string& path) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.path = path;
  const std::string where = "safetensors file '" + path + "'";
  std::string why;
  m.fd = ::shardtrain::detail::open_regular_for_reading(path, &why);
  ST_CHECK(m.fd >= 0, CheckpointError, "cannot open ", where, ": ", why,
           ". Hint: pass a .safetensors file");
  struct stat st {};
  ST_CHECK(::fstat(m.fd, &st) == 0, CheckpointError, "cannot stat ", where, ": ",
           std::strerror(errno));
  const int64_t size = st.st_size;
  const std::string text = read_header_text(m.fd, size, path, where, &m.data_start);
  const int64_t data_bytes = size - m.data_start;

  Json header;
  std::string problem;
  ST_CHECK(::shardtrain::detail::parse_json(text, &header, &problem), CheckpointError, where,
           ": the header is not valid JSON (", problem,
           "). Hint: it is not a safetensors file, or it is damaged.");
  ST_CHECK(header.is_object(), CheckpointError, where, ": the header is not a JSON object");
  try {
    for (const auto& [key, value] : header.items()) {
      if (key == "__metadata__") {
        read_metadata(value, where, m.metadata);
        continue;
      }
      SafetensorsEntry e = read_entry(key, value, where, data_bytes);
      m.index.emplace(e.name, m.entries.size());
      m.entries.push_back(std::move(e));
    }
  } catch (const Json::exception& e) {
    ST_CHECK(false, CheckpointError, where, ": malformed header entry (", e.what(), ")");
  }
  check_tiling(m.entries, where, data_bytes);
}

SafetensorsFile::~SafetensorsFile() = default;

const std::string& SafetensorsFile::path() const { return impl_->path; }
const std::vector<SafetensorsEntry>& SafetensorsFile::entries() const { return impl_->entries; }
const std::map<std::string, std::string>& SafetensorsFile::metadata() const {
  return impl_->metadata;
}

const SafetensorsEntry* SafetensorsFile::find(const std::string& name) const {
  auto it = impl_->index.find(name);
  return it == impl_->index.end() ? nullptr : &impl_->entries[it->second];
}

at::Tensor SafetensorsFile::read(const std::string& name) const {
  const SafetensorsEntry* e = find(name);
  ST_CHECK(e != nullptr, CheckpointError, "safetensors file '", impl_->path, "' has no tensor '",
           name, "'");
  at::Tensor t = at::empty(e->shape, at::TensorOptions().dtype(dtype_from_name(e->dtype, name)));
  if (e->end > e->begin) {
    pread_exact(impl_->fd, t.data_ptr(), static_cast<size_t>(e->end - e->begin),
                impl_->data_start + e->begin, impl_->path);
  }
  return t;
}

at::Tensor SafetensorsFile::read_range(const std::string& name, int64_t first, int64_t count) const {
  const SafetensorsEntry* e = find(name);
  ST_CHECK(e != nullptr, CheckpointError, "safetensors file '", impl_->path, "' has no tensor '",
           name, "'");
  at::Tensor t = at::empty({count}, at::TensorOptions().dtype(dtype_from_name(e->dtype, name)));
  read_range_into(name, first, t);
  return t;
}

void SafetensorsFile::read_range_into(const std::string& name, int64_t first, const at::Tensor& out) const {
  const SafetensorsEntry* e = find(name);
  ST_CHECK(e != nullptr, CheckpointError, "safetensors file '", impl_->path, "' has no tensor '",
           name, "'");
  const at::ScalarType dtype = dtype_from_name(e->dtype, name);
  const int64_t size = static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t count = out.numel();
  ST_CHECK(first >= 0 && (first + count) * size <= e->end - e->begin, InvalidArgument,
           "read_range: elements [", first, ", ", first + count, ") lie outside tensor '", name, "'");
  ST_CHECK(out.dim() == 1 && out.is_contiguous(), InvalidArgument,
           "read_range_into: the destination must be 1-D and contiguous");
  if (count == 0) return;
  if (out.scalar_type() != dtype) {
    out.copy_(read_range(name, first, count));
    return;
  }
  pread_exact(impl_->fd, out.data_ptr(), static_cast<size_t>(count * size),
              impl_->data_start + e->begin + first * size, impl_->path);
}

void load_safetensors_into(torch::nn::Module& module, const std::string& path,
                           const SafetensorsLoadOptions& options) {
  SafetensorsFile file(path);
  // The module's tensors, each once (a tied weight under its first name).
  std::vector<std::pair<std::string, at::Tensor>> targets;
  std::unordered_set<const void*> seen;
  for (const auto& p : module.named_parameters(true)) {
    if (seen.insert(p.value().unsafeGetTensorImpl()).second) targets.emplace_back(p.key(), p.value());
  }
  for (const auto& b : module.named_buffers(true)) {
    if (b.value().defined() && seen.insert(b.value().unsafeGetTensorImpl()).second) {
      targets.emplace_back(b.key(), b.value());
    }
  }
  const auto flip = [&](const std::string& name, const at::Tensor& t) {
    return options.transpose_conv1d() && is_conv1d_weight(name) && t.dim() == 2;
  };
  std::vector<std::string> missing, mismatched, unexpected;
  std::unordered_set<std::string> wanted;
  for (const auto& [name, t] : targets) {
    wanted.insert(name);
    const SafetensorsEntry* e = file.find(name);
    if (!e) {
      missing.push_back(name);
      continue;
    }
    const auto want = flip(name, t) ? transposed(t.sizes().vec()) : t.sizes().vec();
    if (e->shape != want) {
      mismatched.push_back(name + " (file " + shape_str(e->shape) + ", model " + shape_str(want) +
                           ")");
    }
  }
  if (options.strict()) {
    for (const auto& e : file.entries()) {
      // Hugging Face GPT-2 files carry the causal masks as buffers
      // (h.N.attn.bias, h.N.attn.masked_bias); our GPT builds its mask.
      const bool hf_mask = options.transpose_conv1d() &&
                           (ends_with(e.name, ".attn.bias") || ends_with(e.name, ".attn.masked_bias"));
      if (!wanted.count(e.name) && !hf_mask) unexpected.push_back(e.name);
    }
  }
  if (!missing.empty() || !mismatched.empty() || !unexpected.empty()) {
    std::ostringstream os;
    os << "cannot load safetensors file '" << path << "' into the model:";
    const auto list = [&](const char* what, const std::vector<std::string>& names) {
      if (names.empty()) return;
      os << " " << what << " (" << names.size() << "): ";
      for (size_t i = 0; i < names.size() && i < 10; ++i) os << (i ? ", " : "") << names[i];
      if (names.size() > 10) os << ", ...";
      os << ";";
    };
    list("missing from the file", missing);
    list("shape mismatch", mismatched);
    list("not in the model", unexpected);
    os << " Hint: build the model with the config the file was made for";
    if (!options.transpose_conv1d()) os << ", or set transpose_conv1d for Hugging Face GPT-2 files";
    os << ".";
    throw CheckpointError(os.str());
  }
  at::NoGradGuard no_grad;
  for (auto& [name, t] : targets) {
    at::Tensor src = file.read(name);
    if (flip(name, t)) src = src.t();
    t.copy_(src);
  }
}

int64_t consolidate_to_safetensors(const std::string& checkpoint_dir, const std::string& out,
                                   bool transpose_conv1d) {
  CheckpointReader reader(checkpoint_dir);
  const Metadata& meta = reader.metadata();
  const auto flip = [&](const TensorInfo& t) {
    return transpose_conv1d && is_conv1d_weight(t.name) && t.shape.size() == 2;
  };
  std::vector<SafetensorsEntry> entries;
  for (const auto& t : meta.tensors) {
    if (t.kind == "optimizer") continue;
    SafetensorsEntry e;
    e.name = t.name;
    e.dtype = t.dtype;
    e.shape = flip(t) ? transposed(t.shape) : t.shape;
    entries.push_back(std::move(e));
  }
  std::map<std::string, std::string> info = {{"format", "pt"},
                                             {"producer", "shardtrain"},
                                             {"strategy", meta.strategy},
                                             {"world_size", std::to_string(meta.world_size)}};
  if (meta.step >= 0) info["step"] = std::to_string(meta.step);
  const int64_t count = static_cast<int64_t>(entries.size());
  SafetensorsWriter writer(out, std::move(entries), info);
  // One tensor in memory at a time (two while a Conv1D weight is transposed).
  for (const auto& t : meta.tensors) {
    if (t.kind == "optimizer") continue;
    at::Tensor data = reader.read_tensor(t.name);
    writer.write(t.name, flip(t) ? data.t().contiguous() : data);
  }
  writer.finish();
  return count;
}

}  // namespace shardtrain::checkpoint
