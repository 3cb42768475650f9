// The run report: one self-contained HTML page per run directory, or one
// that overlays several runs for comparison. `shardtrain train` writes
// <run.dir>/report.html at the end of every run; `shardtrain report` writes
// it for any run directories.
//
// The page needs nothing but itself: charts are inline SVG drawn here, with
// no script and no link to anything outside the file. It shows, per run,
// the config (config.yaml, else the newest checkpoint's), and charts of
// train and eval loss, learning rate, gradient norm, loss scale, skipped
// steps, tokens/s, peak RSS per rank and the share of communication hidden
// behind compute, read from metrics.jsonl. Non-finite values are left out;
// a series a run never recorded says so instead of a chart.
#pragma once

#include <string>
#include <vector>

namespace shardtrain::train {

/// The report's HTML for `run_dirs` (one colour per run, the legend naming
/// each by its directory's name). ConfigError when a path is not a
/// directory or has no metrics.jsonl; IoError when metrics.jsonl cannot be
/// read. A run with no steps logged yet gives a page that says so.
std::string render_report(const std::vector<std::string>& run_dirs);

/// render_report, written to `out` atomically (aside, then renamed into
/// place); IoError when it cannot be written.
void write_report(const std::vector<std::string>& run_dirs, const std::string& out);

/// `<run_dir>/report.html`, where `shardtrain train` writes its report.
std::string default_report_path(const std::string& run_dir);

}  // namespace shardtrain::train
