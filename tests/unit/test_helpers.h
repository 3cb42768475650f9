// Small helpers the unit tests share: running the command-line tool, and
// expecting a CheckpointError.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <exception>
#include <filesystem>
#include <string>

#include "shardtrain/core/error.h"

#ifndef SHARDTRAIN_CLI_PATH
#error "SHARDTRAIN_CLI_PATH must be the absolute path of the shardtrain binary"
#endif

namespace shardtrain::testing {

struct CliRun {
  int code = -1;
  std::string out;  // stdout and stderr together
};

/// Runs `shardtrain ARGS` (through the shell) and collects its output;
/// killed after `kill_after_s` seconds when given (exit 137), so that a
/// bound that is missing fails the test instead of hanging it.
inline CliRun cli(const std::string& args, int kill_after_s = 0) {
  CliRun r;
  const std::string cmd = (kill_after_s > 0 ? "timeout -s KILL " + std::to_string(kill_after_s) + " " : std::string()) +
                          SHARDTRAIN_CLI_PATH + " " + args + " 2>&1";
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return r;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), p)) > 0) r.out.append(buf, n);
  const int status = ::pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

/// Whether a writer's temporary for `target` (`target.tmp.<random>`, or
/// the older fixed `target.tmp`) is left beside it.
inline bool temporary_left_beside(const std::string& target) {
  const std::filesystem::path t(target);
  const std::string prefix = t.filename().string() + ".tmp";
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(t.parent_path().empty() ? "." : t.parent_path(), ec)) {
    if (e.path().filename().string().rfind(prefix, 0) == 0) return true;
  }
  return false;
}

/// Symbolic links planted where a careless writer of `out` would write:
/// `out.tmp` and `out` itself, each pointing at a victim file whose content
/// must survive the write (a writer creates its temporary with O_EXCL |
/// O_NOFOLLOW and renames it over the link).
struct PlantedLinks {
  explicit PlantedLinks(const std::string& out) : out_(out) {
    for (const char* v : {".victim", ".tmp-victim"}) {
      std::FILE* f = std::fopen((out_ + v).c_str(), "w");
      if (f == nullptr) {
        ADD_FAILURE() << "cannot create " << out_ << v;
        continue;
      }
      std::fputs("precious\n", f);
      std::fclose(f);
    }
    std::filesystem::create_symlink(out_ + ".tmp-victim", out_ + ".tmp");
    std::filesystem::create_symlink(out_ + ".victim", out_);
  }
  /// The victims as they were, the planted temporary link untouched, and
  /// `out` now a regular file of its own.
  void expect_intact() const {
    for (const char* v : {".victim", ".tmp-victim"}) {
      std::string text(64, '\0');
      std::FILE* f = std::fopen((out_ + v).c_str(), "r");
      ASSERT_NE(f, nullptr) << out_ << v;
      text.resize(std::fread(text.data(), 1, text.size(), f));
      std::fclose(f);
      EXPECT_EQ(text, "precious\n") << out_ << v << " was written through a link";
    }
    EXPECT_TRUE(std::filesystem::is_symlink(out_ + ".tmp"));
    EXPECT_FALSE(std::filesystem::is_symlink(out_)) << out_ << " is still the planted link";
    EXPECT_TRUE(std::filesystem::is_regular_file(out_));
  }

 private:
  std::string out_;
};

/// Runs `fn`, expects a CheckpointError, returns its message.
template <typename Fn>
std::string checkpoint_error(Fn&& fn) {
  try {
    fn();
  } catch (const CheckpointError& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected a CheckpointError, got: " << e.what();
    return {};
  }
  ADD_FAILURE() << "expected a CheckpointError, nothing was thrown";
  return {};
}

}  // namespace shardtrain::testing
