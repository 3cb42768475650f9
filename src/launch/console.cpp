#include "launch/console.h"

#include <unistd.h>

#include <cstring>

#include "shardtrain/core/error.h"

namespace shardtrain::dist::detail {

ProgressBar& progress_bar() {
  static ProgressBar bar(STDOUT_FILENO);
  return bar;
}

void say(const std::string& text) {
  progress_bar().print(STDERR_FILENO, "shardtrain launch: " + text + "\n");
}

std::string describe_code(int code) {
  if (code > 128 && code < 128 + 65) {
    const char* name = ::strsignal(code - 128);
    return ::shardtrain::detail::str_cat("exit code ", code, ", killed by signal ", code - 128,
                                         name ? std::string(" (") + name + ")" : std::string());
  }
  if (code == 127) return "exit code 127, program not found";
  if (code == 126) return "exit code 126, program not executable";
  return ::shardtrain::detail::str_cat("exit code ", code);
}

}  // namespace shardtrain::dist::detail
