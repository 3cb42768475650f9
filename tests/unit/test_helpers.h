// Small helpers the unit tests share: running the command-line tool, and
// expecting a CheckpointError.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <exception>
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

/// Runs `shardtrain ARGS` (through the shell) and collects its output.
inline CliRun cli(const std::string& args) {
  CliRun r;
  const std::string cmd = std::string(SHARDTRAIN_CLI_PATH) + " " + args + " 2>&1";
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return r;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), p)) > 0) r.out.append(buf, n);
  const int status = ::pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

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
