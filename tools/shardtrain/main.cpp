// `shardtrain SUBCOMMAND ...`: dispatches to one file per subcommand and turns
// shardtrain's typed errors into a one-line message and a non-zero exit code.
#include <c10/util/Exception.h>

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <new>
#include <string>

#include "commands.h"
#include "shardtrain/core/blas.h"
#include "shardtrain/core/error.h"
#include "shardtrain/launch/launcher.h"

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
    {"tokenize", shardtrain::cli::tokenize_main, "text files or JSON lines to a token file"},
    {"report", shardtrain::cli::report_main, "an HTML page of a run's metrics and config"},
    {"bench-comm", shardtrain::cli::bench_comm_main, "measure a collective's bandwidth"},
};

void usage(FILE* out) {
  std::fprintf(out, "usage: shardtrain COMMAND [ARGS...]\n\ncommands:\n");
  for (const auto& c : kCommands) std::fprintf(out, "  %-12s %s\n", c.name, c.summary);
  std::fprintf(out, "\nRun 'shardtrain COMMAND --help' for a command's options.\n");
}

// A checkpoint, the exported model, metrics or logs could not be read or
// written (docs/failure-modes.md lists the exit codes).
constexpr int kIoExitCode = 3;
constexpr int kErrorExitCode = 1;

bool debug_output() {
  const char* v = std::getenv("SHARDTRAIN_DEBUG");
  return v != nullptr && *v != '\0' && std::strcmp(v, "0") != 0;
}

// One line on stderr: the command, the kind of error, its message and hint.
// LibTorch's backtraces (in c10::Error's text, also when copied into one of
// our messages) only with SHARDTRAIN_DEBUG=1, after that line.
int report(const char* command, const char* kind, const std::exception& e, int code) {
  const std::string line = shardtrain::detail::one_line_message(e);
  const std::string full = e.what();
  const bool cut = full.find("Exception raised from ") != std::string::npos ||
                   full.find("frame #0") != std::string::npos;
  std::fprintf(stderr, "shardtrain %s: %s: %s%s\n", command, kind, line.c_str(),
               cut && !debug_output() ? " (SHARDTRAIN_DEBUG=1 shows the backtrace)" : "");
  if (debug_output()) std::fprintf(stderr, "details (SHARDTRAIN_DEBUG=1):\n%s\n", full.c_str());
  return code;
}

}  // namespace

std::string shardtrain::cli::this_program() {
  char self[4096] = {};
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof self - 1);
  return n > 0 ? std::string(self, static_cast<size_t>(n)) : std::string();
}

int shardtrain::cli::run_tool(int argc, char** argv) {
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
    usage(argc < 2 ? stderr : stdout);
    return argc < 2 ? shardtrain::dist::kBadInputExitCode : 0;
  }
  for (const auto& c : kCommands) {
    if (std::strcmp(argv[1], c.name) != 0) continue;
    try {
      return c.run(argc - 1, argv + 1);
    } catch (const shardtrain::ConfigError& e) {
      return report(c.name, "configuration error", e, shardtrain::dist::kBadInputExitCode);
    } catch (const shardtrain::CheckpointError& e) {
      return report(c.name, "checkpoint error", e, kIoExitCode);
    } catch (const shardtrain::IoError& e) {
      return report(c.name, "I/O error", e, kIoExitCode);
    } catch (const std::filesystem::filesystem_error& e) {
      return report(c.name, "I/O error", e, kIoExitCode);
    } catch (const std::bad_alloc& e) {
      return report(c.name, "out of memory", e, kErrorExitCode);
    } catch (const shardtrain::Error& e) {
      return report(c.name, "error", e, kErrorExitCode);
    } catch (const c10::Error& e) {
      return report(c.name, "LibTorch error", e, kErrorExitCode);
    } catch (const std::exception& e) {
      return report(c.name, "error", e, kErrorExitCode);
    } catch (...) {
      std::fprintf(stderr, "shardtrain %s: error: an unknown exception\n", c.name);
      return kErrorExitCode;
    }
  }
  std::fprintf(stderr, "shardtrain: unknown command '%s'\n\n", argv[1]);
  usage(stderr);
  return shardtrain::dist::kBadInputExitCode;
}

int main(int argc, char** argv) {
  // OpenBLAS picked kernels below this CPU (its detection predates it): run
  // again with the right ones named, since OpenBLAS reads the choice only
  // when it loads. Once: OPENBLAS_CORETYPE is set the second time. Should
  // exec fail, the slower kernels still compute the same results.
  // The binary by its own path, so that the process keeps its name.
  const std::string core = shardtrain::blas_coretype_to_set();
  const std::string self = core.empty() ? std::string() : shardtrain::cli::this_program();
  if (!self.empty() && ::setenv("OPENBLAS_CORETYPE", core.c_str(), 1) == 0) {
    ::execv(self.c_str(), argv);
    ::unsetenv("OPENBLAS_CORETYPE");
  }
  return shardtrain::cli::run_tool(argc, argv);
}
