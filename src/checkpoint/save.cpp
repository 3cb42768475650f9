// Saving: each rank writes its file into <dir>.tmp, rank 0 merges what every
// rank wrote into metadata.json, renames the directory, and after a barrier
// writes the COMMITTED marker.
//
// Why this order: every file is fsynced before the metadata that describes
// it exists, the metadata and the directory before the rename, and the
// marker last, so after a crash at any point a directory with COMMITTED
// holds exactly what its metadata says. Every collective below runs on every
// rank whatever happened locally (a failed rank sends its error instead of
// its entries), so no rank is left waiting in a collective.
#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <set>

#include "checkpoint/detail.h"
#include "shardtrain/comm/communicator.h"
#include "shardtrain/core/error.h"

namespace shardtrain::checkpoint {

namespace detail {

namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;

std::string rank_file_name(int rank) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "rank-%05d.bin", rank);
  return buf;
}

namespace {

// "run/checkpoints/step-000120/" -> "run/checkpoints/step-000120".
std::string normal_dir(const std::string& dir) {
  std::string s = fs::path(dir).lexically_normal().string();
  while (s.size() > 1 && s.back() == '/') s.pop_back();
  return s;
}

}  // namespace

std::string temporary_dir(const std::string& dir) { return normal_dir(dir) + ".tmp"; }

namespace {

std::string previous_dir(const std::string& dir) { return normal_dir(dir) + ".old"; }

// The marker holds the metadata's length and checksum, so a reader knows the
// metadata it parses is the one that was committed.
std::string marker_text(const std::string& metadata_text) {
  Json j;
  j["format"] = "shardtrain-checkpoint";
  j["format_version"] = kFormatVersion;
  j["metadata_bytes"] = metadata_text.size();
  j["metadata_crc32c"] = crc32c(0, metadata_text.data(), metadata_text.size());
  return j.dump() + "\n";
}

void remove_tree(const std::string& dir) {
  std::error_code ec;
  fs::remove(fs::path(dir) / kCommitFile, ec);  // never a "complete" half-deleted dir
  fs::remove_all(dir, ec);
}

}  // namespace

void undo_failed_save(const std::string& dir) {
  const std::string final_dir = normal_dir(dir);
  std::error_code ec;
  fs::remove_all(temporary_dir(final_dir), ec);
  // Renamed into place but never committed (the marker could not be
  // written): torn, so it goes, and a previous complete checkpoint of the
  // same name that was moved aside comes back.
  if (fs::exists(final_dir, ec) && !is_complete(final_dir)) remove_tree(final_dir);
  const std::string old = previous_dir(final_dir);
  if (fs::exists(old, ec) && !fs::exists(final_dir, ec)) fs::rename(old, final_dir, ec);
}

// rank_result_to_bytes / rank_result_from_bytes live with the metadata format
// (metadata.cpp): one writer, one validating reader.

RankResult write_rank_file(const std::string& tmp_dir, int rank, int world_size,
                           const std::vector<ShardedTensor>& tensors,
                           const std::string& rank_state, int64_t chunk_bytes) {
  RankResult result;
  result.rank = rank;
  const std::string name = rank_file_name(rank);
  OutFile out((fs::path(tmp_dir) / name).string(), chunk_bytes);

  // Header: magic, format version, rank, world size, header size; the rest
  // of the 64 bytes is zero.
  unsigned char header[kRankHeaderBytes] = {};
  std::memcpy(header, kRankMagic, sizeof(kRankMagic));
  const uint32_t fields[4] = {static_cast<uint32_t>(kFormatVersion), static_cast<uint32_t>(rank),
                              static_cast<uint32_t>(world_size),
                              static_cast<uint32_t>(kRankHeaderBytes)};
  std::memcpy(header + 8, fields, sizeof(fields));
  out.write(header, sizeof(header));

  std::set<std::string> names;
  for (const auto& t : tensors) {
    ST_CHECK(t.local.defined(), InvalidArgument, "checkpoint entry '", t.name,
             "' has no local tensor");
    ST_CHECK(names.insert(t.name).second, InvalidArgument, "checkpoint entry '", t.name,
             "' appears twice on rank ", rank);
    TensorInfo info;
    info.name = t.name;
    info.shape = t.global_shape;
    info.dtype = dtype_name(t.local.scalar_type());
    info.kind = tensor_kind(t);
    if (!t.primary) {
      // Described but not stored: rank 0 then checks that replicas agree on
      // shape and dtype, and that someone holds every element as primary.
      result.tensors.push_back(std::move(info));
      continue;
    }
    // A tensor-parallel block is stored as the runs of the whole tensor it
    // covers, so the file records global offsets whatever the layout.
    const at::Tensor data = t.local.detach().to(at::kCPU).contiguous().view({-1});
    for (const auto& run : strategy::chunk_runs(t.global_shape, t.chunk, t.offset, data.numel())) {
      out.pad_to(kDataAlignment);
      SliceInfo s;
      s.rank = rank;
      s.file = name;
      s.offset = run.global;
      s.count = run.count;
      s.byte_offset = out.bytes();
      const at::Tensor part = data.narrow(0, run.local, run.count);
      out.write(part.data_ptr(), static_cast<size_t>(part.nbytes()));
      info.slices.push_back(std::move(s));
    }
    if (info.slices.empty()) {  // an empty piece still says who held it
      out.pad_to(kDataAlignment);
      SliceInfo s;
      s.rank = rank;
      s.file = name;
      s.offset = t.offset;
      s.byte_offset = out.bytes();
      info.slices.push_back(std::move(s));
    }
    result.tensors.push_back(std::move(info));
  }
  out.pad_to(kDataAlignment);
  const int64_t state_offset = out.bytes();
  out.write(rank_state.data(), rank_state.size());
  result.file = out.close_and_sync();
  result.file.rank = rank;
  result.file.rank_state_offset = rank_state.empty() ? 0 : state_offset;
  result.file.rank_state_bytes = static_cast<int64_t>(rank_state.size());
  return result;
}

Metadata merge_rank_results(const std::vector<RankResult>& results, const SaveOptions& options) {
  for (const auto& r : results) {
    ST_CHECK(r.error.empty(), CheckpointError, "rank ", r.rank, " could not write its part: ",
             r.error);
  }
  Metadata m;
  m.world_size = static_cast<int>(results.size());
  m.strategy = options.strategy();
  m.step = options.step();
  std::map<std::string, size_t> index;
  for (const auto& r : results) {
    m.files.push_back(r.file);
    for (const auto& t : r.tensors) {
      auto it = index.find(t.name);
      if (it == index.end()) {
        index.emplace(t.name, m.tensors.size());
        m.tensors.push_back(t);
        continue;
      }
      TensorInfo& merged = m.tensors[it->second];
      ST_CHECK(merged.shape == t.shape && merged.dtype == t.dtype, CheckpointError, "tensor '",
               t.name, "' has shape ", c10::IntArrayRef(t.shape), " ", t.dtype, " on rank ",
               r.rank, " but ", c10::IntArrayRef(merged.shape), " ", merged.dtype,
               " on a lower rank; every rank must describe the same model");
      merged.slices.insert(merged.slices.end(), t.slices.begin(), t.slices.end());
    }
  }
  // Each element stored exactly once: slices sorted by offset must tile the
  // tensor. Empty slices are dropped (they hold nothing).
  for (auto& t : m.tensors) {
    auto& s = t.slices;
    s.erase(std::remove_if(s.begin(), s.end(), [](const SliceInfo& x) { return x.count == 0; }),
            s.end());
    std::sort(s.begin(), s.end(),
              [](const SliceInfo& a, const SliceInfo& b) { return a.offset < b.offset; });
    int64_t next = 0;
    for (const auto& x : s) {
      ST_CHECK(x.offset >= next, CheckpointError, "elements ", x.offset, "..",
               std::min(next, x.offset + x.count) - 1, " of tensor '", t.name,
               "' are primary on two ranks (", x.rank,
               " and another); exactly one rank must hold each element with primary = true");
      ST_CHECK(x.offset == next, CheckpointError, "elements ", next, "..", x.offset - 1,
               " of tensor '", t.name,
               "' are primary on no rank; exactly one rank must hold each element with "
               "primary = true");
      next = x.offset + x.count;
    }
    ST_CHECK(next == t.numel(), CheckpointError, "elements ", next, "..", t.numel() - 1,
             " of tensor '", t.name,
             "' are primary on no rank; exactly one rank must hold each element with "
             "primary = true");
  }
  return m;
}

std::string finish_on_rank0(const std::string& tmp_dir, const std::string& dir, Metadata metadata,
                            const std::string& train_state, int64_t chunk_bytes) {
  {
    OutFile f((fs::path(tmp_dir) / kTrainStateFile).string(), chunk_bytes);
    f.write(train_state.data(), train_state.size());
    FileInfo info = f.close_and_sync();
    info.rank = -1;
    metadata.files.push_back(std::move(info));
  }
  const std::string text = metadata_to_json(metadata);
  write_file_atomically((fs::path(tmp_dir) / kMetadataFile).string(), text);
  fsync_dir(tmp_dir);

  // A previous complete checkpoint of the same name is moved aside, marker
  // and all, and deleted only once the new one is committed; until then
  // list_complete() offers the aside copy (step-N.old) in its place. A torn
  // directory of that name is simply replaced.
  const std::string final_dir = normal_dir(dir);
  const std::string old = previous_dir(final_dir);
  std::error_code ec;
  bool moved_aside = false;
  if (fs::exists(final_dir)) {
    if (is_complete(final_dir)) {
      remove_tree(old);
      fs::rename(final_dir, old, ec);
      ST_CHECK(!ec, CheckpointError, "cannot move the previous checkpoint '", final_dir, "' aside: ",
               ec.message());
      moved_aside = true;
    } else {
      remove_tree(final_dir);
    }
  }
  fs::rename(tmp_dir, final_dir, ec);
  if (ec && moved_aside) {
    std::error_code back;
    fs::rename(old, final_dir, back);  // the previous checkpoint stays the current one
  }
  ST_CHECK(!ec, CheckpointError, "cannot rename '", tmp_dir, "' to '", final_dir, "': ",
           ec.message());
  fsync_dir(fs::path(final_dir).parent_path().string());
  return text;
}

void commit(const std::string& dir, const std::string& metadata_text) {
  write_file_atomically((fs::path(dir) / kCommitFile).string(), marker_text(metadata_text));
  const std::string old = previous_dir(dir);
  if (fs::exists(old)) remove_tree(old);
}

namespace {

void prepare_tmp(const std::string& tmp) {
  std::error_code ec;
  fs::remove_all(tmp, ec);  // a torn attempt at the same step
  fs::create_directories(tmp, ec);
  ST_CHECK(!ec, CheckpointError, "cannot create '", tmp, "': ", ec.message(),
           ". Hint: check that the run directory is writable.");
}

}  // namespace

std::string save_ranks_locally(const std::string& dir,
                               const std::vector<std::vector<ShardedTensor>>& per_rank,
                               const std::string& train_state,
                               const std::vector<std::string>& rank_states,
                               const SaveOptions& options) {
  ST_CHECK(!per_rank.empty() && (rank_states.empty() || rank_states.size() == per_rank.size()),
           InvalidArgument, "save_ranks_locally needs one tensor list (and rank state) per rank");
  ST_CHECK(options.checksum_chunk_bytes() >= 1 && options.checksum_chunk_bytes() <= (1 << 30),
           InvalidArgument, "checksum_chunk_bytes must be in 1 .. 2^30, got ",
           options.checksum_chunk_bytes());
  const std::string final_dir = normal_dir(dir);
  const std::string tmp = temporary_dir(final_dir);
  try {
    prepare_tmp(tmp);
    const int world = static_cast<int>(per_rank.size());
    std::vector<RankResult> results;
    for (int r = 0; r < world; ++r) {
      results.push_back(write_rank_file(tmp, r, world, per_rank[static_cast<size_t>(r)],
                                        rank_states.empty() ? std::string() : rank_states[r],
                                        options.checksum_chunk_bytes()));
    }
    Metadata m = merge_rank_results(results, options);
    const std::string text =
        finish_on_rank0(tmp, final_dir, std::move(m), train_state, options.checksum_chunk_bytes());
    commit(final_dir, text);
  } catch (...) {
    undo_failed_save(final_dir);
    throw;
  }
  return final_dir;
}

// ---- bytes through the communicator (it moves numeric tensors only) ----------------

std::vector<std::string> all_gather_strings(comm::Communicator& comm, const std::string& mine) {
  const int n = comm.size();
  auto len = at::full({1}, static_cast<int64_t>(mine.size()), at::kLong);
  auto lens = at::zeros({n}, at::kLong);
  comm.all_gather(len, lens);
  int64_t max_len = 0;
  for (int r = 0; r < n; ++r) max_len = std::max(max_len, lens[r].item<int64_t>());
  const int64_t words = (max_len + 3) / 4;
  auto buf = at::zeros({words}, at::kInt);
  std::memcpy(buf.data_ptr(), mine.data(), mine.size());
  auto all = at::zeros({words * n}, at::kInt);
  comm.all_gather(buf, all);
  std::vector<std::string> out;
  const char* base = static_cast<const char*>(all.data_ptr());
  for (int r = 0; r < n; ++r) {
    out.emplace_back(base + r * words * 4, static_cast<size_t>(lens[r].item<int64_t>()));
  }
  return out;
}

namespace {

std::string broadcast_string(comm::Communicator& comm, const std::string& s, int root) {
  auto len = at::full({1}, static_cast<int64_t>(s.size()), at::kLong);
  comm.broadcast(len, comm::BroadcastOptions().root(root));
  const int64_t n = len.item<int64_t>();
  if (n == 0) return {};
  auto buf = at::zeros({(n + 3) / 4}, at::kInt);
  if (comm.rank() == root) std::memcpy(buf.data_ptr(), s.data(), s.size());
  comm.broadcast(buf, comm::BroadcastOptions().root(root));
  return std::string(static_cast<const char*>(buf.data_ptr()), static_cast<size_t>(n));
}

// Without a backtrace: the text travels to every rank and into one line.
std::string what_of(const std::exception& e) { return ::shardtrain::detail::one_line_message(e); }

}  // namespace

std::string agree_on_error(comm::Communicator& comm, const std::string& local_error) {
  const int n = comm.size();
  auto first = at::full({1}, local_error.empty() ? n : comm.rank(), at::kInt);
  comm.all_reduce(first, comm::AllReduceOptions().op(comm::ReduceOp::Min));
  const int bad = first.item<int>();
  if (bad >= n) return {};
  const std::string msg = broadcast_string(comm, local_error, bad);
  return n == 1 ? msg : "rank " + std::to_string(bad) + ": " + msg;
}

}  // namespace detail

std::string save_sharded(const std::string& dir, comm::Communicator& comm,
                         const std::vector<ShardedTensor>& tensors, const std::string& train_state,
                         const std::string& rank_state, const SaveOptions& options) {
  namespace fs = std::filesystem;
  using namespace detail;
  ST_CHECK(options.checksum_chunk_bytes() >= 1 && options.checksum_chunk_bytes() <= (1 << 30),
           InvalidArgument, "checksum_chunk_bytes must be in 1 .. 2^30, got ",
           options.checksum_chunk_bytes());
  const std::string final_dir = normal_dir(dir);
  const std::string tmp = temporary_dir(final_dir);
  const int rank = comm.rank();

  // 1. Rank 0 makes a fresh temporary directory; nobody writes before that.
  std::string error;
  if (rank == 0) {
    try {
      prepare_tmp(tmp);
    } catch (const std::exception& e) {
      error = what_of(e);
    }
  }
  error = agree_on_error(comm, error);
  if (!error.empty() && rank == 0) undo_failed_save(final_dir);
  ST_CHECK(error.empty(), CheckpointError, "saving '", final_dir, "' failed: ", error);

  // 2. Every rank writes and fsyncs its own file.
  RankResult mine;
  mine.rank = rank;
  try {
    mine = write_rank_file(tmp, rank, comm.size(), tensors, rank_state,
                           options.checksum_chunk_bytes());
  } catch (const std::exception& e) {
    mine = RankResult();
    mine.rank = rank;
    mine.error = what_of(e);
  }

  // 3. Rank 0 learns what every rank wrote (all files are durable by now),
  //    writes the metadata and renames the directory into place.
  const std::vector<std::string> gathered = all_gather_strings(comm, rank_result_to_bytes(mine));
  std::string metadata_text;
  if (rank == 0) {
    try {
      std::vector<RankResult> results;
      for (const auto& g : gathered) results.push_back(rank_result_from_bytes(g));
      Metadata m = merge_rank_results(results, options);
      metadata_text =
          finish_on_rank0(tmp, final_dir, std::move(m), train_state, options.checksum_chunk_bytes());
    } catch (const std::exception& e) {
      error = what_of(e);
    }
  }

  // 4. After a barrier, the marker, written last.
  comm.barrier();
  if (rank == 0 && error.empty()) {
    try {
      commit(final_dir, metadata_text);
    } catch (const std::exception& e) {
      error = what_of(e);
    }
  }
  error = agree_on_error(comm, error);
  if (!error.empty()) {
    if (rank == 0) undo_failed_save(final_dir);
    ST_CHECK(false, CheckpointError, "saving '", final_dir, "' failed: ", error,
             " Nothing of this save was kept; older checkpoints are untouched. Hint: free disk "
             "space under the run directory (checkpoint.keep limits how many are kept).");
  }
  return final_dir;
}

}  // namespace shardtrain::checkpoint
