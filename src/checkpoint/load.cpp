// Loading: a reader that preads only the stored byte ranges a target
// overlaps and verifies the checksum of every piece it touches, and the
// collective load_sharded that makes all ranks succeed or fail together.
//
// Checksums are verified per piece (SaveOptions::checksum_chunk_bytes, 1 MiB
// by default), not per file: a rank reads whole pieces around the bytes it
// needs, so it never reads the whole checkpoint, and no byte it uses escapes
// verification. verify_all() (used by `inspect`) checks every piece of
// every file.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <set>
#include <sstream>
#include <unordered_map>

#include "core/json.h"
#include "checkpoint/detail.h"
#include "core/file.h"
#include "shardtrain/comm/communicator.h"
#include "shardtrain/core/error.h"

namespace shardtrain::checkpoint {

namespace fs = std::filesystem;
using namespace detail;

namespace {

std::string shape_text(const std::vector<int64_t>& shape) {
  std::ostringstream os;
  os << c10::IntArrayRef(shape);
  return os.str();
}

constexpr char kInspectHint[] =
    "Hint: `shardtrain checkpoint inspect DIR` checks every file; load an older checkpoint "
    "if this one is damaged.";

}  // namespace

struct CheckpointReader::Impl {
  std::string dir;
  Metadata meta;
  std::unordered_map<std::string, size_t> tensor_index;
  std::unordered_map<std::string, size_t> file_index;
  std::vector<int> fds;
  std::vector<char> scratch;

  ~Impl() {
    for (int fd : fds) {
      if (fd >= 0) ::close(fd);
    }
  }

  std::string path_of(const FileInfo& f) const { return (fs::path(dir) / f.name).string(); }

  // Opens file i once; checks its size again (it may have changed since the
  // reader was made) and, for rank files, the header.
  int fd_for(size_t i) {
    if (fds[i] >= 0) return fds[i];
    const FileInfo& f = meta.files[i];
    const std::string path = path_of(f);
    std::string why;
    const int fd = ::shardtrain::detail::open_regular_for_reading(path, &why);
    if (fd < 0) {
      const int err = errno;
      ST_CHECK(err != ENOENT, CheckpointError, "checkpoint file '", path,
               "' is missing (the metadata lists it", f.rank >= 0 ? " as rank " : "",
               f.rank >= 0 ? std::to_string(f.rank) + "'s file" : std::string(), "). ",
               kInspectHint);
      ST_CHECK(false, CheckpointError, "cannot open checkpoint file '", path, "': ", why, ". ",
               kInspectHint);
    }
    struct stat st {};
    const bool ok = ::fstat(fd, &st) == 0;
    if (!ok || st.st_size != f.bytes) {
      ::close(fd);
      ST_CHECK(false, CheckpointError, "checkpoint file '", path, "' has ",
               ok ? std::to_string(st.st_size) : std::string("unreadable"),
               " bytes but the metadata records ", f.bytes,
               ok && st.st_size < f.bytes ? ": it is truncated. " : ". ", kInspectHint);
    }
    fds[i] = fd;
    if (f.rank >= 0) check_rank_header(i);
    return fd;
  }

  void check_rank_header(size_t i) {
    const FileInfo& f = meta.files[i];
    unsigned char header[kRankHeaderBytes];
    ST_CHECK(f.bytes >= kRankHeaderBytes, CheckpointError, "'", path_of(f),
             "' is too short to be a rank file. ", kInspectHint);
    read_bytes(i, 0, kRankHeaderBytes, header);
    uint32_t fields[4];
    std::memcpy(fields, header + 8, sizeof(fields));
    ST_CHECK(std::memcmp(header, kRankMagic, sizeof(kRankMagic)) == 0, CheckpointError, "'",
             path_of(f), "' is not a shardtrain rank file (bad magic number)");
    ST_CHECK(fields[0] == static_cast<uint32_t>(kFormatVersion) &&
                 fields[1] == static_cast<uint32_t>(f.rank) &&
                 fields[2] == static_cast<uint32_t>(meta.world_size),
             CheckpointError, "'", path_of(f), "' was written as rank ", fields[1], " of ",
             fields[2], " (format ", fields[0], ") but the metadata expects rank ", f.rank, " of ",
             meta.world_size, ": files of different checkpoints were mixed");
  }

  // Bytes [off, off + n) of file i into dst, verifying every checksum piece
  // they touch (whole pieces are read; partial ones go through scratch).
  void read_bytes(size_t i, int64_t off, int64_t n, void* dst) {
    const FileInfo& f = meta.files[i];
    ST_ASSERT(off >= 0 && n >= 0 && off + n <= f.bytes, "read of ", off, "+", n, " in ", f.name);
    const int fd = fd_for(i);
    const std::string path = path_of(f);
    char* out = static_cast<char*>(dst);
    const int64_t cb = f.chunk_bytes;
    for (int64_t c = off / cb; c * cb < off + n; ++c) {
      const int64_t cs = c * cb;
      const int64_t ce = std::min(cs + cb, f.bytes);
      const int64_t lo = std::max(cs, off);
      const int64_t hi = std::min(ce, off + n);
      const bool whole = lo == cs && hi == ce;
      char* target = out + (cs - off);
      if (!whole) {
        scratch.resize(static_cast<size_t>(ce - cs));
        target = scratch.data();
      }
      pread_exact(fd, target, static_cast<size_t>(ce - cs), cs, path);
      const uint32_t crc = crc32c(0, target, static_cast<size_t>(ce - cs));
      const uint32_t want = f.chunk_crc32c[static_cast<size_t>(c)];
      if (crc != want) {
        char buf[160];
        std::snprintf(buf, sizeof(buf), "bytes %lld..%lld (checksum piece %lld) have CRC32C %08x "
                      "but the metadata records %08x",
                      static_cast<long long>(cs), static_cast<long long>(ce - 1),
                      static_cast<long long>(c), crc, want);
        ST_CHECK(false, CheckpointError, "checksum mismatch in checkpoint file '", path, "': ",
                 buf, ": the file is corrupt. ", kInspectHint);
      }
      if (!whole) std::memcpy(out + (lo - off), scratch.data() + (lo - cs), static_cast<size_t>(hi - lo));
    }
  }

  size_t file_of(const std::string& name) const { return file_index.at(name); }

  // Elements [offset, offset + local.numel()) of `info` into `local`.
  void read_into(const TensorInfo& info, int64_t offset, const at::Tensor& local) {
    const int64_t n = local.numel();
    if (n == 0) return;
    const at::ScalarType stored = dtype_from_name(info.dtype, "tensor '" + info.name + "'");
    const int64_t es = dtype_bytes(info.dtype);
    const bool direct = local.scalar_type() == stored && local.device().is_cpu() &&
                        local.is_contiguous();
    at::Tensor buf = direct ? local : at::empty({n}, at::TensorOptions().dtype(stored));
    char* base = static_cast<char*>(buf.data_ptr());
    for (const auto& s : info.slices) {
      const int64_t lo = std::max(s.offset, offset);
      const int64_t hi = std::min(s.offset + s.count, offset + n);
      if (lo >= hi) continue;
      read_bytes(file_of(s.file), s.byte_offset + (lo - s.offset) * es, (hi - lo) * es,
                 base + (lo - offset) * es);
    }
    if (!direct) {
      at::NoGradGuard no_grad;
      local.copy_(buf.view(local.sizes()));
    }
  }

  std::string read_blob(size_t i, int64_t off, int64_t n) {
    std::string out(static_cast<size_t>(n), '\0');
    read_bytes(i, off, n, out.data());
    return out;
  }
};

CheckpointReader::CheckpointReader(const std::string& dir, bool check_files)
    : impl_(std::make_unique<Impl>()) {
  impl_->dir = dir;
  const fs::path d(dir);
  std::error_code ec;
  ST_CHECK(fs::exists(d, ec), CheckpointError, "no checkpoint at '", dir,
           "': the path does not exist");
  ST_CHECK(fs::is_directory(d, ec), CheckpointError, "'", dir,
           "' is a file, not a checkpoint directory. Hint: pass a checkpoint directory such as "
           "RUN_DIR/checkpoints/step-000120.");
  const fs::path marker = d / kCommitFile;
  if (!fs::exists(marker, ec)) {
    ST_CHECK(!fs::exists(d / kMetadataFile, ec), CheckpointError, "'", dir,
             "' is an incomplete checkpoint (no ", kCommitFile,
             " marker: its save did not finish). Hint: load the newest complete one "
             "(latest_complete(run_dir)).");
    ST_CHECK(false, CheckpointError, "'", dir, "' is not a shardtrain checkpoint (no ",
             kCommitFile, " marker and no ", kMetadataFile, ")");
  }
  const std::string marker_text = read_small_file(marker.string(), 1 << 16);
  int64_t meta_bytes = -1;
  uint32_t meta_crc = 0;
  try {
    const auto j = ::shardtrain::detail::parse_json_text(marker_text);
    ST_CHECK(j.value("format", std::string()) == "shardtrain-checkpoint", CheckpointError, "");
    meta_bytes = j.at("metadata_bytes").get<int64_t>();
    meta_crc = j.at("metadata_crc32c").get<uint32_t>();
  } catch (const std::exception&) {
    ST_CHECK(false, CheckpointError, "'", marker.string(),
             "' is not a shardtrain commit marker; '", dir, "' is not a shardtrain checkpoint");
  }
  const std::string meta_path = (d / kMetadataFile).string();
  const std::string text = read_small_file(meta_path, int64_t{1} << 31);
  ST_CHECK(static_cast<int64_t>(text.size()) == meta_bytes &&
               crc32c(0, text.data(), text.size()) == meta_crc,
           CheckpointError, "'", meta_path,
           "' does not match the checksum its commit marker records: it is damaged. ",
           kInspectHint);
  impl_->meta = metadata_from_json(text, meta_path);
  for (size_t i = 0; i < impl_->meta.tensors.size(); ++i) {
    impl_->tensor_index.emplace(impl_->meta.tensors[i].name, i);
  }
  for (size_t i = 0; i < impl_->meta.files.size(); ++i) {
    impl_->file_index.emplace(impl_->meta.files[i].name, i);
  }
  impl_->fds.assign(impl_->meta.files.size(), -1);
  if (!check_files) return;
  for (const auto& f : impl_->meta.files) {
    const fs::path p = d / f.name;
    ST_CHECK(fs::exists(p, ec), CheckpointError, "checkpoint file '", p.string(),
             "' is missing (the metadata lists it",
             f.rank >= 0 ? " as rank " + std::to_string(f.rank) + "'s file" : std::string(),
             "). Hint: copy it back from where the checkpoint was written, or load an older "
             "checkpoint.");
    ST_CHECK(fs::is_regular_file(p, ec), CheckpointError, "checkpoint file '", p.string(),
             "' is not a regular file (a FIFO, a device or a directory is never read). ",
             kInspectHint);
    const auto size = static_cast<int64_t>(fs::file_size(p, ec));
    ST_CHECK(size == f.bytes, CheckpointError, "checkpoint file '", p.string(), "' has ", size,
             " bytes but the metadata records ", f.bytes,
             size >= 0 && size < f.bytes ? ": it is truncated. " : ". ", kInspectHint);
  }
}

CheckpointReader::~CheckpointReader() = default;

const std::string& CheckpointReader::dir() const { return impl_->dir; }
const Metadata& CheckpointReader::metadata() const { return impl_->meta; }

// The runs of the whole tensor a target asks for, each with the part of its
// local tensor they fill: one for a slice of the whole tensor, one per run of
// a tensor-parallel block (ShardedTensor::chunk).
static std::vector<std::pair<int64_t, at::Tensor>> target_runs(const ShardedTensor& t) {
  if (t.chunk.whole()) return {{t.offset, t.local}};
  std::vector<std::pair<int64_t, at::Tensor>> out;
  const at::Tensor flat = t.local.view({-1});
  for (const auto& run : strategy::chunk_runs(t.global_shape, t.chunk, t.offset, flat.numel())) {
    out.emplace_back(run.global, flat.narrow(0, run.local, run.count));
  }
  return out;
}

void CheckpointReader::check(const std::vector<ShardedTensor>& targets) const {
  std::vector<std::string> missing, problems;
  for (const auto& t : targets) {
    auto it = impl_->tensor_index.find(t.name);
    if (it == impl_->tensor_index.end()) {
      missing.push_back(t.name);
      continue;
    }
    const TensorInfo& info = impl_->meta.tensors[it->second];
    if (info.shape != t.global_shape) {
      problems.push_back("'" + t.name + "' has shape " + shape_text(info.shape) +
                         " in the checkpoint but " + shape_text(t.global_shape) + " in the model");
      continue;
    }
    if (!t.local.defined()) {
      problems.push_back("'" + t.name + "' has no local tensor to load into");
      continue;
    }
    const int64_t n = t.local.numel();
    if (t.offset < 0 || (t.chunk.whole() && t.offset > info.numel() - n)) {
      problems.push_back("'" + t.name + "' asks for elements " + std::to_string(t.offset) + " + " +
                         std::to_string(n) + " of " + std::to_string(info.numel()));
      continue;
    }
    int64_t covered = 0;
    for (const auto& [offset, part] : target_runs(t)) {
      for (const auto& s : info.slices) {
        const int64_t lo = std::max(s.offset, offset);
        const int64_t hi = std::min(s.offset + s.count, offset + part.numel());
        if (lo < hi) covered += hi - lo;
      }
    }
    if (covered != n) {
      problems.push_back("'" + t.name + "': the checkpoint stores only " +
                         std::to_string(covered) + " of the " + std::to_string(n) +
                         " elements asked for");
    }
  }
  if (missing.empty() && problems.empty()) return;
  std::ostringstream os;
  os << "checkpoint '" << impl_->dir << "' does not match the model:";
  if (!missing.empty()) {
    os << " " << missing.size() << " tensor(s) missing from the checkpoint (";
    for (size_t i = 0; i < missing.size() && i < 10; ++i) os << (i ? ", " : "") << missing[i];
    if (missing.size() > 10) os << ", ...";
    os << ");";
  }
  for (size_t i = 0; i < problems.size() && i < 10; ++i) os << " " << problems[i] << ";";
  if (problems.size() > 10) os << " and " << problems.size() - 10 << " more;";
  os << " Hint: build the model with the config that wrote the checkpoint (`shardtrain "
        "checkpoint inspect DIR` lists its tensors).";
  throw CheckpointError(os.str());
}

void CheckpointReader::read(std::vector<ShardedTensor>& targets) {
  check(targets);
  for (auto& t : targets) {
    for (const auto& [offset, part] : target_runs(t)) {
      impl_->read_into(impl_->meta.tensors[impl_->tensor_index.at(t.name)], offset, part);
    }
  }
}

at::Tensor CheckpointReader::read_range(const std::string& name, int64_t offset, int64_t count) {
  auto it = impl_->tensor_index.find(name);
  ST_CHECK(it != impl_->tensor_index.end(), CheckpointError, "checkpoint '", impl_->dir,
           "' has no tensor '", name, "'");
  const TensorInfo& info = impl_->meta.tensors[it->second];
  ShardedTensor t;
  t.name = name;
  t.global_shape = info.shape;
  t.offset = offset;
  t.local = at::empty({count}, at::TensorOptions().dtype(dtype_from_name(info.dtype, name)));
  std::vector<ShardedTensor> one{t};
  read(one);
  return t.local;
}

at::Tensor CheckpointReader::read_tensor(const std::string& name) {
  const TensorInfo* info = impl_->meta.find_tensor(name);
  ST_CHECK(info != nullptr, CheckpointError, "checkpoint '", impl_->dir, "' has no tensor '", name,
           "'");
  return read_range(name, 0, info->numel()).view(info->shape);
}

std::string CheckpointReader::train_state() {
  const size_t i = impl_->file_of(kTrainStateFile);
  return impl_->read_blob(i, 0, impl_->meta.files[i].bytes);
}

std::string CheckpointReader::rank_state(int rank) {
  if (rank < 0 || rank >= impl_->meta.world_size) return {};
  const size_t i = impl_->file_of(rank_file_name(rank));
  const FileInfo& f = impl_->meta.files[i];
  return impl_->read_blob(i, f.rank_state_offset, f.rank_state_bytes);
}

std::vector<std::string> CheckpointReader::verify_all() {
  std::vector<std::string> out;
  std::vector<char> buf;
  for (size_t i = 0; i < impl_->meta.files.size(); ++i) {
    const FileInfo& f = impl_->meta.files[i];
    try {
      buf.resize(static_cast<size_t>(std::min<int64_t>(f.chunk_bytes, std::max<int64_t>(f.bytes, 1))));
      for (int64_t off = 0; off < f.bytes; off += f.chunk_bytes) {
        impl_->read_bytes(i, off, std::min(f.chunk_bytes, f.bytes - off), buf.data());
      }
      impl_->fd_for(i);  // an empty file is still opened, so a missing one is reported
      out.emplace_back();
    } catch (const std::exception& e) {
      out.emplace_back(e.what());
    }
  }
  return out;
}

Metadata read_metadata(const std::string& dir) { return CheckpointReader(dir, false).metadata(); }

LoadResult load_sharded(const std::string& dir, comm::Communicator& comm,
                        std::vector<ShardedTensor>& targets, const LoadOptions& options) {
  // 1. Open and check names, shapes and coverage everywhere before any rank
  //    writes into its model.
  std::unique_ptr<CheckpointReader> reader;
  std::string error;
  try {
    reader = std::make_unique<CheckpointReader>(dir);
    reader->check(targets);
  } catch (const std::exception& e) {
    error = e.what();
  }
  error = agree_on_error(comm, error);
  if (!error.empty()) throw CheckpointError(error);
  const Metadata& meta = reader->metadata();

  // 2. strict: every parameter and buffer is asked for by some rank.
  if (options.strict()) {
    std::set<std::string> asked;
    for (const auto& t : targets) asked.insert(t.name);
    auto mask = at::zeros({static_cast<int64_t>(meta.tensors.size())}, at::kInt);
    int* m = mask.data_ptr<int>();
    for (size_t i = 0; i < meta.tensors.size(); ++i) m[i] = asked.count(meta.tensors[i].name) ? 1 : 0;
    comm.all_reduce(mask, comm::AllReduceOptions().op(comm::ReduceOp::Max));
    std::vector<std::string> unasked;
    for (size_t i = 0; i < meta.tensors.size(); ++i) {
      if (m[i] == 0 && meta.tensors[i].kind != "optimizer") unasked.push_back(meta.tensors[i].name);
    }
    if (!unasked.empty()) {
      std::ostringstream os;
      os << "checkpoint '" << dir << "' holds " << unasked.size()
         << " parameter(s)/buffer(s) the model does not have (";
      for (size_t i = 0; i < unasked.size() && i < 10; ++i) os << (i ? ", " : "") << unasked[i];
      if (unasked.size() > 10) os << ", ...";
      os << "). Hint: build the model with the config that wrote the checkpoint, or load a "
            "subset on purpose with LoadOptions().strict(false).";
      throw CheckpointError(os.str());
    }
  }

  // 3. Read; all ranks succeed or all throw.
  LoadResult result;
  try {
    reader->read(targets);
    result.train_state = reader->train_state();
    if (meta.world_size == comm.size()) {
      result.rank_state = reader->rank_state(comm.rank());
      result.rank_state_restored = true;
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  error = agree_on_error(comm, error);
  if (!error.empty()) throw CheckpointError(error);
  result.metadata = meta;
  return result;
}

}  // namespace shardtrain::checkpoint
