#include "flags.h"

#include <cerrno>
#include <cstdlib>

#include "shardtrain/core/error.h"

namespace shardtrain::cli {

void setup_app(CLI::App& app) {
  // Words no flag takes are collected and reported in our wording below.
  app.allow_extras();
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
}

bool parse_flags(CLI::App& app, int argc, char** argv, const std::string& command,
                 const std::string& unknown, const std::string& hint) {
  const std::string see = hint.empty() ? "see shardtrain " + command + " --help" : hint;
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    return true;
  } catch (const ConfigError&) {
    // A value check failed before CLI11 looked at --help: help still wins.
    if (app.get_help_ptr() != nullptr && app.get_help_ptr()->count() > 0) return true;
    throw;
  } catch (const CLI::ArgumentMismatch& e) {
    // CLI11 words it "--flag: 1 required TEXT missing".
    const std::string what = e.what();
    ST_CHECK(false, ConfigError, what.substr(0, what.find(':')), " needs a value; ", see);
  } catch (const CLI::ParseError& e) {
    ST_CHECK(false, ConfigError, e.what(), "; ", see);
  }
  if (app.get_prefix_command()) return false;  // the caller reads the rest
  const std::vector<std::string> rest = app.remaining();
  ST_CHECK(rest.empty(), ConfigError, unknown, " '", rest.empty() ? "" : rest.front(), "'; ", see);
  return false;
}

long parse_int(const std::string& flag, const std::string& value, long lo, long hi,
               const char* allowed) {
  errno = 0;
  char* end = nullptr;
  const long v = std::strtol(value.c_str(), &end, 10);
  const bool ok = !value.empty() && end && *end == '\0' && errno == 0 && v >= lo && v <= hi &&
                  value.find_first_of(" \t+") == std::string::npos;
  ST_CHECK(ok, ConfigError, "invalid value '", value, "' for ", flag, "; expected ", allowed, " (",
           lo, "..", hi, ")");
  return v;
}

double parse_seconds(const std::string& flag, const std::string& value) {
  errno = 0;
  char* end = nullptr;
  const double v = std::strtod(value.c_str(), &end);
  ST_CHECK(!value.empty() && end && *end == '\0' && errno == 0 && v >= 0 && v <= 3600,
           ConfigError, "invalid value '", value, "' for ", flag,
           "; expected seconds between 0 and 3600, e.g. 3 or 0.5");
  return v;
}

CLI::Option* add_int(CLI::App& app, const std::string& name, int& target, long lo, long hi,
                     const char* allowed, const std::string& help) {
  const std::string flag = name.substr(0, name.find(','));  // the first spelling
  return app.add_option_function<std::string>(
      name,
      [flag, &target, lo, hi, allowed](const std::string& v) {
        target = static_cast<int>(parse_int(flag, v, lo, hi, allowed));
      },
      help);
}

CLI::Option* add_text(CLI::App& app, const std::string& name, std::string& target,
                      const std::string& help) {
  return app.add_option(name, target, help);
}

CLI::Option* add_list(CLI::App& app, const std::string& name, std::vector<std::string>& target,
                      const std::string& help) {
  return app.add_option(name, target, help)
      ->allow_extra_args(false)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
}

}  // namespace shardtrain::cli
