// `shardtrain SUBCOMMAND ...`: dispatches to one file per subcommand and turns
// shardtrain's typed errors into a one-line message and a non-zero exit code.
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>

#include "commands.h"
#include "shardtrain/core/error.h"
#include "shardtrain/dist/launcher.h"

namespace {

struct Command {
  const char* name;
  int (*run)(int, char**);
  const char* summary;
};

const Command kCommands[] = {
    {"launch", shardtrain::cli::launch_main, "start the ranks of a job on this node"},
    {"train", shardtrain::cli::train_main, "train the model a YAML config describes"},
    {"estimate", shardtrain::cli::estimate_main, "memory and communication of each strategy"},
    {"config", shardtrain::cli::config_main, "print a checked config with every key; update docs"},
    {"generate", shardtrain::cli::generate_main, "sample text from a trained GPT"},
    {"checkpoint", shardtrain::cli::checkpoint_main, "inspect or export a sharded checkpoint"},
    {"lora", shardtrain::cli::lora_main, "merge a LoRA adapter into its base model"},
    {"bench-comm", shardtrain::cli::bench_comm_main, "measure a collective's bandwidth"},
};

void usage(FILE* out) {
  std::fprintf(out, "usage: shardtrain COMMAND [ARGS...]\n\ncommands:\n");
  for (const auto& c : kCommands) std::fprintf(out, "  %-12s %s\n", c.name, c.summary);
  std::fprintf(out, "\nRun 'shardtrain COMMAND --help' for a command's options.\n");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
    usage(argc < 2 ? stderr : stdout);
    return argc < 2 ? shardtrain::dist::kBadInputExitCode : 0;
  }
  for (const auto& c : kCommands) {
    if (std::strcmp(argv[1], c.name) != 0) continue;
    try {
      return c.run(argc - 1, argv + 1);
    } catch (const shardtrain::ConfigError& e) {
      std::fprintf(stderr, "shardtrain %s: configuration error: %s\n", c.name, e.what());
      return shardtrain::dist::kBadInputExitCode;
    } catch (const shardtrain::CheckpointError& e) {
      std::fprintf(stderr, "shardtrain %s: checkpoint error: %s\n", c.name, e.what());
      return 3;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "shardtrain %s: error: %s\n", c.name, e.what());
      return 1;
    }
  }
  std::fprintf(stderr, "shardtrain: unknown command '%s'\n\n", argv[1]);
  usage(stderr);
  return shardtrain::dist::kBadInputExitCode;
}
