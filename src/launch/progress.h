// Progress through the launcher: when the launcher's standard output is a
// terminal it sets kProgressEnv for its ranks; each rank's ProgressCallback
// then reports its step as one progress line instead of drawing anything,
// and the launcher draws a single bar that updates in place while every
// other line (any rank's, and its own) scrolls above it.
//
// Internal to the library (src/): train/callbacks.cpp writes the lines,
// launch/launcher.cpp reads them.
#pragma once

#include <cstdint>
#include <map>
#include <string>

namespace shardtrain::dist {

/// Set (to "1") in the ranks' environment when the launcher draws the bar.
inline constexpr const char* kProgressEnv = "SHARDTRAIN_PROGRESS_TO_LAUNCHER";

/// What one rank reports after a logged step. Ranks other than 0 report
/// their step only (loss and speed are rank 0's, already global).
struct ProgressReport {
  int64_t step = 0;
  int64_t max_steps = 0;
  double loss = 0.0;
  double tokens_per_s = 0.0;
  double eta_s = -1.0;  // < 0: unknown
  bool has_loss = false;
};

/// The line a rank prints (without its newline).
std::string format_progress_line(const ProgressReport& report);
/// Parses a line format_progress_line wrote; false for any other line.
bool parse_progress_line(const std::string& line, ProgressReport* report);

/// "4m33s", "1h02m", "12s"; "?" for a negative or non-finite value.
std::string format_duration(double seconds);

/// The bar on the launcher's terminal. Inactive (every call just writes)
/// unless `fd` is a terminal.
class ProgressBar {
 public:
  explicit ProgressBar(int fd);
  bool active() const { return active_; }
  /// Records rank `rank`'s report and redraws the bar.
  void update(int rank, const ProgressReport& report);
  /// Writes `text` (whole lines) to `fd` above the bar.
  void print(int fd, const std::string& text);
  /// Ends the bar's line, leaving its last state on the screen; the next
  /// report starts a new bar (after a restart).
  void finish();
  /// The bar's text for a terminal `columns` wide (exposed for tests).
  std::string render(int columns) const;

 private:
  void draw();
  void clear();

  int fd_;
  bool active_ = false;
  bool drawn_ = false;
  ProgressReport lead_;                // rank 0's, or the first reporter's
  std::map<int, int64_t> steps_;       // rank -> last reported step
};

}  // namespace shardtrain::dist
