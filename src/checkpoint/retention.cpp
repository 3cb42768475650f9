// Run directories: where checkpoints go, which are complete, and pruning.
// Only names of our own pattern (step-<digits>, with .tmp or .old for work in
// progress) are ever listed or deleted, and only real directories: a
// symbolic link is never deleted nor followed by a delete.
#include <algorithm>
#include <cctype>
#include <cstdio>
#include <filesystem>
#include <set>

#include "checkpoint/detail.h"
#include "shardtrain/core/error.h"

namespace shardtrain::checkpoint {

namespace fs = std::filesystem;

namespace {

// step-000120 -> 120 (suffix ""), step-000120.tmp -> 120 (suffix ".tmp"); -1
// for anything else.
int64_t parse_step(const std::string& name, std::string* suffix) {
  if (name.rfind("step-", 0) != 0) return -1;
  size_t i = 5;
  int64_t step = 0;
  while (i < name.size() && std::isdigit(static_cast<unsigned char>(name[i]))) {
    if (step > (INT64_MAX - 9) / 10) return -1;
    step = step * 10 + (name[i] - '0');
    ++i;
  }
  if (i == 5) return -1;
  *suffix = name.substr(i);
  return step;
}

// A checkpoint directory linked in from elsewhere (a shared checkpoint to
// resume from) belongs to another run: it is listed, never deleted, and no
// delete goes through it.
bool is_link(const fs::path& p) {
  std::error_code ec;
  return fs::symlink_status(p, ec).type() == fs::file_type::symlink;
}

std::string canonical_or_self(const std::string& p) {
  std::error_code ec;
  const auto c = fs::weakly_canonical(p, ec);
  return ec ? fs::path(p).lexically_normal().string() : c.string();
}

}  // namespace

std::string checkpoints_root(const std::string& run_dir) {
  return (fs::path(run_dir) / "checkpoints").string();
}

std::string checkpoint_dir(const std::string& run_dir, int64_t step) {
  ST_CHECK(step >= 0, InvalidArgument, "checkpoint step must be >= 0, got ", step);
  char name[40];
  std::snprintf(name, sizeof(name), "step-%06lld", static_cast<long long>(step));
  return (fs::path(checkpoints_root(run_dir)) / name).string();
}

bool is_complete(const std::string& dir) {
  std::error_code ec;
  return fs::is_directory(dir, ec) && fs::is_regular_file(fs::path(dir) / detail::kCommitFile, ec);
}

std::vector<CheckpointEntry> list_complete(const std::string& run_dir) {
  std::vector<CheckpointEntry> out;
  const fs::path root = checkpoints_root(run_dir);
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return out;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    std::string suffix;
    const int64_t step = parse_step(e.path().filename().string(), &suffix);
    if (step < 0 || !is_complete(e.path().string())) continue;
    if (suffix == ".old") {
      // A complete checkpoint moved aside by a save of the same step that
      // has not committed yet: it stands in until that save commits.
      if (is_complete(checkpoint_dir(run_dir, step))) continue;
    } else if (!suffix.empty()) {
      continue;
    }
    out.push_back({e.path().string(), step});
  }
  std::sort(out.begin(), out.end(), [](const CheckpointEntry& a, const CheckpointEntry& b) {
    return a.step > b.step;
  });
  return out;
}

std::optional<CheckpointEntry> latest_complete(const std::string& run_dir) {
  auto all = list_complete(run_dir);
  if (all.empty()) return std::nullopt;
  return all.front();
}

std::vector<std::string> prune(const std::string& run_dir, int keep,
                               const std::vector<std::string>& protect) {
  ST_CHECK(keep >= 0, InvalidArgument, "prune: keep must be >= 0, got ", keep);
  std::set<std::string> protected_paths;
  for (const auto& p : protect) protected_paths.insert(canonical_or_self(p));
  std::vector<std::string> victims;
  const auto complete = list_complete(run_dir);
  for (size_t i = static_cast<size_t>(keep); i < complete.size(); ++i) {
    if (is_link(complete[i].path)) continue;
    if (!protected_paths.count(canonical_or_self(complete[i].path))) {
      victims.push_back(complete[i].path);
    }
  }
  // Torn and temporary directories of our naming pattern.
  const fs::path root = checkpoints_root(run_dir);
  std::error_code ec;
  if (fs::is_directory(root, ec)) {
    for (const auto& e : fs::directory_iterator(root, ec)) {
      std::string suffix;
      const std::string name = e.path().filename().string();
      if (parse_step(name, &suffix) < 0 || is_link(e.path()) || !e.is_directory(ec)) continue;
      const bool ours = suffix.empty() || suffix == ".tmp" || suffix == ".old";
      if (!ours) continue;
      if (suffix.empty() && is_complete(e.path().string())) continue;
      // A complete aside copy whose replacement never committed is a
      // checkpoint (list_complete returns it; keep decided above).
      if (suffix == ".old" && is_complete(e.path().string()) &&
          !is_complete(checkpoint_dir(run_dir, parse_step(name, &suffix)))) {
        continue;
      }
      if (protected_paths.count(canonical_or_self(e.path().string()))) continue;
      victims.push_back(e.path().string());
    }
  }
  for (const auto& v : victims) {
    // The marker goes first (durably), so an interrupted delete leaves a
    // torn directory, never a "complete" one with missing files.
    fs::remove(fs::path(v) / detail::kCommitFile, ec);
    try {
      detail::fsync_dir(v);
    } catch (const CheckpointError&) {
    }
    fs::remove_all(v, ec);
    ST_CHECK(!ec, CheckpointError, "cannot delete old checkpoint '", v, "': ", ec.message());
  }
  return victims;
}

}  // namespace shardtrain::checkpoint
