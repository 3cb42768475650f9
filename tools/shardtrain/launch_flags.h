// The launcher's options as command-line flags, shared by `shardtrain launch`
// and `shardtrain train` so that each flag means the same in both.
#pragma once

#include <string>

#include "shardtrain/launch/launcher.h"

namespace shardtrain::cli {

/// The flags launch_flag() knows, comma-separated, for "allowed:" lists in errors.
std::string launch_flag_names();

/// Usage lines describing those flags (for --help texts).
extern const char kLaunchFlagsUsage[];

/// When argv[i] is one of the launcher's flags (as `--flag value` or
/// `--flag=value`; torchrun's underscore spellings too), applies it to
/// `options`, leaves `i` on its last word and returns the flag's name as
/// launch_flag_names() spells it; null for any other word. A bad value is a
/// ConfigError naming the flag.
const char* launch_flag(int argc, char** argv, int& i, dist::LaunchOptions& options);

/// The checks between flags: node rank below the node count, and a master
/// address and port for a job of several nodes. ConfigError otherwise.
void check_launch_flags(const dist::LaunchOptions& options);

}  // namespace shardtrain::cli
