// Command-line flags of every subcommand, read by one library (CLI11) with
// one set of value checks and one wording of errors: a bad flag or value is
// a ConfigError (exit code 2) of one line that names it and points to
// --help. CLI11 stays in the tool; no library header includes it.
#pragma once

#include <CLI/CLI.hpp>

#include <string>
#include <vector>

namespace shardtrain::cli {

/// A parser for `shardtrain COMMAND`: -h/--help, values as `--flag v` or
/// `--flag=v`, a repeated flag keeps its last value.
void setup_app(CLI::App& app);

/// Parses argv[1..] (argv[0] is the command's name). Returns true when
/// --help was given (the caller prints its usage and exits 0). A missing
/// value, or a word no flag or positional takes, is a ConfigError:
/// "FLAG needs a value; see shardtrain COMMAND --help" and
/// "UNKNOWN 'WORD'; HINT" respectively (with app.prefix_command(), the
/// words from the first unknown one on are left in app.remaining()).
bool parse_flags(CLI::App& app, int argc, char** argv, const std::string& command,
                 const std::string& unknown = "unexpected argument", const std::string& hint = "");

/// A whole decimal number within [lo, hi]; otherwise the ConfigError
/// "invalid value 'V' for FLAG; expected ALLOWED (lo..hi)".
long parse_int(const std::string& flag, const std::string& value, long lo, long hi,
               const char* allowed);

/// Seconds in [0, 3600], e.g. 3 or 0.5; otherwise a ConfigError naming FLAG.
double parse_seconds(const std::string& flag, const std::string& value);

/// Adds `name` (e.g. "--iters") storing a checked integer in `target`.
CLI::Option* add_int(CLI::App& app, const std::string& name, int& target, long lo, long hi,
                     const char* allowed, const std::string& help = "");

/// Adds `name` storing its value, one word per use, in `target`.
CLI::Option* add_text(CLI::App& app, const std::string& name, std::string& target,
                      const std::string& help = "");

/// Adds a repeatable `name` (`--set k=v --set k2=v2`), one word per use.
CLI::Option* add_list(CLI::App& app, const std::string& name, std::vector<std::string>& target,
                      const std::string& help = "");

}  // namespace shardtrain::cli
