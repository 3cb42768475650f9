// The launcher's options as command-line flags, shared by `shardtrain launch`
// and `shardtrain train` so that each flag means the same in both.
#pragma once

#include <string>

#include "flags.h"

#include "shardtrain/launch/launcher.h"

namespace shardtrain::cli {

/// The launcher's flags, comma-separated, for "allowed:" lists in errors.
std::string launch_flag_names();

/// Usage lines describing those flags (for --help texts).
extern const char kLaunchFlagsUsage[];

/// Adds the launcher's flags to `app` (also with torchrun's underscore
/// spellings); a given flag sets its field of `options` and, for
/// --nproc-per-node, `nproc`. A bad value is a ConfigError naming the flag.
void add_launch_flags(CLI::App& app, dist::LaunchOptions& options, int* nproc = nullptr);

/// The checks between flags: node rank below the node count, and a master
/// address and port for a job of several nodes. ConfigError otherwise.
void check_launch_flags(const dist::LaunchOptions& options);

}  // namespace shardtrain::cli
