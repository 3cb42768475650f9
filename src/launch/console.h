// What the launcher prints: its own lines ("shardtrain launch: ..."), which
// go above the progress bar when stdout is a terminal.
#pragma once

#include <string>

#include "launch/progress.h"

namespace shardtrain::dist::detail {

/// The one progress bar on our terminal (inactive when stdout is not one):
/// every line the launcher or a rank prints goes above it.
ProgressBar& progress_bar();

/// Prints "shardtrain launch: TEXT" to stderr.
void say(const std::string& text);

/// "exit code 1", "exit code 137, killed by signal 9 (Killed)", ...
std::string describe_code(int code);

}  // namespace shardtrain::dist::detail
