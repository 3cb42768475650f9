// Sharded checkpoints: every rank writes its own file, rank 0 writes the
// metadata, and any world size and strategy can load the result.
//
// On disk (docs/checkpoints.md has the byte-level format):
//
//   <run_dir>/checkpoints/step-000120/
//     rank-00000.bin ... rank-NNNNN.bin   each rank's primary slices, raw
//                                         little-endian, then its rank state
//     train_state.bin                     rank 0's opaque training state
//     metadata.json                       format version, world size,
//                                         strategy, every tensor's name,
//                                         global shape, dtype and slices, and
//                                         every file's size and CRC32C
//     COMMITTED                           written last: the checkpoint is
//                                         complete only once it exists
//
// Saving (save_sharded, a collective) writes everything into
// `step-000120.tmp/`, fsyncs files and directories, renames the directory,
// waits for every rank (a barrier), then writes COMMITTED. A crash at any
// point leaves either the previous complete checkpoints untouched or a
// directory without the marker, which loading ignores and prune() deletes.
//
// Loading (load_sharded, a collective) lets each rank ask for any slice of
// any tensor; it preads only the stored byte ranges that overlap it and
// verifies their checksums. Every rank throws the same way when any rank
// fails, so a bad checkpoint never leaves ranks out of step.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "shardtrain/core/options.h"
#include "shardtrain/strategy/strategy.h"

namespace shardtrain::comm {
class Communicator;
}

namespace shardtrain::checkpoint {

using strategy::ShardedTensor;

/// The on-disk format version this build writes; it reads this one only.
constexpr int kFormatVersion = 1;

// ---- metadata -------------------------------------------------------------------

/// One stored run of a tensor's row-major elements.
struct SliceInfo {
  /// The rank that wrote it, and the file (relative to the checkpoint dir).
  int rank = 0;
  std::string file;
  /// First element (row-major index into the whole tensor) and element count.
  int64_t offset = 0;
  int64_t count = 0;
  /// Where the first element's bytes start in `file`.
  int64_t byte_offset = 0;
};

/// A tensor of the checkpoint: parameters, buffers and optimizer state alike.
struct TensorInfo {
  std::string name;
  std::vector<int64_t> shape;
  /// safetensors dtype names: "F32", "F64", "BF16", "F16", "I64", "I32",
  /// "I16", "I8", "U8", "BOOL".
  std::string dtype;
  /// "parameter", "buffer" or "optimizer" (names starting with "optim.").
  std::string kind;
  /// Sorted by offset, disjoint, together covering every element once.
  std::vector<SliceInfo> slices;

  int64_t numel() const;
};

/// A file of the checkpoint with its checksums.
struct FileInfo {
  /// Relative to the checkpoint dir: "rank-00003.bin" or "train_state.bin".
  std::string name;
  /// The rank whose file it is; -1 for train_state.bin.
  int rank = -1;
  int64_t bytes = 0;
  /// CRC32C of the whole file, and of each `chunk_bytes` piece of it (the
  /// last one shorter): loading verifies the pieces it reads.
  uint32_t crc32c = 0;
  int64_t chunk_bytes = 0;
  std::vector<uint32_t> chunk_crc32c;
  /// Where the rank's own state blob sits in a rank file (bytes 0: none).
  int64_t rank_state_offset = 0;
  int64_t rank_state_bytes = 0;
};

/// What metadata.json says.
struct Metadata {
  int format_version = kFormatVersion;
  int world_size = 1;
  /// Strategy::name() of the job that wrote it, e.g. "fsdp/full_shard".
  std::string strategy;
  /// The training step, or -1 when the writer did not say.
  int64_t step = -1;
  std::vector<TensorInfo> tensors;
  std::vector<FileInfo> files;

  /// The tensor called `name`, or null.
  const TensorInfo* find_tensor(const std::string& name) const;
  /// The file called `name`, or null.
  const FileInfo* find_file(const std::string& name) const;
};

// ---- saving ----------------------------------------------------------------------

struct SaveOptions {
  /// Recorded in the metadata; the loading job may use any other strategy.
  ST_ARG(std::string, strategy) = "";
  /// Recorded in the metadata (and shown by `shardtrain checkpoint inspect`);
  /// -1 records none.
  ST_ARG(int64_t, step) = -1;
  /// Files are checksummed in pieces of this many bytes, so a load that reads
  /// part of a file verifies only what it reads (at most two extra partial
  /// pieces per stored slice). Small values exercise multi-piece paths in tests.
  ST_ARG(int64_t, checksum_chunk_bytes) = int64_t{1} << 20;
};

/// Collective: every rank of `comm` calls it with the same `dir`, which must
/// be on a filesystem all ranks see. Writes `tensors` entries whose
/// `primary` is true (parameters, buffers and optimizer_state() entries),
/// `train_state` (taken from rank 0 only; an opaque blob) and `rank_state`
/// (this rank's own blob, e.g. its RNG state). `dir` must not exist yet, or
/// be a previous checkpoint, which is replaced only once this one is
/// written. Returns `dir`. Throws CheckpointError on every rank when any
/// rank fails (I/O error, ranks disagreeing on a tensor's shape or dtype,
/// elements that no rank holds as primary, or two ranks holding the same).
std::string save_sharded(const std::string& dir, comm::Communicator& comm,
                         const std::vector<ShardedTensor>& tensors, const std::string& train_state,
                         const std::string& rank_state, const SaveOptions& options = {});

// ---- loading ---------------------------------------------------------------------

struct LoadOptions {
  /// true: every parameter and buffer the checkpoint holds must be asked for
  /// by some rank (one all-reduce), so a model with fewer layers than the
  /// checkpoint is an error rather than a partial load. Optimizer entries
  /// are never required.
  ST_ARG(bool, strict) = true;
};

/// What load_sharded returns besides filling the targets.
struct LoadResult {
  /// Rank 0's training state blob (every rank gets it).
  std::string train_state;
  /// This rank's own blob from the saving job when the world size is the
  /// same (rank_state_restored true); empty otherwise.
  std::string rank_state;
  bool rank_state_restored = false;
  Metadata metadata;
};

/// Collective: every rank of `comm` calls it. Fills each target's `local`
/// with elements [offset, offset + local.numel()) of the stored tensor
/// called `name` (converting the dtype when it differs), reading only the
/// stored byte ranges that overlap and verifying their checksums. Targets
/// may be whole tensors or 1-D runs, any slicing, on any world size.
///
/// Throws CheckpointError on every rank if any rank fails: `dir` is not a
/// complete checkpoint, a target's name is missing or its global shape
/// differs (names listed), a file is missing, truncated or fails its
/// checksum (file named), or (strict) the checkpoint holds parameters no
/// rank asked for. Names and shapes are checked before any byte is read;
/// after a checksum error the targets may be partly overwritten.
/// Call strategy->reload_parameters() afterwards.
LoadResult load_sharded(const std::string& dir, comm::Communicator& comm,
                        std::vector<ShardedTensor>& targets, const LoadOptions& options = {});

/// Reads one complete checkpoint without any communication: the building
/// block of load_sharded, `shardtrain checkpoint`, and single-process tools.
class CheckpointReader {
 public:
  /// Opens `dir`: requires the COMMITTED marker, checks metadata.json
  /// against the checksum the marker records, validates it, and checks that
  /// every file it lists exists with its recorded size (unless
  /// `check_files` is false: `inspect` reports damaged files through
  /// verify_all() instead). CheckpointError (naming the file) otherwise.
  explicit CheckpointReader(const std::string& dir, bool check_files = true);
  ~CheckpointReader();
  CheckpointReader(const CheckpointReader&) = delete;
  CheckpointReader& operator=(const CheckpointReader&) = delete;

  const std::string& dir() const;
  const Metadata& metadata() const;

  /// Checks names, shapes and coverage of `targets` without reading data;
  /// throws one CheckpointError listing every problem.
  void check(const std::vector<ShardedTensor>& targets) const;
  /// check(), then fills every target (see load_sharded).
  void read(std::vector<ShardedTensor>& targets);
  /// Elements [offset, offset + count) of tensor `name` as a 1-D tensor of
  /// the stored dtype.
  at::Tensor read_range(const std::string& name, int64_t offset, int64_t count);
  /// The whole tensor `name` in its stored shape and dtype.
  at::Tensor read_tensor(const std::string& name);

  /// train_state.bin (verified).
  std::string train_state();
  /// The blob rank `rank` of the saving job wrote (verified); empty if none.
  std::string rank_state(int rank);

  /// Reads every file in full and compares every checksum. Returns one line
  /// per file: "" when it is intact, else what is wrong with it.
  std::vector<std::string> verify_all();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Reads and validates `dir`/metadata.json of a complete checkpoint.
Metadata read_metadata(const std::string& dir);

// ---- run directories and retention -------------------------------------------------
//
// A run directory (config run.dir) holds one thing per name:
//
//   <run_dir>/metrics.jsonl
//   <run_dir>/checkpoints/step-000120/   sharded checkpoints (above)
//   <run_dir>/model.safetensors          the final model (Trainer::export_model):
//                                        Hugging Face GPT-2 names, Conv1D
//                                        weights as [in, out]; step in its
//                                        metadata
//   <run_dir>/config.yaml                the config of that model

/// A complete checkpoint of a run directory.
struct CheckpointEntry {
  std::string path;
  int64_t step = 0;
};

/// `<run_dir>/checkpoints`.
std::string checkpoints_root(const std::string& run_dir);
/// `<run_dir>/checkpoints/step-000120` (at least six digits).
std::string checkpoint_dir(const std::string& run_dir, int64_t step);
/// Whether `dir` carries the COMMITTED marker (nothing else is read).
bool is_complete(const std::string& dir);
/// The complete checkpoints under `<run_dir>/checkpoints`, newest (largest
/// step) first. Torn, temporary and foreign entries are skipped.
std::vector<CheckpointEntry> list_complete(const std::string& run_dir);
/// The newest complete checkpoint, if any.
std::optional<CheckpointEntry> latest_complete(const std::string& run_dir);
/// Deletes all but the `keep` newest complete checkpoints, except those
/// whose paths are in `protect` (e.g. the best one), and every torn or
/// temporary `step-*` directory. Other entries are never touched. Returns
/// the deleted paths. Call it on one rank, when no save is in progress in
/// this run directory. A checkpoint loses its COMMITTED marker first, so a
/// crash while deleting never leaves a "complete" checkpoint with missing
/// files.
std::vector<std::string> prune(const std::string& run_dir, int keep,
                               const std::vector<std::string>& protect = {});

/// `<run_dir>/model.safetensors`: a link to the single weights file of
/// exported_model_dir() (absent when the export is sharded).
std::string exported_model_path(const std::string& run_dir);
/// `<run_dir>/model`: the exported model as a Hugging Face directory.
std::string exported_model_dir(const std::string& run_dir);
/// `<run_dir>/config.yaml`, the config of the exported model.
std::string exported_config_path(const std::string& run_dir);

/// What resolve_checkpoint found.
struct ResolvedCheckpoint {
  enum class Kind {
    /// A complete checkpoint directory.
    Checkpoint,
    /// A run's exported model.safetensors (config.yaml beside it).
    ExportedModel,
  };
  Kind kind = Kind::Checkpoint;
  /// The checkpoint directory or the safetensors file.
  std::string path;
  /// The training step it holds; -1 when not recorded.
  int64_t step = -1;
};

struct ResolveOptions {
  /// Also accept an exported model: a run directory's model.safetensors, or
  /// a .safetensors file named directly (what `shardtrain generate` reads).
  ST_ARG(bool, exported_model) = false;
};

/// What `path` names, for tools that take "a checkpoint or a run directory"
/// (`shardtrain checkpoint`, `shardtrain generate`):
///   - a complete checkpoint directory (COMMITTED marker): itself;
///   - a run directory: its newest complete checkpoint (torn and temporary
///     ones skipped); with exported_model, its model.safetensors instead when
///     that holds at least as late a step (or there is no checkpoint);
///   - with exported_model, a .safetensors file: itself.
/// Reads no more than the metadata's step. Throws CheckpointError saying
/// what was expected when `path` does not exist, is a checkpoint whose save
/// did not finish, is another file, or is a directory holding neither.
ResolvedCheckpoint resolve_checkpoint(const std::string& path, const ResolveOptions& options = {});

}  // namespace shardtrain::checkpoint
