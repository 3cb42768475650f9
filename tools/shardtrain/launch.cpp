// `shardtrain launch [OPTIONS] -- PROGRAM ARGS...`: parses the flags into
// LaunchOptions and hands over to dist::launch(). Bad flags are ConfigErrors,
// which main() turns into exit code 2.
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "commands.h"
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
  int i = 1;
  for (; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--") {
      ++i;
      break;
    }
    if (arg == "-h" || arg == "--help") {
      std::printf(kUsage, kLaunchFlagsUsage);
      return 0;
    }
    // The first word that is not an option starts the program, as in torchrun.
    if (arg.size() < 2 || arg[0] != '-') break;

    ST_CHECK(launch_flag(argc, argv, i, options) != nullptr, ConfigError, "unknown option '", arg,
             "'; allowed: ", launch_flag_names(), ", --help, then '--' and the program");
  }
  for (; i < argc; ++i) options.command().emplace_back(argv[i]);
  ST_CHECK(!options.command().empty(), ConfigError,
           "no program given; usage: shardtrain launch --nproc-per-node N -- PROGRAM [ARGS...]");
  check_launch_flags(options);
  std::fflush(stdout);  // the ranks' output goes straight to fd 1 after this
  return dist::launch(options);
}

}  // namespace shardtrain::cli
