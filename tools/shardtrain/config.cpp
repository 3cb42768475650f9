// `shardtrain config`: the configuration a run would see, and the key tables
// of docs/config.md, both from the one key table in src/config/schema.cpp.
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "commands.h"
#include "core/file.h"
#include "flags.h"
#include "shardtrain/config/config.h"
#include "shardtrain/config/schema.h"
#include "shardtrain/core/error.h"

namespace shardtrain::cli {
namespace {

const char kConfigUsage[] =
    "usage: shardtrain config [CONFIG] [--set KEY=VALUE ...]\n"
    "       shardtrain config --docs FILE | --check-docs FILE\n"
    "\n"
    "Without --docs: loads CONFIG (default: none, the defaults) with the overrides,\n"
    "checks it as `shardtrain train` would and prints every key with its value.\n"
    "--docs FILE rewrites the key tables of FILE (docs/config.md: the lines between\n"
    "<!-- keys:SECTION --> and <!-- /keys -->) from the key declarations;\n"
    "--check-docs FILE exits with 1 when they differ.\n";

std::string read_file(const std::string& path) {
  std::string text, why;
  ST_CHECK(::shardtrain::detail::read_regular_file(path, int64_t{16} << 20, &text, &why), ConfigError,
           "cannot read '", path, "': ", why, "; pass the path of docs/config.md");
  return text;
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
  std::string path, docs_file, check_file;
  std::vector<std::string> overrides;
  CLI::App app;
  setup_app(app);
  app.add_option("config", path);
  add_list(app, "--set", overrides);
  add_text(app, "--docs", docs_file);
  add_text(app, "--check-docs", check_file);
  if (parse_flags(app, argc, argv, "config")) {
    std::fputs(kConfigUsage, stdout);
    return 0;
  }
  if (!check_file.empty()) return docs(check_file, /*check=*/true);
  if (!docs_file.empty()) return docs(docs_file, /*check=*/false);
  const config::Config c = path.empty() ? config::Config::parse("", overrides, "<defaults>")
                                        : config::Config::load(path, overrides);
  std::fputs(c.to_yaml().c_str(), stdout);
  return 0;
}

}  // namespace shardtrain::cli
