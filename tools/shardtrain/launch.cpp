// `shardtrain launch [OPTIONS] -- PROGRAM ARGS...`: parses the flags into
// LaunchOptions and hands over to dist::launch(). Bad flags are ConfigErrors,
// which main() turns into exit code 2.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "commands.h"
#include "flags.h"
#include "launch_flags.h"
#include "shardtrain/core/error.h"
#include "shardtrain/launch/launcher.h"

namespace shardtrain::cli {

namespace fs = std::filesystem;
namespace {

const char kLaunchUsage[] =
    "usage: shardtrain launch [OPTIONS] -- PROGRAM [ARGS...]\n"
    "\n"
    "Starts the ranks of one node with the torchrun variables set (RANK, LOCAL_RANK,\n"
    "WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT,\n"
    "SHARDTRAIN_RESTART_COUNT), prefixes their output with \"[rank k] \", forwards\n"
    "SIGINT/SIGTERM to them (SIGTERM for a SIGHUP: a closed terminal saves and stops)\n"
    "and stops them all when one fails.\n"
    "\n"
    "options (also as --option=value):\n"
    "%s"
    "  -h, --help               show this help\n"
    "\n"
    "exit code: 0 when every rank succeeded; otherwise the failed rank's code (128+N\n"
    "if it was killed by signal N, 127 if PROGRAM was not found); 128+N when the\n"
    "launcher itself got SIGINT/SIGTERM/SIGHUP; 2 for bad options; 77 when no rank failed\n"
    "and one exited 77 (skipped, as ctest's SKIP_RETURN_CODE takes it).\n";

// Whether `program` (a path, or a name looked up in PATH as exec would)
// is this very executable.
bool is_this_program(const std::string& program) {
  const fs::path self = this_program();
  if (self.empty() || program.empty()) return false;
  auto same = [&](const fs::path& p) {
    std::error_code e;
    return fs::equivalent(p, self, e) && !e;
  };
  if (program.find('/') != std::string::npos) return same(program);
  const char* path = std::getenv("PATH");
  std::string dirs = path != nullptr ? path : "/usr/local/bin:/usr/bin:/bin";
  for (size_t at = 0; at <= dirs.size();) {
    const size_t end = std::min(dirs.find(':', at), dirs.size());
    const fs::path candidate = fs::path(at == end ? "." : dirs.substr(at, end - at)) / program;
    if (::access(candidate.c_str(), X_OK) == 0) return same(candidate);
    at = end + 1;
  }
  return false;
}

}  // namespace

int launch_main(int argc, char** argv) {
  dist::LaunchOptions options;
  // Options end at '--' or at the first word that is not an option, which
  // starts the program, as in torchrun.
  int end = 1;
  while (end < argc && std::string(argv[end]) != "--") ++end;
  CLI::App app;
  setup_app(app);
  app.prefix_command();
  add_launch_flags(app, options);
  if (parse_flags(app, end, argv, "launch")) {
    std::printf(kLaunchUsage, kLaunchFlagsUsage);
    return 0;
  }
  const std::vector<std::string> rest = app.remaining();
  if (!rest.empty()) {
    const std::string& first = rest.front();
    ST_CHECK(first.size() < 2 || first[0] != '-', ConfigError, "unknown option '", first,
             "'; allowed: ", launch_flag_names(), ", --help, then '--' and the program");
    options.command(rest);
    if (end < argc) options.command().emplace_back("--");  // the program's own
  }
  for (int i = end + 1; i < argc; ++i) options.command().emplace_back(argv[i]);
  ST_CHECK(!options.command().empty(), ConfigError,
           "no program given; usage: shardtrain launch --nproc-per-node N -- PROGRAM [ARGS...]");
  check_launch_flags(options);
  // `shardtrain launch -- shardtrain ...`: the ranks are forked copies of
  // this process (the fork server) rather than new ones.
  if (is_this_program(options.command()[0])) options.rank_main(run_tool);
  std::fflush(stdout);  // the ranks' output goes straight to fd 1 after this
  return dist::launch(options);
}

}  // namespace shardtrain::cli
