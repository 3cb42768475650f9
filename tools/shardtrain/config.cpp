// `shardtrain config`: the configuration a run would see, and the key tables
// of docs/config.md, both from the one key table in src/config/schema.cpp.
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "commands.h"
#include "shardtrain/config/config.h"
#include "shardtrain/config/schema.h"
#include "shardtrain/core/error.h"

namespace shardtrain::cli {
namespace {

const char kUsage[] =
    "usage: shardtrain config [CONFIG] [--set KEY=VALUE ...]\n"
    "       shardtrain config --docs FILE | --check-docs FILE\n"
    "\n"
    "Without --docs: loads CONFIG (default: none, the defaults) with the overrides,\n"
    "checks it as `shardtrain train` would and prints every key with its value.\n"
    "--docs FILE rewrites the key tables of FILE (docs/config.md: the lines between\n"
    "<!-- keys:SECTION --> and <!-- /keys -->) from the key declarations;\n"
    "--check-docs FILE exits with 1 when they differ.\n";

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  ST_CHECK(in, ConfigError, "cannot read '", path, "'; pass the path of docs/config.md");
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

int docs(const std::string& path, bool check) {
  const std::string text = read_file(path);
  const std::string updated = config::with_key_tables(text);
  if (updated == text) return 0;
  if (check) {
    std::fprintf(stderr,
                 "%s: the key tables differ from the key declarations; run `shardtrain config "
                 "--docs %s` (or build the target config-docs)\n",
                 path.c_str(), path.c_str());
    return 1;
  }
  std::ofstream out(path, std::ios::trunc);
  out << updated;
  ST_CHECK(out.good(), Error, "cannot write '", path, "'");
  std::printf("%s: key tables updated\n", path.c_str());
  return 0;
}

}  // namespace

int config_main(int argc, char** argv) {
  std::string path;
  std::vector<std::string> overrides;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const auto value = [&]() -> std::string {
      ST_CHECK(i + 1 < argc, ConfigError, arg, " needs a value; see shardtrain config --help");
      return argv[++i];
    };
    if (arg == "--help" || arg == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    } else if (arg == "--docs" || arg == "--check-docs") {
      return docs(value(), arg == "--check-docs");
    } else if (arg == "--set") {
      overrides.push_back(value());
    } else if (arg.rfind("--set=", 0) == 0) {
      overrides.push_back(arg.substr(6));
    } else if (!arg.empty() && arg[0] != '-' && path.empty()) {
      path = arg;
    } else {
      ST_CHECK(false, ConfigError, "unexpected argument '", arg, "'; see shardtrain config --help");
    }
  }
  const config::Config c = path.empty() ? config::Config::parse("", overrides, "<defaults>")
                                        : config::Config::load(path, overrides);
  std::fputs(c.to_yaml().c_str(), stdout);
  return 0;
}

}  // namespace shardtrain::cli
