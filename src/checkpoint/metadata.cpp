// metadata.json: writing it, and reading it back with every field checked,
// so a foreign or damaged file is a CheckpointError and never a crash.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <limits>
#include <set>
#include <unordered_map>

#include "core/json.h"
#include "checkpoint/detail.h"
#include "checkpoint/json_int.h"
#include "shardtrain/core/error.h"

namespace shardtrain::checkpoint {

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

const TensorInfo* Metadata::find_tensor(const std::string& name) const {
  for (const auto& t : tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

const FileInfo* Metadata::find_file(const std::string& name) const {
  for (const auto& f : files) {
    if (f.name == name) return &f;
  }
  return nullptr;
}

namespace detail {

using Json = nlohmann::ordered_json;

namespace {

constexpr char kFormatName[] = "shardtrain-checkpoint";

// Checked reads of one field; the messages say which field of what.
template <typename T>
T get(const Json& j, const char* key, const std::string& where) {
  ST_CHECK(j.is_object() && j.contains(key), CheckpointError, where, " has no '", key, "'");
  try {
    return j.at(key).get<T>();
  } catch (const Json::exception& e) {
    ST_CHECK(false, CheckpointError, where, ": '", key, "' has the wrong type (", e.what(), ")");
  }
  return T{};
}

// A whole number in [lo, hi]: get<int>() would truncate 2.9, read true as
// 1 and wrap 4294967297 to 1, so every number of the metadata comes here.
int64_t get_int(const Json& j, const char* key, const std::string& where, int64_t lo, int64_t hi) {
  ST_CHECK(j.is_object() && j.contains(key), CheckpointError, where, " has no '", key, "'");
  int64_t v = 0;
  ST_CHECK(json_int(j.at(key), lo, hi, &v), CheckpointError, where, ": '", key, "' is ",
           ::shardtrain::detail::json_excerpt(j.at(key)), "; expected a whole number in ", lo, "..", hi,
           ". Hint: the metadata is damaged or not shardtrain's.");
  return v;
}

// A list of checksums, each a whole number that fits 32 bits.
std::vector<uint32_t> get_crc_list(const Json& j, const char* key, const std::string& where) {
  ST_CHECK(j.is_object() && j.contains(key) && j.at(key).is_array(), CheckpointError, where,
           " has no '", key, "' list");
  std::vector<uint32_t> out;
  out.reserve(j.at(key).size());
  for (const auto& item : j.at(key)) {
    int64_t v = 0;
    ST_CHECK(json_int(item, 0, std::numeric_limits<uint32_t>::max(), &v), CheckpointError, where,
             ": '", key, "' holds ", ::shardtrain::detail::json_excerpt(item), ", not a 32-bit checksum");
    out.push_back(static_cast<uint32_t>(v));
  }
  return out;
}

constexpr int64_t kMaxInt = std::numeric_limits<int>::max();
constexpr int64_t kMaxInt64 = std::numeric_limits<int64_t>::max();

// A name or dtype from the file, as a message shows it: cut short.
std::string cut(const std::string& s) { return s.size() <= 80 ? s : s.substr(0, 80) + "..."; }

bool mul_overflows(int64_t a, int64_t b, int64_t* out) { return __builtin_mul_overflow(a, b, out); }

bool safe_file_name(const std::string& name) {
  return !name.empty() && name.find('/') == std::string::npos && name != "." && name != "..";
}

}  // namespace

std::string tensor_kind(const ShardedTensor& tensor) {
  if (tensor.name.rfind("optim.", 0) == 0) return "optimizer";
  return tensor.is_parameter ? "parameter" : "buffer";
}

// ---- to_json: one per struct ---------------------------------------------------------

namespace {

Json to_json(const SliceInfo& s) {
  return Json{{"rank", s.rank},
              {"file", s.file},
              {"offset", s.offset},
              {"count", s.count},
              {"byte_offset", s.byte_offset}};
}

Json to_json(const FileInfo& f) {
  Json j;
  j["name"] = f.name;
  j["rank"] = f.rank;
  j["bytes"] = f.bytes;
  j["crc32c"] = f.crc32c;
  j["chunk_bytes"] = f.chunk_bytes;
  j["chunk_crc32c"] = f.chunk_crc32c;
  j["rank_state_offset"] = f.rank_state_offset;
  j["rank_state_bytes"] = f.rank_state_bytes;
  return j;
}

Json to_json(const TensorInfo& t) {
  Json j;
  j["name"] = t.name;
  j["shape"] = t.shape;
  j["dtype"] = t.dtype;
  j["kind"] = t.kind;
  Json slices = Json::array();
  for (const auto& s : t.slices) slices.push_back(to_json(s));
  j["slices"] = std::move(slices);
  return j;
}

Json to_json(const Metadata& m) {
  Json j;
  j["format"] = kFormatName;
  j["format_version"] = m.format_version;
  j["byte_order"] = "little";
  j["world_size"] = m.world_size;
  j["strategy"] = m.strategy;
  j["step"] = m.step;
  Json files = Json::array();
  for (const auto& f : m.files) files.push_back(to_json(f));
  j["files"] = std::move(files);
  Json tensors = Json::array();
  for (const auto& t : m.tensors) tensors.push_back(to_json(t));
  j["tensors"] = std::move(tensors);
  return j;
}

// ---- from_json: one per struct; each field with its type and range -------------------
//
// What the fields must satisfy together (a slice inside its file, every
// element stored once) is validate()'s, below.

SliceInfo slice_from_json(const Json& js, const std::string& tw) {
  SliceInfo s;
  s.rank = static_cast<int>(get_int(js, "rank", tw, 0, kMaxInt));
  s.file = get<std::string>(js, "file", tw);
  s.offset = get_int(js, "offset", tw, 0, kMaxInt64);
  s.count = get_int(js, "count", tw, 0, kMaxInt64);
  s.byte_offset = get_int(js, "byte_offset", tw, 0, kMaxInt64);
  return s;
}

FileInfo file_from_json(const Json& jf, const std::string& where) {
  FileInfo f;
  f.name = get<std::string>(jf, "name", where + " files[]");
  const std::string fw = where + " file '" + cut(f.name) + "'";
  f.rank = static_cast<int>(get_int(jf, "rank", fw, -1, kMaxInt));
  f.bytes = get_int(jf, "bytes", fw, 0, kMaxInt64);
  f.crc32c = static_cast<uint32_t>(get_int(jf, "crc32c", fw, 0, std::numeric_limits<uint32_t>::max()));
  f.chunk_bytes = get_int(jf, "chunk_bytes", fw, 1, int64_t{1} << 30);
  f.chunk_crc32c = get_crc_list(jf, "chunk_crc32c", fw);
  f.rank_state_offset = get_int(jf, "rank_state_offset", fw, 0, kMaxInt64);
  f.rank_state_bytes = get_int(jf, "rank_state_bytes", fw, 0, kMaxInt64);
  return f;
}

TensorInfo tensor_from_json(const Json& jt, const std::string& where) {
  TensorInfo t;
  t.name = get<std::string>(jt, "name", where + " tensors[]");
  const std::string tw = where + " tensor '" + cut(t.name) + "'";
  ST_CHECK(jt.contains("shape") && json_int_list(jt.at("shape"), &t.shape), CheckpointError, tw,
           " has shape ", ::shardtrain::detail::json_excerpt(jt.value("shape", Json())),
           "; expected a list of whole numbers");
  t.dtype = get<std::string>(jt, "dtype", tw);
  t.kind = get<std::string>(jt, "kind", tw);
  const Json& slices = jt.contains("slices") ? jt.at("slices") : Json();
  ST_CHECK(slices.is_array(), CheckpointError, tw, " has no 'slices' list");
  for (const auto& js : slices) t.slices.push_back(slice_from_json(js, tw));
  return t;
}

Metadata metadata_from_json_value(const Json& j, const std::string& where) {
  ST_CHECK(j.is_object() && j.value("format", std::string()) == kFormatName, CheckpointError,
           where, " is not shardtrain checkpoint metadata (no \"format\": \"", kFormatName,
           "\")");
  Metadata m;
  m.format_version = static_cast<int>(get_int(j, "format_version", where, 0, kMaxInt));
  ST_CHECK(m.format_version == kFormatVersion, CheckpointError, where,
           " has format version ", m.format_version, "; this build reads version ",
           kFormatVersion, ". Hint: use the shardtrain release that wrote it.");
  ST_CHECK(get<std::string>(j, "byte_order", where) == "little", CheckpointError, where,
           " stores big-endian data, which this build does not read");
  m.world_size = static_cast<int>(get_int(j, "world_size", where, 1, kMaxInt));
  m.strategy = get<std::string>(j, "strategy", where);
  m.step = get_int(j, "step", where, -1, kMaxInt64);
  const Json& files = j.contains("files") ? j.at("files") : Json();
  ST_CHECK(files.is_array(), CheckpointError, where, " has no 'files' list");
  // One file per rank at least: checked before anything is read or sized by world_size.
  ST_CHECK(files.size() >= static_cast<size_t>(m.world_size), CheckpointError, where,
           " has world_size ", m.world_size, " but lists only ", files.size(), " files");
  for (const auto& jf : files) m.files.push_back(file_from_json(jf, where));
  const Json& tensors = j.contains("tensors") ? j.at("tensors") : Json();
  ST_CHECK(tensors.is_array(), CheckpointError, where, " has no 'tensors' list");
  for (const auto& jt : tensors) m.tensors.push_back(tensor_from_json(jt, where));
  return m;
}

// ---- validate: the one check of what the fields mean together ----------------------------

// A whole checkpoint's metadata, or one rank's part of a save in progress
// (its own file and its own slices, before rank 0 merges them).
enum class Scope { Checkpoint, OneRank };

void validate_file(const FileInfo& f, const std::string& where) {
  const std::string fw = where + " file '" + cut(f.name) + "'";
  ST_CHECK(safe_file_name(f.name), CheckpointError, fw, " is not a plain file name");
  // Overflow-free: bytes / chunk rounded up, and offset + size <= bytes.
  const int64_t chunks = f.bytes / f.chunk_bytes + (f.bytes % f.chunk_bytes != 0 ? 1 : 0);
  ST_CHECK(static_cast<int64_t>(f.chunk_crc32c.size()) == chunks, CheckpointError, fw, " lists ",
           f.chunk_crc32c.size(), " chunk checksums for ", chunks, " chunks");
  ST_CHECK(f.rank_state_offset <= f.bytes && f.rank_state_bytes <= f.bytes - f.rank_state_offset,
           CheckpointError, fw, " has its rank state (offset ", f.rank_state_offset, ", ",
           f.rank_state_bytes, " bytes) outside the file's ", f.bytes, " bytes");
}

// The files: each known, each once, and (a whole checkpoint) one per rank and
// the train state. Returns each file's index by name.
std::unordered_map<std::string, size_t> validate_files(const Metadata& m, const std::string& where,
                                                       Scope scope) {
  std::unordered_map<std::string, size_t> file_index;
  if (scope == Scope::OneRank) {
    ST_CHECK(m.files.size() == 1 && m.files[0].rank >= 0 && m.files[0].name == rank_file_name(m.files[0].rank),
             CheckpointError, where, " must list exactly its own rank file");
  }
  std::vector<bool> rank_seen(scope == Scope::Checkpoint ? static_cast<size_t>(m.world_size) : 0, false);
  for (size_t i = 0; i < m.files.size(); ++i) {
    const FileInfo& f = m.files[i];
    validate_file(f, where);
    const std::string fw = where + " file '" + cut(f.name) + "'";
    if (scope == Scope::Checkpoint && f.rank >= 0) {
      ST_CHECK(f.rank < m.world_size && f.name == rank_file_name(f.rank), CheckpointError, fw,
               " does not belong to a rank of a world of ", m.world_size);
      rank_seen[static_cast<size_t>(f.rank)] = true;
    } else if (scope == Scope::Checkpoint) {
      ST_CHECK(f.name == kTrainStateFile, CheckpointError, fw, " is not a known file");
    }
    ST_CHECK(file_index.emplace(f.name, i).second, CheckpointError, where, " lists file '", f.name,
             "' twice");
  }
  if (scope == Scope::Checkpoint) {
    for (int r = 0; r < m.world_size; ++r) {
      ST_CHECK(rank_seen[static_cast<size_t>(r)], CheckpointError, where, " lists no file for rank ",
               r, " of ", m.world_size);
    }
    ST_CHECK(file_index.count(kTrainStateFile), CheckpointError, where, " lists no ",
             kTrainStateFile);
  }
  return file_index;
}

// Each slice of tensor t (numel elements of esize bytes): in a rank file of
// that rank, inside the tensor and inside the file.
void validate_slices(const Metadata& m, const TensorInfo& t, const std::string& tw, int64_t numel,
                     int64_t esize, const std::unordered_map<std::string, size_t>& file_index, Scope scope) {
  for (const SliceInfo& s : t.slices) {
    if (scope == Scope::Checkpoint) {
      ST_CHECK(s.rank < m.world_size, CheckpointError, tw, ": 'rank' is ", s.rank,
               "; expected a whole number in 0..", m.world_size - 1,
               ". Hint: the metadata is damaged or not shardtrain's.");
    }
    auto it = file_index.find(s.file);
    ST_CHECK(it != file_index.end() && m.files[it->second].rank >= 0, CheckpointError, tw,
             " is stored in unknown file '", s.file, "'");
    const FileInfo& f = m.files[it->second];
    ST_CHECK(f.rank == s.rank, CheckpointError, tw, " has a slice of rank ", s.rank,
             " in rank ", f.rank, "'s file '", s.file, "'");
    ST_CHECK(s.offset <= numel - s.count, CheckpointError, tw, " has a slice [", s.offset,
             ", +", s.count, ") outside its ", numel, " elements");
    ST_CHECK(s.count <= f.bytes / esize && s.byte_offset <= f.bytes - s.count * esize,
             CheckpointError, tw, " has a slice outside its file '", s.file, "'");
  }
}

// Every element stored exactly once, as a save writes them: slices
// sorted by offset tile [0, numel). A tensor without (all of) its data
// would load as garbage or fail late; it is refused here, for load and
// inspect alike. (Empty slices are never written.)
void validate_tiling(TensorInfo& t, const std::string& tw, int64_t numel) {
  std::sort(t.slices.begin(), t.slices.end(),
            [](const SliceInfo& a, const SliceInfo& b) { return a.offset < b.offset; });
  int64_t next = 0;
  for (const auto& x : t.slices) {
    ST_CHECK(x.count > 0, CheckpointError, tw, " has an empty slice on rank ", x.rank);
    ST_CHECK(x.offset >= next, CheckpointError, tw, " has overlapping slices (rank ", x.rank,
             " starts at element ", x.offset, ", before ", next, ")");
    ST_CHECK(x.offset == next, CheckpointError, tw, " stores no data for elements ", next, "..",
             x.offset - 1, " of ", numel, ". Hint: the metadata is damaged; load an older checkpoint.");
    next = x.offset + x.count;
  }
  ST_CHECK(next == numel, CheckpointError, tw, " stores no data for elements ", next, "..",
           numel - 1, " of ", numel,
           next == 0 ? " (no data at all)" : "", ". Hint: the metadata is damaged; load an older "
           "checkpoint.");
}

void validate(Metadata& m, const std::string& where, Scope scope) {
  const std::unordered_map<std::string, size_t> file_index = validate_files(m, where, scope);
  std::set<std::string> names;
  for (TensorInfo& t : m.tensors) {
    const std::string tw = where + " tensor '" + cut(t.name) + "'";
    ST_CHECK(names.insert(t.name).second, CheckpointError, where, " lists tensor '", t.name,
             "' twice");
    const int64_t esize = dtype_bytes(t.dtype);
    ST_CHECK(esize > 0, CheckpointError, tw, " has unknown dtype '", cut(t.dtype), "'");
    int64_t numel = 1;
    for (int64_t d : t.shape) {
      ST_CHECK(d >= 0 && !mul_overflows(numel, d, &numel), CheckpointError, tw,
               " has an impossible shape");
    }
    int64_t total_bytes = 0;
    ST_CHECK(!mul_overflows(numel, esize, &total_bytes), CheckpointError, tw, " is too large");
    validate_slices(m, t, tw, numel, esize, file_index, scope);
    if (scope == Scope::OneRank) continue;
    validate_tiling(t, tw, numel);
  }
}

}  // namespace

std::string metadata_to_json(const Metadata& m) { return to_json(m).dump(1) + "\n"; }

Metadata metadata_from_json(const std::string& text, const std::string& path) {
  Json j;
  std::string problem;
  ST_CHECK(::shardtrain::detail::parse_json(text, &j, &problem), CheckpointError, "'", path,
           "' is not valid JSON (", problem,
           "). Hint: it is not a shardtrain checkpoint's metadata, or it is damaged.");
  const std::string where = "'" + path + "'";
  Metadata m = metadata_from_json_value(j, where);
  validate(m, where, Scope::Checkpoint);
  return m;
}

// One rank's result travels to rank 0 in the metadata's own format (one file,
// that rank's slices), read back through the same from_json and validate().
std::string rank_result_to_bytes(const RankResult& r) {
  Json j;
  j["rank"] = r.rank;
  j["error"] = r.error;
  Metadata m;
  m.files.push_back(r.file);
  m.tensors = r.tensors;
  j["metadata"] = to_json(m);
  return j.dump();
}

RankResult rank_result_from_bytes(const std::string& bytes) {
  Json j;
  std::string problem;
  ST_CHECK(::shardtrain::detail::parse_json(bytes, &j, &problem), CheckpointError,
           "a rank's save result is not valid JSON (", problem, ")");
  const std::string where = "a rank's save result";
  RankResult r;
  r.rank = static_cast<int>(get_int(j, "rank", where, 0, kMaxInt));
  r.error = get<std::string>(j, "error", where);
  if (!r.error.empty()) return r;
  ST_CHECK(j.contains("metadata"), CheckpointError, where, " has no 'metadata'");
  Metadata m = metadata_from_json_value(j.at("metadata"), "rank " + std::to_string(r.rank) + "'s save result");
  validate(m, "rank " + std::to_string(r.rank) + "'s save result", Scope::OneRank);
  r.file = std::move(m.files.at(0));
  r.tensors = std::move(m.tensors);
  return r;
}

}  // namespace detail
}  // namespace shardtrain::checkpoint
