// The run report (train::render_report and `shardtrain report`) over run
// directories written by the test: a chart per series, the config, several
// runs overlaid, and the awkward cases (no steps, one point, NaN, a series
// never recorded, a path that is no run directory). The browser test
// (tests/dist/report_browser.sh) renders a real run's page in Chromium.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>

#include "shardtrain/core/error.h"
#include "shardtrain/train/report.h"
#include "temp_dir.h"
#include "test_helpers.h"

namespace fs = std::filesystem;
namespace st = shardtrain;

namespace {

void write(const std::string& path, const std::string& text) {
  fs::create_directories(fs::path(path).parent_path());
  std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
}

// A metrics line as the trainer writes it (the keys the report reads).
std::string step_line(int step, const std::string& loss, double lr = 3e-4, bool with_scale = true) {
  std::string s = "{\"step\": " + std::to_string(step) + ", \"epoch\": 0, \"loss\": " + loss +
                  ", \"lr\": " + std::to_string(lr) + ", \"grad_norm\": 1.5, \"tokens_per_s\": " +
                  std::to_string(1000 + 10 * step) +
                  ", \"peak_rss_mb\": 400, \"peak_rss_mb_ranks\": [390, 400], \"world_size\": 2, "
                  "\"strategy\": \"ddp\", \"comm_busy_s\": 0.2, \"comm_exposed_s\": 0.05, "
                  "\"precision\": \"fp32\"";
  if (with_scale) s += ", \"loss_scale\": 1, \"skipped\": 0";
  return s + "}\n";
}

std::string eval_line(int step, double loss) {
  return "{\"step\": " + std::to_string(step) + ", \"epoch\": 0, \"eval_loss\": " +
         std::to_string(loss) + "}\n";
}

// The text of the figure with id chart-<key>, or "" when there is none.
std::string figure(const std::string& html, const std::string& key) {
  const size_t at = html.find("id=\"chart-" + key + "\"");
  if (at == std::string::npos) return "";
  return html.substr(at, html.find("</figure>", at) - at);
}

size_t count(const std::string& s, const std::string& what) {
  size_t n = 0;
  for (size_t at = s.find(what); at != std::string::npos; at = s.find(what, at + 1)) ++n;
  return n;
}

const char* const kCharts[] = {"loss",         "lr",          "grad_norm",  "loss_scale",
                               "skipped",      "tokens_per_s", "peak_rss_mb", "comm_hidden"};

TEST(Report, OneChartPerSeriesAndTheConfig) {
  st::testing::TempDir tmp("shardtrain_report");
  const std::string run = tmp / "alpha";
  write(run + "/metrics.jsonl", step_line(1, "5.5") + step_line(2, "5.0") + eval_line(2, 5.1) +
                                    step_line(3, "4.5") + eval_line(3, 4.7));
  write(run + "/config.yaml", "model:\n  n_layer: 2   # <small> & fast\n");
  const std::string html = st::train::render_report({run});
  for (const char* key : kCharts) {
    const std::string fig = figure(html, key);
    ASSERT_FALSE(fig.empty()) << key;
    EXPECT_NE(fig.find("<svg"), std::string::npos) << key;
    EXPECT_NE(fig.find("<path class=\"series\""), std::string::npos) << key;
    EXPECT_NE(fig.find("class=\"tick\""), std::string::npos) << key;
  }
  EXPECT_EQ(count(html, "<figure class=\"chart\""), 8u);
  // Two ranks' memory lines, train and eval loss lines.
  EXPECT_EQ(count(figure(html, "peak_rss_mb"), "<path class=\"series\""), 2u);
  EXPECT_EQ(count(figure(html, "loss"), "<path class=\"series\""), 2u);
  // The config, escaped, in a <pre>.
  EXPECT_NE(html.find("<pre class=\"config\">model:\n  n_layer: 2   # &lt;small&gt; &amp; fast\n</pre>"),
            std::string::npos);
  // Self-contained: no link to anything, no script.
  EXPECT_EQ(html.find("http"), std::string::npos);
  EXPECT_EQ(html.find("<script"), std::string::npos);
  EXPECT_EQ(html.find("src="), std::string::npos);
}

TEST(Report, SeveralRunsShareTheCharts) {
  st::testing::TempDir tmp("shardtrain_report");
  const std::string a = tmp / "lr-3e-4", b = tmp / "lr-1e-3";
  write(a + "/metrics.jsonl", step_line(1, "5.5") + step_line(2, "5.0"));
  write(b + "/metrics.jsonl", step_line(1, "5.4", 1e-3) + step_line(2, "4.4", 1e-3) + step_line(3, "4.0", 1e-3));
  const std::string html = st::train::render_report({a, b});
  const std::string loss = figure(html, "loss");
  EXPECT_NE(loss.find("stroke=\"#1f77b4\""), std::string::npos);
  EXPECT_NE(loss.find("stroke=\"#d62728\""), std::string::npos);
  EXPECT_NE(loss.find("lr-3e-4 train"), std::string::npos);
  EXPECT_NE(loss.find("lr-1e-3 train"), std::string::npos);
  EXPECT_EQ(count(figure(html, "lr"), "<path class=\"series\""), 2u);
  EXPECT_EQ(count(figure(html, "peak_rss_mb"), "<path class=\"series\""), 4u);  // 2 runs x 2 ranks
  EXPECT_NE(html.find("<title>shardtrain report: lr-3e-4, lr-1e-3</title>"), std::string::npos);
  // Neither has a config: said, per run.
  EXPECT_EQ(count(html, "not recorded (no config.yaml"), 2u);

  // Through the CLI, to a chosen file.
  const std::string out = tmp / "both.html";
  const auto r = st::testing::cli("report " + a + " " + b + " --out " + out);
  ASSERT_EQ(r.code, 0) << r.out;
  std::ifstream f(out);
  const std::string written((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  EXPECT_EQ(written, html);
  // Default output: the first run's report.html.
  ASSERT_EQ(st::testing::cli("report " + a).code, 0);
  EXPECT_TRUE(fs::exists(a + "/report.html"));
}

TEST(Report, NoStepsOnePointNaNAndMissingSeries) {
  st::testing::TempDir tmp("shardtrain_report");
  const std::string empty = tmp / "empty";
  write(empty + "/metrics.jsonl", "");
  std::string html = st::train::render_report({empty});
  EXPECT_NE(html.find("no steps logged"), std::string::npos);
  EXPECT_EQ(html.find("<svg"), std::string::npos);

  // One step, no loss_scale / skipped keys (an older run): a marker for the
  // lone point, "not recorded" for the missing series.
  const std::string one = tmp / "one";
  write(one + "/metrics.jsonl", step_line(1, "5.5", 3e-4, /*with_scale=*/false));
  html = st::train::render_report({one});
  EXPECT_NE(figure(html, "loss").find("<circle"), std::string::npos);
  EXPECT_NE(figure(html, "loss_scale").find("not recorded"), std::string::npos);
  EXPECT_NE(figure(html, "skipped").find("not recorded"), std::string::npos);
  EXPECT_EQ(count(figure(html, "loss"), "<path class=\"series\""), 1u);  // no evaluation: no eval line

  // A non-finite loss (written as null) and a torn line are left out.
  const std::string nan = tmp / "nan";
  write(nan + "/metrics.jsonl", step_line(1, "5.5") + step_line(2, "null") + "{\"step\": 3, \"lo" +
                                    "\n" + step_line(4, "4.0"));
  html = st::train::render_report({nan});
  const std::string loss = figure(html, "loss");
  EXPECT_EQ(loss.find("nan"), std::string::npos);
  EXPECT_EQ(loss.find("inf"), std::string::npos);
  EXPECT_EQ(count(loss, " L"), 1u);  // two points: M x y L x y
  EXPECT_NE(html.find("1 line(s) of metrics.jsonl could not be read"), std::string::npos);
}

TEST(Report, NotARunDirectory) {
  st::testing::TempDir tmp("shardtrain_report");
  EXPECT_THROW(st::train::render_report({tmp / "nowhere"}), st::ConfigError);
  EXPECT_THROW(st::train::render_report({tmp.path()}), st::ConfigError);  // no metrics.jsonl

  auto r = st::testing::cli("report " + tmp / "nowhere");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("is not a directory"), std::string::npos) << r.out;
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << r.out;
  r = st::testing::cli("report " + tmp.path());
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("has no metrics.jsonl"), std::string::npos) << r.out;
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << r.out;
  EXPECT_EQ(st::testing::cli("report").code, 2);
  EXPECT_EQ(st::testing::cli("report --bogus x").code, 2);

  // An output that cannot be written: an I/O error, exit 3.
  write(tmp / "run/metrics.jsonl", step_line(1, "5.5"));
  r = st::testing::cli("report " + tmp / "run" + " --out " + tmp / "no/such/dir/r.html");
  EXPECT_EQ(r.code, 3) << r.out;
  EXPECT_NE(r.out.find("cannot write the report"), std::string::npos) << r.out;
}

}  // namespace

TEST(Report, ComputeTimeAndSharesPerRank) {
  // Load-balanced runs log each rank's compute seconds and share: a line
  // per rank in two charts of their own.
  st::testing::TempDir tmp("shardtrain_report");
  const std::string run = tmp / "balanced";
  std::string lines;
  for (int step = 1; step <= 3; ++step) {
    std::string line = step_line(step, "5.0");
    line.insert(line.size() - 2, ", \"compute_s_ranks\": [0.1, 0.2], \"shares\": [0.5, 0.5]");
    lines += line;
  }
  write(run + "/metrics.jsonl", lines);
  const std::string html = st::train::render_report({run});
  for (const char* key : {"compute_s", "shares"}) {
    const std::string fig = figure(html, key);
    ASSERT_FALSE(fig.empty()) << key;
    EXPECT_EQ(count(fig, "<path class=\"series\""), 2u) << key;
    EXPECT_NE(fig.find("rank 1"), std::string::npos) << key;
  }
  EXPECT_EQ(count(html, "<figure class=\"chart\""), 10u);
}
