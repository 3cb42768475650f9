// Internals of the checkpoint library: the checksum, raw file I/O, dtype
// names, and the per-rank steps of a save, which tests call directly to
// simulate several ranks in one process.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "shardtrain/checkpoint/checkpoint.h"

namespace shardtrain::checkpoint::detail {

// ---- CRC32C (Castagnoli) ------------------------------------------------------------

/// Updates `crc` (0 for an empty input) with `n` bytes: the standard
/// CRC-32C (crc32c("123456789") == 0xE3069283). Uses the SSE4.2 instruction
/// when the CPU has it, else the table-driven version below.
uint32_t crc32c(uint32_t crc, const void* data, size_t n);
/// The portable slicing-by-8 version (tests compare the two).
uint32_t crc32c_software(uint32_t crc, const void* data, size_t n);

/// CRC32C of a file being written, whole and per `chunk_bytes` piece.
class ChunkedCrc {
 public:
  explicit ChunkedCrc(int64_t chunk_bytes) : chunk_bytes_(chunk_bytes) {}
  void update(const void* data, size_t n);
  /// Closes the last partial piece; call once, after the last update.
  void finish();
  uint32_t file_crc() const { return file_crc_; }
  const std::vector<uint32_t>& chunk_crcs() const { return chunks_; }
  int64_t bytes() const { return bytes_; }

 private:
  int64_t chunk_bytes_;
  int64_t bytes_ = 0;
  int64_t in_chunk_ = 0;
  uint32_t file_crc_ = 0;
  uint32_t chunk_crc_ = 0;
  std::vector<uint32_t> chunks_;
};

// ---- files ----------------------------------------------------------------------------

/// A file written front to back, checksummed on the way. Errors (open,
/// write, fsync) are CheckpointErrors naming the path.
class OutFile {
 public:
  /// Creates or truncates `path`, a name inside a directory this writer
  /// made itself (a checkpoint's temporary directory); a symbolic link at
  /// `path` is refused, never followed.
  OutFile(std::string path, int64_t chunk_bytes);
  /// A new file beside `target`, under a name nobody holds yet
  /// (`target.tmp.<random>`), created with O_EXCL | O_NOFOLLOW: a file or a
  /// symbolic link planted at any name is never written through. Rename it
  /// over `target` once closed; a failure leaves `target` as it was.
  static std::unique_ptr<OutFile> beside(const std::string& target, int64_t chunk_bytes);
  ~OutFile();
  OutFile(const OutFile&) = delete;
  OutFile& operator=(const OutFile&) = delete;

  void write(const void* data, size_t n);
  /// Zero bytes up to the next multiple of `alignment`.
  void pad_to(int64_t alignment);
  int64_t bytes() const { return crc_.bytes(); }
  /// fsync and close; returns the file's record (name = base name).
  FileInfo close_and_sync();
  const std::string& path() const { return path_; }

 private:
  OutFile(std::string path, int64_t chunk_bytes, int fd);
  std::string path_;
  int fd_ = -1;
  ChunkedCrc crc_;
  int64_t chunk_bytes_;
};

/// fsyncs a directory, so renames and new entries in it are durable.
void fsync_dir(const std::string& dir);
/// Writes `bytes` to `path` through a new temporary beside it
/// (OutFile::beside), fsynced, then renamed over `path`.
void write_file_atomically(const std::string& path, const std::string& bytes);
/// The same for pieces written one after another (a header, then data).
void write_file_atomically(const std::string& path, const std::vector<std::pair<const void*, size_t>>& pieces);
/// `target.tmp.<12 random hex digits>`: a temporary name beside `target`
/// that the caller must create exclusively (O_EXCL, a hard link).
std::string temporary_name_beside(const std::string& target);
/// pread of exactly n bytes; CheckpointError naming `path` on a short read.
void pread_exact(int fd, void* buf, size_t n, int64_t offset, const std::string& path);
/// The whole (small) file; CheckpointError naming it when unreadable.
std::string read_small_file(const std::string& path, int64_t max_bytes);

/// Test hook: called after every block written to a checkpoint data file,
/// with the file's path and its size so far. Lets a test stop a writer
/// half-way (tests/unit/test_sharded_checkpoint.cpp). Null by default.
using WriteHook = std::function<void(const std::string& path, int64_t bytes)>;
void set_write_hook(WriteHook hook);

// ---- dtypes ----------------------------------------------------------------------------

/// "F32" for at::kFloat etc.; CheckpointError for types no format stores.
std::string dtype_name(at::ScalarType type);
/// The inverse; CheckpointError naming `what` for an unknown name.
at::ScalarType dtype_from_name(const std::string& name, const std::string& what);
/// Bytes per element of a known dtype name, 0 for an unknown one.
int64_t dtype_bytes(const std::string& name);

// ---- the steps of a save ----------------------------------------------------------------

constexpr char kMetadataFile[] = "metadata.json";
constexpr char kTrainStateFile[] = "train_state.bin";
constexpr char kCommitFile[] = "COMMITTED";
constexpr char kRankMagic[8] = {'S', 'H', 'R', 'D', 'C', 'K', 'P', 'T'};
constexpr int64_t kRankHeaderBytes = 64;
constexpr int64_t kDataAlignment = 64;

/// "rank-00003.bin".
std::string rank_file_name(int rank);
/// The directory a save of `dir` writes into before renaming: "<dir>.tmp".
std::string temporary_dir(const std::string& dir);

/// What one rank wrote: its file and one TensorInfo per entry (with one
/// slice when it is primary, none for a replica), or the error that stopped it.
struct RankResult {
  int rank = 0;
  std::string error;
  FileInfo file;
  std::vector<TensorInfo> tensors;
};
std::string rank_result_to_bytes(const RankResult& result);
RankResult rank_result_from_bytes(const std::string& bytes);

/// Writes and fsyncs `<tmp_dir>/rank-RRRRR.bin`: the header, the primary
/// entries of `tensors` (64-byte aligned), then `rank_state`.
RankResult write_rank_file(const std::string& tmp_dir, int rank, int world_size,
                           const std::vector<ShardedTensor>& tensors,
                           const std::string& rank_state, int64_t chunk_bytes);

/// Merges every rank's result into the metadata; CheckpointError when a rank
/// failed, ranks disagree on a tensor's shape or dtype, or a tensor's
/// elements are not each held exactly once.
Metadata merge_rank_results(const std::vector<RankResult>& results, const SaveOptions& options);

/// Rank 0's part after every rank file is durable: writes train_state.bin
/// and metadata.json into `tmp_dir`, fsyncs it, and renames it to `dir`
/// (moving a previous checkpoint of that name aside first). Returns the
/// metadata's text, whose checksum the commit marker records.
std::string finish_on_rank0(const std::string& tmp_dir, const std::string& dir, Metadata metadata,
                            const std::string& train_state, int64_t chunk_bytes);
/// After a failed save of `dir`: removes its temporary directory and a
/// renamed but uncommitted `dir`, and puts back a previous complete
/// checkpoint of that name that was moved aside. Never throws.
void undo_failed_save(const std::string& dir);
/// Writes the COMMITTED marker for `metadata_text` into `dir`, durably, and
/// deletes a previous checkpoint that finish_on_rank0 moved aside.
void commit(const std::string& dir, const std::string& metadata_text);

/// The whole save in one process for `per_rank.size()` simulated ranks (tests
/// and single-process tools): the same files as save_sharded.
std::string save_ranks_locally(const std::string& dir,
                               const std::vector<std::vector<ShardedTensor>>& per_rank,
                               const std::string& train_state,
                               const std::vector<std::string>& rank_states,
                               const SaveOptions& options = {});

/// Collective: "" when `local_error` is empty on every rank, else the first
/// failing rank's error ("rank R: ..." when there are several ranks), the
/// same on every rank.
std::string agree_on_error(comm::Communicator& comm, const std::string& local_error);

/// Collective: every rank's string, indexed by rank.
std::vector<std::string> all_gather_strings(comm::Communicator& comm, const std::string& mine);

// ---- metadata text -----------------------------------------------------------------------

std::string metadata_to_json(const Metadata& metadata);
/// Parses and validates; CheckpointError naming `path` when malformed.
Metadata metadata_from_json(const std::string& text, const std::string& path);
/// "parameter", "buffer" or "optimizer".
std::string tensor_kind(const ShardedTensor& tensor);

}  // namespace shardtrain::checkpoint::detail
