// `shardtrain checkpoint inspect|consolidate|list`: what a sharded
// checkpoint holds, and its export to one safetensors file.
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/json.h"
#include "commands.h"
#include "flags.h"
#include "shardtrain/checkpoint/checkpoint.h"
#include "shardtrain/checkpoint/safetensors.h"
#include "shardtrain/core/error.h"

namespace shardtrain::cli {
namespace {

namespace fs = std::filesystem;
namespace ck = shardtrain::checkpoint;

const char kCheckpointUsage[] =
    "usage: shardtrain checkpoint inspect DIR [--no-verify]\n"
    "       shardtrain checkpoint consolidate DIR --out FILE.safetensors [--no-transpose]\n"
    "       shardtrain checkpoint list RUN_DIR\n"
    "\n"
    "DIR is a checkpoint directory (RUN_DIR/checkpoints/step-000120) or a run\n"
    "directory, whose newest complete checkpoint is used (torn ones are skipped).\n"
    "A finished run also holds RUN_DIR/model.safetensors, the final model already\n"
    "consolidated; `shardtrain generate` reads it.\n"
    "\n"
    "inspect      prints the format version, world size, strategy, step, every\n"
    "             tensor (shape, dtype, how it is split over ranks) and every file\n"
    "             with its size and checksum status (read in full unless\n"
    "             --no-verify); exits 3 when a file is damaged\n"
    "consolidate  writes the parameters and buffers (not the optimizer state) to\n"
    "             one safetensors file, one tensor in memory at a time; GPT-2\n"
    "             Conv1D weights are transposed to Hugging Face's [in, out]\n"
    "             unless --no-transpose\n"
    "list         the complete checkpoints of a run directory, newest first\n";

// A checkpoint directory, or a run directory's newest complete checkpoint;
// CheckpointError saying what was expected for anything else.
std::string resolve(const std::string& path) {
  const std::string dir = ck::resolve_checkpoint(path).path;
  if (dir != path) {
    std::printf("using the newest complete checkpoint of run directory %s: %s\n", path.c_str(),
                dir.c_str());
  }
  return dir;
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// "whole on rank 0", "4 slices, ranks 0-3: 10+10+10+9", or "empty".
std::string split_str(const ck::TensorInfo& t) {
  if (t.slices.empty()) return "empty";
  if (t.slices.size() == 1) return "whole on rank " + std::to_string(t.slices[0].rank);
  std::string s = std::to_string(t.slices.size()) + " slices, ranks " +
                  std::to_string(t.slices.front().rank) + "-" +
                  std::to_string(t.slices.back().rank) + ": ";
  for (size_t i = 0; i < t.slices.size(); ++i) {
    if (i == 8 && t.slices.size() > 9) {
      s += "+...";
      break;
    }
    s += (i ? "+" : "") + std::to_string(t.slices[i].count);
  }
  return s;
}

int inspect(const std::string& arg, bool verify) {
  const std::string dir = resolve(arg);
  ck::CheckpointReader reader(dir, /*check_files=*/false);
  const ck::Metadata& m = reader.metadata();
  std::printf("checkpoint      %s\n", dir.c_str());
  std::printf("format version  %d\n", m.format_version);
  std::printf("world size      %d\n", m.world_size);
  std::printf("strategy        %s\n", m.strategy.empty() ? "(not recorded)" : m.strategy.c_str());
  if (m.step >= 0) {
    std::printf("step            %" PRId64 "\n", m.step);
  } else {
    std::printf("step            (not recorded)\n");
  }
  // Sizes come from the file: sums saturate rather than overflow.
  const auto add = [](int64_t a, int64_t b) {
    int64_t sum = 0;
    return __builtin_add_overflow(a, b, &sum) ? std::numeric_limits<int64_t>::max() : sum;
  };
  int64_t state_bytes = 0, rank_state_bytes = 0;
  for (const auto& f : m.files) {
    if (f.rank < 0) state_bytes = f.bytes;
    rank_state_bytes = add(rank_state_bytes, f.rank_state_bytes);
  }
  std::printf("training state  %" PRId64 " bytes (opaque), per-rank state %" PRId64
              " bytes in all\n",
              state_bytes, rank_state_bytes);

  int64_t counts[3] = {0, 0, 0}, bytes = 0;
  size_t width = 4;
  for (const auto& t : m.tensors) {
    counts[t.kind == "parameter" ? 0 : t.kind == "buffer" ? 1 : 2]++;
    int64_t es = t.dtype == "F64" || t.dtype == "I64" ? 8
                 : t.dtype == "F32" || t.dtype == "I32" ? 4
                 : t.dtype == "F16" || t.dtype == "BF16" || t.dtype == "I16" ? 2 : 1;
    bytes = add(bytes, t.numel() * es);  // each tensor's size was checked on reading
    width = std::max(width, t.name.size());
  }
  std::printf("\ntensors: %zu (%" PRId64 " parameters, %" PRId64 " buffers, %" PRId64
              " optimizer state), %" PRId64 " bytes of data\n",
              m.tensors.size(), counts[0], counts[1], counts[2], bytes);
  std::printf("  %-*s  %-18s  %-5s  %s\n", static_cast<int>(width), "name", "shape", "dtype",
              "split");
  for (const auto& t : m.tensors) {
    std::printf("  %-*s  %-18s  %-5s  %s\n", static_cast<int>(width), t.name.c_str(),
                shape_str(t.shape).c_str(), t.dtype.c_str(), split_str(t).c_str());
  }

  std::vector<std::string> status;
  if (verify) status = reader.verify_all();
  std::printf("\nfiles: %zu\n", m.files.size());
  int damaged = 0;
  for (size_t i = 0; i < m.files.size(); ++i) {
    const auto& f = m.files[i];
    std::string s = "not verified";
    if (verify) {
      s = status[i].empty() ? "ok" : "DAMAGED: " + status[i];
      damaged += status[i].empty() ? 0 : 1;
    }
    std::printf("  %-16s  %12" PRId64 " bytes  crc32c %08x  %s\n", f.name.c_str(), f.bytes,
                f.crc32c, s.c_str());
  }
  ST_CHECK(damaged == 0, CheckpointError, damaged, " file(s) of '", dir,
           "' are damaged (see above). Hint: load an older checkpoint.");
  return 0;
}

int consolidate(const std::string& arg, const std::string& out, bool transpose) {
  ST_CHECK(!out.empty(), ConfigError,
           "consolidate needs --out FILE.safetensors; see shardtrain checkpoint --help");
  const std::string dir = resolve(arg);
  {
    // A LoRA run's checkpoints reference their frozen base ("lora_base" in
    // the training state) instead of holding it: a consolidated file would
    // lack the base weights.
    ck::CheckpointReader reader(dir);
    const auto state = ::shardtrain::detail::parse_json_or_discarded(reader.train_state());
    ST_CHECK(!(state.is_object() && state.contains("lora_base")), CheckpointError, "'", dir,
             "' holds LoRA adapters over a frozen base it does not copy (",
             state.is_object() && state.contains("lora_base") ? state["lora_base"].value("path", "") : "",
             "), so a consolidated file would lack the base. Hint: use the run's model.safetensors "
             "(merged) or adapter/, `shardtrain generate ", dir, "`, or train with "
             "checkpoint.save_frozen_base: true");
  }
  const int64_t n = ck::consolidate_to_safetensors(dir, out, transpose);
  std::error_code ec;
  const auto size = fs::file_size(out, ec);
  std::printf("wrote %" PRId64 " tensors (%llu bytes) from %s to %s%s\n", n,
              static_cast<unsigned long long>(ec ? 0 : size), dir.c_str(), out.c_str(),
              transpose ? " (GPT-2 Conv1D weights as [in, out])" : "");
  return 0;
}

int list(const std::string& run_dir) {
  const auto all = ck::list_complete(run_dir);
  if (all.empty()) std::printf("no complete checkpoints under %s\n", ck::checkpoints_root(run_dir).c_str());
  for (const auto& e : all) std::printf("%10" PRId64 "  %s\n", e.step, e.path.c_str());
  return 0;
}

}  // namespace

int checkpoint_main(int argc, char** argv) {
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
    std::fputs(kCheckpointUsage, argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  std::string action, dir, out;
  bool verify = true, transpose = true;
  CLI::App app;
  setup_app(app);
  app.add_option("action", action);
  app.add_option("dir", dir);
  add_text(app, "--out", out);
  app.add_flag_callback("--no-verify", [&] { verify = false; });
  app.add_flag_callback("--no-transpose", [&] { transpose = false; });
  if (parse_flags(app, argc, argv, "checkpoint", "unknown option")) {
    std::fputs(kCheckpointUsage, stdout);
    return 0;
  }
  ST_CHECK(!dir.empty(), ConfigError, "shardtrain checkpoint ", action,
           " needs a directory; see shardtrain checkpoint --help");
  if (action == "inspect") return inspect(dir, verify);
  if (action == "consolidate") return consolidate(dir, out, transpose);
  if (action == "list") return list(dir);
  ST_CHECK(false, ConfigError, "unknown action '", action,
           "'; expected inspect, consolidate or list (see shardtrain checkpoint --help)");
  return 2;
}

}  // namespace shardtrain::cli
