// resolve_checkpoint: from "a checkpoint or a run directory" to the one thing
// a tool reads, with an error that says what was expected.
#include <cstdlib>
#include <filesystem>

#include "checkpoint/detail.h"
#include "shardtrain/checkpoint/safetensors.h"
#include "shardtrain/core/error.h"

namespace shardtrain::checkpoint {

namespace fs = std::filesystem;

namespace {

// The step an exported model records in its metadata; -1 when it records none.
int64_t exported_step(const std::string& file) {
  const SafetensorsFile f(file);
  const auto it = f.metadata().find("step");
  if (it == f.metadata().end()) return -1;
  char* end = nullptr;
  const long long step = std::strtoll(it->second.c_str(), &end, 10);
  return end != it->second.c_str() && *end == '\0' && step >= 0 ? step : -1;
}

}  // namespace

std::string exported_model_path(const std::string& run_dir) {
  return (fs::path(run_dir) / "model.safetensors").string();
}

std::string exported_model_dir(const std::string& run_dir) {
  return (fs::path(run_dir) / "model").string();
}

std::string exported_config_path(const std::string& run_dir) {
  return (fs::path(run_dir) / "config.yaml").string();
}

ResolvedCheckpoint resolve_checkpoint(const std::string& path, const ResolveOptions& options) {
  using Kind = ResolvedCheckpoint::Kind;
  const std::string expected =
      options.exported_model()
          ? "a checkpoint directory (RUN_DIR/checkpoints/step-000120), a run directory holding "
            "complete checkpoints or an exported model.safetensors, or a .safetensors file"
          : "a checkpoint directory (RUN_DIR/checkpoints/step-000120) or a run directory holding "
            "complete checkpoints";
  std::error_code ec;
  const fs::path p(path);
  ST_CHECK(fs::exists(p, ec), CheckpointError, "no checkpoint at '", path,
           "': the path does not exist. Expected ", expected, ".");
  if (!fs::is_directory(p, ec)) {
    if (options.exported_model() && p.extension() == ".safetensors") {
      return {Kind::ExportedModel, path, exported_step(path)};
    }
    ST_CHECK(false, CheckpointError, "'", path, "' is a file, not a checkpoint directory. Expected ",
             expected, ".");
  }
  if (is_complete(path)) return {Kind::Checkpoint, path, read_metadata(path).step};
  ST_CHECK(!fs::exists(p / detail::kMetadataFile, ec), CheckpointError, "'", path,
           "' is an incomplete checkpoint (no ", detail::kCommitFile,
           " marker: its save did not finish). Hint: pass its run directory, whose newest "
           "complete checkpoint is used, or an older step.");

  // A run directory.
  const std::optional<CheckpointEntry> latest = latest_complete(path);
  if (options.exported_model()) {
    const std::string model = exported_model_path(path);
    if (fs::is_regular_file(model, ec)) {
      const int64_t step = exported_step(model);
      if (!latest || step >= latest->step) return {Kind::ExportedModel, model, step};
    }
  }
  ST_CHECK(latest.has_value(), CheckpointError, "'", path,
           "' holds no complete checkpoint (looked for ", detail::kCommitFile, " in '", path,
           "' and under '", checkpoints_root(path), "'",
           options.exported_model() ? ", and for " + exported_model_path(path) : std::string(),
           "). Expected ", expected, ".");
  return {Kind::Checkpoint, latest->path, latest->step};
}

}  // namespace shardtrain::checkpoint
