// `shardtrain report RUN_DIR... [--out FILE.html]`: the run report, one
// self-contained HTML page (train::write_report); several run directories
// are overlaid on the same charts.
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "commands.h"
#include "flags.h"
#include "shardtrain/core/error.h"
#include "shardtrain/train/report.h"

namespace shardtrain::cli {
namespace {

const char kReportUsage[] =
    "usage: shardtrain report RUN_DIR [RUN_DIR ...] [--out FILE.html]\n"
    "\n"
    "Writes one self-contained HTML page (no network needed to view it) with each\n"
    "run's config and charts of train and eval loss, learning rate, gradient norm,\n"
    "loss scale, skipped steps, tokens/s, peak memory per rank and communication\n"
    "hidden behind compute, from RUN_DIR/metrics.jsonl. Several run directories are\n"
    "drawn on the same charts, one colour per run. Default output: the first\n"
    "RUN_DIR's report.html (`shardtrain train` writes that one itself).\n";

}  // namespace

int report_main(int argc, char** argv) {
  std::vector<std::string> dirs;
  std::string out;
  CLI::App app;
  setup_app(app);
  app.add_option("dirs", dirs)->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  add_text(app, "--out", out);
  if (parse_flags(app, argc, argv, "report", "unexpected option",
                  "allowed: RUN_DIR..., --out FILE.html; see shardtrain report --help")) {
    std::printf("%s", kReportUsage);
    return 0;
  }
  ST_CHECK(!dirs.empty(), ConfigError,
           "no run directory given; usage: shardtrain report RUN_DIR [RUN_DIR ...] [--out FILE.html]");
  if (out.empty()) out = train::default_report_path(dirs.front());
  train::write_report(dirs, out);
  std::printf("report: %s\n", out.c_str());
  return 0;
}

}  // namespace shardtrain::cli
