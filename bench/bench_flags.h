// Flag parsing shared by the C++ benchmarks (bench_memcpy, bench_gemm_peak,
// bench_checkpoint), with the library the tool uses (CLI11, header-only):
// --help prints the usage and exits 0; an unknown flag, a missing value or
// a value that is not a whole number in range (`--reps 5x`, `--reps x`)
// exits 2 with one line that names it.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdio>
#include <cstdlib>

namespace bench {

inline void parse_flags(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    std::fputs(app.help().c_str(), stdout);
    std::exit(0);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "%s: %s; see %s --help\n", app.get_name().c_str(), e.what(),
                 app.get_name().c_str());
    std::exit(2);
  }
}

}  // namespace bench
