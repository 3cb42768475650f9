// The run report: metrics.jsonl of one or more runs drawn as inline SVG
// charts in one HTML page (see report.h).
#include "shardtrain/train/report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/json.h"
#include "checkpoint/detail.h"
#include "core/file.h"
#include "shardtrain/checkpoint/checkpoint.h"
#include "shardtrain/core/error.h"
#include "train/series.h"

namespace shardtrain::train {

namespace fs = std::filesystem;

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr long long kMaxMetricsBytes = 1LL << 30;

struct Point {
  double x;
  double y;
};
using Points = std::vector<Point>;

// What one run directory gives the report.
struct Run {
  std::string dir;
  std::string name;           // the legend's label
  std::string config;         // YAML, empty when not recorded
  std::string config_source;  // the file it came from
  int64_t steps = 0;          // step lines in metrics.jsonl
  int64_t unreadable = 0;     // lines that are not JSON objects
  std::string strategy, precision;
  int64_t world_size = 0;
  std::map<std::string, Points> series;  // by metric key (and derived ones)
  // A series per rank: peak_rss_mb_ranks, compute_s_ranks (compute seconds
  // of each rank), shares (each data-parallel rank's share of the batch).
  std::map<std::string, std::vector<Points>> ranks;
  nlohmann::json timeline;               // pipeline_timeline.json; null when absent
};

// A number of a metrics line: NaN when absent, null (non-finite) or not a number.
double number(const nlohmann::json& row, const char* key) {
  const auto it = row.find(key);
  if (it == row.end() || !it->is_number()) return kNaN;
  return it->get<double>();
}

// The config of the run: the exported model's config.yaml, else the one
// its newest complete checkpoint records (a run stopped by a signal).
void read_config(Run& run) {
  const std::string yaml = (fs::path(run.dir) / "config.yaml").string();
  std::string text, why;
  if (::shardtrain::detail::read_regular_file(yaml, 1 << 20, &text, &why)) {
    run.config = text;
    run.config_source = "config.yaml";
    return;
  }
  try {
    if (const auto latest = checkpoint::latest_complete(run.dir)) {
      checkpoint::CheckpointReader reader(latest->path);
      run.config = ::shardtrain::detail::parse_json_text(reader.train_state()).at("config").get<std::string>();
      run.config_source = fs::path(latest->path).filename().string() + "/train_state.bin";
    }
  } catch (const std::exception&) {
    run.config.clear();  // no config recorded: the page says so
  }
}

// metrics.jsonl of a run directory, refused with a hint when `dir` is not one.
std::string read_metrics(const std::string& dir) {
  std::error_code ec;
  ST_CHECK(fs::is_directory(dir, ec), ConfigError, "'", dir,
           "' is not a directory; give a run directory (the run.dir of a training run)");
  const std::string metrics = (fs::path(dir) / "metrics.jsonl").string();
  ST_CHECK(fs::exists(metrics, ec), ConfigError, "'", dir,
           "' has no metrics.jsonl, so it is not a run directory; give the run.dir of a "
           "training run");
  std::string text, why;
  ST_CHECK(::shardtrain::detail::read_regular_file(metrics, kMaxMetricsBytes, &text, &why), IoError,
           "cannot read ", metrics, ": ", why, "; check the file and its permissions");
  return text;
}

// The legend's label: the directory's own name, also for "runs/a/" or ".".
std::string run_name(const std::string& dir) {
  std::error_code ec;
  fs::path name = fs::path(dir).lexically_normal();
  if (name.filename().empty()) name = name.parent_path();
  std::string out = name.filename().string();
  if (out.empty() || out == ".") out = fs::absolute(dir, ec).lexically_normal().filename().string();
  return out;
}

// The per-rank series of a step line (peak RSS, compute seconds, shares).
void add_rank_series(Run& run, const nlohmann::json& row, double step) {
  for (const char* key : {"peak_rss_mb_ranks", "compute_s_ranks", "shares"}) {
    const auto ranks = row.find(key);
    if (ranks == row.end() || !ranks->is_array()) continue;
    auto& series = run.ranks[key];
    if (series.size() < ranks->size()) series.resize(ranks->size());
    for (size_t r = 0; r < ranks->size(); ++r) {
      const auto& v = (*ranks)[r];
      if (v.is_number() && std::isfinite(v.get<double>())) series[r].push_back({step, v.get<double>()});
    }
  }
}

// One line of metrics.jsonl: an evaluation, a training step, or neither
// (counted as unreadable when it is not a JSON object with a step).
// skipped_total: the skipped steps summed over the lines so far.
void add_metrics_line(Run& run, const std::string& line, double& skipped_total) {
  const nlohmann::json row = ::shardtrain::detail::parse_json_or_discarded(line);
  if (!row.is_object()) {
    ++run.unreadable;
    return;
  }
  const double step = number(row, "step");
  if (!std::isfinite(step)) {
    ++run.unreadable;
    return;
  }
  const auto add = [&](const std::string& key, double value) {
    if (std::isfinite(value)) run.series[key].push_back({step, value});
  };
  if (row.contains("eval_loss")) {
    add("eval_loss", number(row, "eval_loss"));
    return;
  }
  if (!row.contains("loss")) return;
  ++run.steps;
  for (const char* key : {"loss", "lr", "grad_norm", "loss_scale", "tokens_per_s"}) {
    add(key, number(row, key));
  }
  if (row.contains("skipped")) {
    skipped_total += std::max(0.0, number(row, "skipped"));
    add("skipped", skipped_total);
  }
  add("comm_hidden", 100.0 * detail::comm_hidden(number(row, "comm_busy_s"),
                                                 number(row, "comm_exposed_s")));
  add_rank_series(run, row, step);
  if (!row.contains("peak_rss_mb_ranks")) {
    add("peak_rss_mb", number(row, "peak_rss_mb"));  // older runs: the largest rank's only
  }
  if (row.contains("strategy") && row["strategy"].is_string()) run.strategy = row["strategy"];
  if (row.contains("precision") && row["precision"].is_string()) run.precision = row["precision"];
  const double ws = number(row, "world_size");
  if (std::isfinite(ws)) run.world_size = static_cast<int64_t>(ws);
}

// pipeline_timeline.json when the run wrote one; left null when it is not
// an object with a list of ranks.
void read_timeline(Run& run) {
  std::error_code ec;
  const std::string timeline = (fs::path(run.dir) / "pipeline_timeline.json").string();
  if (fs::exists(timeline, ec)) {
    std::string json, why;
    if (::shardtrain::detail::read_regular_file(timeline, kMaxMetricsBytes, &json, &why)) {
      run.timeline = ::shardtrain::detail::parse_json_or_discarded(json);
      if (!run.timeline.is_object() || !run.timeline.contains("ranks") || !run.timeline["ranks"].is_array()) {
        run.timeline = nullptr;
      }
    }
  }
}

Run load_run(const std::string& dir) {
  Run run;
  run.dir = dir;
  const std::string text = read_metrics(dir);
  run.name = run_name(dir);

  double skipped_total = 0.0;
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    add_metrics_line(run, line, skipped_total);
  }
  read_config(run);
  read_timeline(run);
  return run;
}

// ---- HTML and SVG ---------------------------------------------------------------------

std::string escape(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (const char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

std::string fmt(const char* format, double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), format, v);
  return buf;
}

// A tick label: short, and exactly 0 where the tick is 0 up to rounding.
std::string tick_label(double v, double step) {
  if (std::fabs(v) < step * 1e-6) return "0";
  const double a = std::fabs(v);
  if (a >= 1e5 || a < 1e-3) return fmt("%.2g", v);
  return fmt("%.6g", v);
}

// 1, 2 or 5 times a power of ten, near span / target.
double nice_step(double span, int target) {
  const double raw = span / target;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double f = raw / mag;
  return (f < 1.5 ? 1.0 : f < 3.0 ? 2.0 : f < 7.0 ? 5.0 : 10.0) * mag;
}

struct Axis {
  double lo, hi, step;
};

// Round bounds around [lo, hi] and a tick step of at least `min_step`; a
// flat range is widened.
Axis make_axis(double lo, double hi, int target, double min_step = 0.0) {
  if (hi - lo <= 1e-12 * std::max(1.0, std::fabs(hi))) {
    const double pad = std::fabs(hi) > 0 ? std::fabs(hi) * 0.1 : 1.0;
    // Counts and sizes never go below 0: widen a flat line upwards only.
    lo = lo >= 0.0 ? std::max(0.0, lo - pad) : lo - pad;
    hi += pad;
  }
  const double step = std::max(min_step, nice_step(hi - lo, target));
  return {std::floor(lo / step) * step, std::ceil(hi / step) * step, step};
}

struct Line {
  std::string label;
  std::string colour;
  bool dashed = false;
  bool markers = false;
  const Points* points = nullptr;
};

const char* const kPalette[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd",
                                "#ff7f0e", "#17becf", "#8c564b", "#e377c2"};
const char* colour(size_t i) { return kPalette[i % (sizeof(kPalette) / sizeof(kPalette[0]))]; }

constexpr double kWidth = 520, kHeight = 290;
constexpr double kLeft = 70, kRight = 16, kTop = 14, kBottom = 44;

// One chart: axes with tick labels, a line per series, an HTML legend.
std::string chart(const std::string& id, const std::string& title, const std::string& y_label,
                  const std::vector<Line>& lines) {
  double x0 = INFINITY, x1 = -INFINITY, y0 = INFINITY, y1 = -INFINITY;
  for (const auto& l : lines) {
    for (const auto& p : *l.points) {
      x0 = std::min(x0, p.x), x1 = std::max(x1, p.x);
      y0 = std::min(y0, p.y), y1 = std::max(y1, p.y);
    }
  }
  std::ostringstream os;
  os << "<figure class=\"chart\" id=\"chart-" << id << "\"><figcaption>" << escape(title)
     << "</figcaption>\n";
  if (!std::isfinite(x0)) {
    os << "<p class=\"missing\">not recorded</p></figure>\n";
    return os.str();
  }
  if (x1 - x0 < 2.0) x0 -= 1.0, x1 += 1.0;  // a step or two: room around them
  const Axis ax = make_axis(x0, x1, 6, /*min_step=*/1.0), ay = make_axis(y0, y1, 5);
  const double pw = kWidth - kLeft - kRight, ph = kHeight - kTop - kBottom;
  const auto sx = [&](double x) { return kLeft + (x - ax.lo) / (ax.hi - ax.lo) * pw; };
  const auto sy = [&](double y) { return kTop + ph - (y - ay.lo) / (ay.hi - ay.lo) * ph; };
  os << "<svg viewBox=\"0 0 " << kWidth << ' ' << kHeight << "\" width=\"" << kWidth
     << "\" height=\"" << kHeight << "\" role=\"img\" aria-label=\"" << escape(title) << "\">\n";
  os << "<rect x=\"" << kLeft << "\" y=\"" << kTop << "\" width=\"" << pw << "\" height=\"" << ph
     << "\" class=\"plot\"/>\n";
  for (int i = 0;; ++i) {
    const double v = ay.lo + i * ay.step;
    if (v > ay.hi + ay.step * 1e-6) break;
    const double y = sy(v);
    os << "<line class=\"grid\" x1=\"" << kLeft << "\" x2=\"" << kLeft + pw << "\" y1=\"" << y
       << "\" y2=\"" << y << "\"/><text class=\"tick\" x=\"" << kLeft - 6 << "\" y=\"" << y + 4
       << "\" text-anchor=\"end\">" << tick_label(v, ay.step) << "</text>\n";
  }
  for (int i = 0;; ++i) {
    const double v = ax.lo + i * ax.step;
    if (v > ax.hi + ax.step * 1e-6) break;
    const double x = sx(v);
    os << "<line class=\"grid\" x1=\"" << x << "\" x2=\"" << x << "\" y1=\"" << kTop << "\" y2=\""
       << kTop + ph << "\"/><text class=\"tick\" x=\"" << x << "\" y=\"" << kTop + ph + 16
       << "\" text-anchor=\"middle\">" << tick_label(v, ax.step) << "</text>\n";
  }
  os << "<text class=\"axis\" x=\"" << kLeft + pw / 2 << "\" y=\"" << kHeight - 6
     << "\" text-anchor=\"middle\">step</text>\n";
  os << "<text class=\"axis\" transform=\"translate(14 " << kTop + ph / 2
     << ") rotate(-90)\" text-anchor=\"middle\">" << escape(y_label) << "</text>\n";
  os.precision(6);
  for (const auto& l : lines) {
    if (l.points->empty()) continue;
    os << "<path class=\"series\" fill=\"none\" stroke=\"" << l.colour << "\" stroke-width=\"2\""
       << (l.dashed ? " stroke-dasharray=\"6 4\"" : "") << " d=\"";
    char op = 'M';
    for (const auto& p : *l.points) {
      os << op << sx(p.x) << ' ' << sy(p.y) << ' ';
      op = 'L';
    }
    os << "\"/>\n";
    if (l.markers || l.points->size() == 1) {
      for (const auto& p : *l.points) {
        os << "<circle cx=\"" << sx(p.x) << "\" cy=\"" << sy(p.y) << "\" r=\"3.5\" fill=\""
           << l.colour << "\"/>";
      }
      os << '\n';
    }
  }
  os << "</svg>\n<div class=\"legend\">";
  for (const auto& l : lines) {
    if (l.points->empty()) continue;
    os << "<span><svg width=\"26\" height=\"10\"><line x1=\"1\" y1=\"5\" x2=\"25\" y2=\"5\" stroke=\""
       << l.colour << "\" stroke-width=\"2\"" << (l.dashed ? " stroke-dasharray=\"5 3\"" : "")
       << "/></svg>" << escape(l.label) << "</span>";
  }
  os << "</div></figure>\n";
  return os.str();
}

const Points kNoPoints;

const Points& series_of(const Run& run, const std::string& key) {
  const auto it = run.series.find(key);
  return it == run.series.end() ? kNoPoints : it->second;
}

// The label of a run's line: its name, with `what` when a chart has several
// lines per run.
std::string label(const std::vector<Run>& runs, const Run& run, const std::string& what) {
  if (runs.size() == 1) return what.empty() ? run.name : what;
  return what.empty() ? run.name : run.name + " " + what;
}

std::string charts(const std::vector<Run>& runs) {
  std::ostringstream os;
  // Train and eval loss share a chart: train solid, eval dashed with markers.
  std::vector<Line> loss;
  for (size_t i = 0; i < runs.size(); ++i) {
    loss.push_back({label(runs, runs[i], "train"), colour(i), false, false, &series_of(runs[i], "loss")});
    loss.push_back({label(runs, runs[i], "eval"), colour(i), true, true, &series_of(runs[i], "eval_loss")});
  }
  os << chart("loss", "Loss (train and eval)", "loss", loss);
  struct Simple {
    const char* key;
    const char* title;
    const char* y_label;
  };
  const Simple simple[] = {
      {"lr", "Learning rate", "lr"},
      {"grad_norm", "Gradient norm (before clipping)", "grad norm"},
      {"loss_scale", "Loss scale", "loss scale"},
      {"skipped", "Skipped steps (overflow, cumulative)", "steps skipped"},
      {"tokens_per_s", "Throughput", "tokens/s"},
  };
  for (const auto& s : simple) {
    std::vector<Line> lines;
    for (size_t i = 0; i < runs.size(); ++i) {
      lines.push_back({label(runs, runs[i], ""), colour(i), false, false, &series_of(runs[i], s.key)});
    }
    os << chart(s.key, s.title, s.y_label, lines);
  }
  // A line per rank; one run colours its ranks, several runs colour by run
  // and tell ranks apart by dashes. Memory falls back to older runs' largest
  // rank; compute time and shares appear for runs that logged them.
  const auto per_rank = [&](const char* key, const char* id, const char* title, const char* y_label,
                            const char* fallback) {
    std::vector<Line> lines;
    for (size_t i = 0; i < runs.size(); ++i) {
      const Run& run = runs[i];
      const auto found = run.ranks.find(key);
      if (found == run.ranks.end()) {
        if (fallback) lines.push_back({label(runs, run, "largest rank"), colour(i), false, false, &series_of(run, fallback)});
        continue;
      }
      for (size_t r = 0; r < found->second.size(); ++r) {
        const bool one = runs.size() == 1;
        lines.push_back({label(runs, run, "rank " + std::to_string(r)), colour(one ? r : i), !one && r > 0, false,
                         &found->second[r]});
      }
    }
    if (!lines.empty()) os << chart(id, title, y_label, lines);
  };
  per_rank("peak_rss_mb_ranks", "peak_rss_mb", "Peak resident memory per rank", "MB", "peak_rss_mb");
  per_rank("compute_s_ranks", "compute_s", "Compute time per rank and step (waits excluded)", "s", nullptr);
  per_rank("shares", "shares", "Share of the batch per data-parallel rank", "share", nullptr);
  std::vector<Line> hidden;
  for (size_t i = 0; i < runs.size(); ++i) {
    hidden.push_back({label(runs, runs[i], ""), colour(i), false, false, &series_of(runs[i], "comm_hidden")});
  }
  os << chart("comm_hidden", "Gradient communication hidden behind compute", "% hidden", hidden);
  return os.str();
}

// One pipeline step as boxes: a row per pipeline rank, time to the right,
// each piece of work a box coloured by kind (forward, backward, its input
// and weight halves) and labelled with its micro-batch. Malformed entries
// are left out.
std::string pipeline_timeline(const Run& run) {
  const nlohmann::json& t = run.timeline;
  const auto& ranks = t["ranks"];
  double end = 0.0;
  for (const auto& spans : ranks) {
    if (!spans.is_array()) continue;
    for (const auto& s : spans) {
      if (s.is_array() && s.size() == 5 && s[4].is_number()) end = std::max(end, s[4].get<double>());
    }
  }
  if (end <= 0.0) return "";
  constexpr int kLeft = 70, kRow = 28, kTop = 10, kPlot = 820;
  const int height = kTop + static_cast<int>(ranks.size()) * kRow + 40;
  const auto x = [&](double seconds) { return kLeft + seconds / end * kPlot; };
  const std::map<std::string, std::pair<const char*, const char*>> kinds = {
      {"F", {"#4e79a7", "forward"}}, {"B", {"#59a14f", "backward"}},
      {"I", {"#8cd17d", "backward, input half"}}, {"W", {"#f28e2b", "backward, weight half"}}};
  std::ostringstream os;
  os << "<h3>" << escape(run.name) << ": step " << number(t, "step") << ", "
     << escape(t.value("schedule", std::string("?"))) << ", " << ranks.size() << " ranks</h3>\n";
  os << "<svg class=\"timeline\" viewBox=\"0 0 " << kLeft + kPlot + 20 << ' ' << height << "\" width=\""
     << kLeft + kPlot + 20 << "\" height=\"" << height << "\">\n";
  for (size_t r = 0; r < ranks.size(); ++r) {
    const int y = kTop + static_cast<int>(r) * kRow;
    os << "<text x=\"4\" y=\"" << y + 17 << "\" font-size=\"12\">rank " << r << "</text>\n";
    if (!ranks[r].is_array()) continue;
    for (const auto& s : ranks[r]) {
      if (!s.is_array() || s.size() != 5 || !s[0].is_string() || !s[2].is_number() || !s[3].is_number() ||
          !s[4].is_number()) {
        continue;
      }
      const auto kind = kinds.find(s[0].get<std::string>());
      if (kind == kinds.end()) continue;
      const double x0 = x(s[3].get<double>()), x1 = x(s[4].get<double>());
      os << "<rect class=\"work\" data-kind=\"" << kind->first << "\" x=\"" << fmt("%.1f", x0) << "\" y=\"" << y
         << "\" width=\"" << fmt("%.1f", std::max(1.0, x1 - x0)) << "\" height=\"" << kRow - 6 << "\" fill=\""
         << kind->second.first << "\"><title>" << kind->second.second << " of micro-batch "
         << s[2].get<int64_t>() << ", stage " << s[1] << "</title></rect>\n";
      if (x1 - x0 >= 14) {
        os << "<text x=\"" << fmt("%.1f", (x0 + x1) / 2 - 4) << "\" y=\"" << y + 15
           << "\" font-size=\"10\" fill=\"#fff\">" << s[2].get<int64_t>() << "</text>\n";
      }
    }
  }
  const int axis = kTop + static_cast<int>(ranks.size()) * kRow + 14;
  os << "<text x=\"" << kLeft << "\" y=\"" << axis << "\" font-size=\"11\">0 ms</text><text x=\""
     << kLeft + kPlot - 50 << "\" y=\"" << axis << "\" font-size=\"11\">" << fmt("%.1f", end * 1e3)
     << " ms</text>\n</svg>\n<div class=\"legend\">";
  for (const auto& [letter, kind] : kinds) {
    os << "<span><svg width=\"14\" height=\"10\"><rect width=\"12\" height=\"10\" fill=\"" << kind.first
       << "\"/></svg>" << kind.second << "</span>";
  }
  os << "</div>\n";
  return os.str();
}

std::string last_value(const Run& run, const std::string& key) {
  const Points& p = series_of(run, key);
  return p.empty() ? "&ndash;" : fmt("%.4f", p.back().y);
}

const char kStyle[] = R"(<style>
body { font-family: sans-serif; margin: 16px; color: #222; background: #fff; }
h1 { font-size: 22px; } h2 { font-size: 18px; margin-top: 28px; }
table { border-collapse: collapse; font-size: 14px; }
td, th { border: 1px solid #ccc; padding: 4px 8px; text-align: left; }
.charts { display: flex; flex-wrap: wrap; gap: 12px; }
figure.chart { margin: 0; padding: 8px; border: 1px solid #ddd; width: 520px; }
figcaption { font-weight: bold; font-size: 14px; margin-bottom: 4px; }
rect.plot { fill: #fafafa; stroke: #888; }
line.grid { stroke: #e3e3e3; }
text.tick { font-size: 11px; fill: #444; } text.axis { font-size: 12px; fill: #222; }
.legend { font-size: 12px; } .legend span { margin-right: 14px; white-space: nowrap; }
.legend svg { vertical-align: middle; margin-right: 4px; }
.missing, .empty { color: #777; font-style: italic; }
pre { background: #f4f4f4; padding: 8px; font-size: 12px; overflow-x: auto; }
</style>)";

}  // namespace

std::string render_report(const std::vector<std::string>& run_dirs) {
  ST_CHECK(!run_dirs.empty(), ConfigError, "no run directory given; give one or more run.dir paths");
  std::vector<Run> runs;
  for (const auto& dir : run_dirs) runs.push_back(load_run(dir));
  // Two runs with the same directory name are told apart by their paths.
  for (auto& a : runs) {
    for (const auto& b : runs) {
      if (&a != &b && a.name == b.name) a.name = a.dir;
    }
  }
  std::string names;
  for (const auto& r : runs) names += (names.empty() ? "" : ", ") + r.name;
  int64_t steps = 0;
  for (const auto& r : runs) steps += r.steps;

  std::ostringstream os;
  os << "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n<title>shardtrain report: "
     << escape(names) << "</title>\n" << kStyle << "</head><body>\n";
  os << "<h1>shardtrain report: " << escape(names) << "</h1>\n";
  os << "<table class=\"runs\"><tr><th>run</th><th>directory</th><th>steps logged</th><th>last loss</th>"
        "<th>last eval loss</th><th>strategy</th><th>world size</th><th>precision</th></tr>\n";
  for (size_t i = 0; i < runs.size(); ++i) {
    const Run& r = runs[i];
    os << "<tr><td><span style=\"color:" << colour(i) << "\">&#9632;</span> " << escape(r.name)
       << "</td><td>" << escape(r.dir) << "</td><td>"
       << (r.steps > 0 ? std::to_string(r.steps) : std::string("no steps logged")) << "</td><td>"
       << last_value(r, "loss") << "</td><td>" << last_value(r, "eval_loss") << "</td><td>"
       << escape(r.strategy) << "</td><td>" << (r.world_size > 0 ? std::to_string(r.world_size) : "")
       << "</td><td>" << escape(r.precision) << "</td></tr>\n";
  }
  os << "</table>\n";
  for (const auto& r : runs) {
    if (r.unreadable > 0) {
      os << "<p class=\"missing\">" << escape(r.name) << ": " << r.unreadable
         << " line(s) of metrics.jsonl could not be read and were left out.</p>\n";
    }
  }
  os << "<h2>Charts</h2>\n";
  if (steps == 0) {
    os << "<p class=\"empty\">no steps logged</p>\n";
  } else {
    os << "<div class=\"charts\">\n" << charts(runs) << "</div>\n";
  }
  std::string timelines;
  for (const auto& r : runs) {
    if (!r.timeline.is_null()) timelines += pipeline_timeline(r);
  }
  if (!timelines.empty()) os << "<h2>Pipeline timeline</h2>\n" << timelines;
  os << "<h2>Configuration</h2>\n";
  for (const auto& r : runs) {
    os << "<h3>" << escape(r.name) << "</h3>\n";
    if (r.config.empty()) {
      os << "<p class=\"missing\">not recorded (no config.yaml and no complete checkpoint)</p>\n";
    } else {
      os << "<p class=\"source\">from " << escape(r.config_source) << "</p>\n<pre class=\"config\">"
         << escape(r.config) << "</pre>\n";
    }
  }
  os << "</body></html>\n";
  return os.str();
}

void write_report(const std::vector<std::string>& run_dirs, const std::string& out) {
  const std::string html = render_report(run_dirs);
  // Through the checkpoints' atomic write (a temporary name, fsync, rename;
  // nothing left behind on failure), reported as what failed here.
  try {
    checkpoint::detail::write_file_atomically(out, html);
  } catch (const Error& e) {
    ST_CHECK(false, IoError, "cannot write the report to '", out, "': ",
             ::shardtrain::detail::one_line_message(e));
  }
}

std::string default_report_path(const std::string& run_dir) {
  return (fs::path(run_dir) / "report.html").string();
}

}  // namespace shardtrain::train
