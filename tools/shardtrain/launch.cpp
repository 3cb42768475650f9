// `shardtrain launch [OPTIONS] -- PROGRAM ARGS...`: parses the flags into
// LaunchOptions and hands over to dist::launch(). Bad flags are ConfigErrors,
// which main() turns into exit code 2.
#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

#include "commands.h"
#include "flags.h"
#include "launch_flags.h"
#include "shardtrain/core/error.h"
#include "shardtrain/launch/launcher.h"

namespace shardtrain::cli {
namespace {

const char kUsage[] =
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
    std::printf(kUsage, kLaunchFlagsUsage);
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
  std::fflush(stdout);  // the ranks' output goes straight to fd 1 after this
  return dist::launch(options);
}

}  // namespace shardtrain::cli
