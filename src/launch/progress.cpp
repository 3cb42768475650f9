#include "launch/progress.h"

#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <sstream>

namespace shardtrain::dist {

namespace {

// A prefix no ordinary log line starts with.
constexpr const char kPrefix[] = "@shardtrain-progress ";

void write_fd(int fd, const std::string& text) {
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // the terminal went away: nothing else to do with it
    done += static_cast<size_t>(n);
  }
}

int terminal_columns(int fd) {
  struct winsize ws {};
  if (::ioctl(fd, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0) return ws.ws_col;
  return 80;
}

}  // namespace

std::string format_progress_line(const ProgressReport& r) {
  char buf[256];
  if (r.has_loss) {
    std::snprintf(buf, sizeof buf, "%sstep=%lld max=%lld loss=%.6g tok_s=%.6g eta_s=%.6g", kPrefix,
                  static_cast<long long>(r.step), static_cast<long long>(r.max_steps), r.loss,
                  r.tokens_per_s, r.eta_s);
  } else {
    std::snprintf(buf, sizeof buf, "%sstep=%lld max=%lld", kPrefix, static_cast<long long>(r.step),
                  static_cast<long long>(r.max_steps));
  }
  return buf;
}

bool parse_progress_line(const std::string& line, ProgressReport* out) {
  if (line.rfind(kPrefix, 0) != 0) return false;
  std::istringstream in(line.substr(sizeof(kPrefix) - 1));
  ProgressReport r;
  bool step = false, max = false;
  for (std::string field; in >> field;) {
    const size_t eq = field.find('=');
    if (eq == std::string::npos) return false;
    const std::string key = field.substr(0, eq);
    const char* value = field.c_str() + eq + 1;
    char* end = nullptr;
    const double v = std::strtod(value, &end);
    if (end == value || *end != '\0') return false;
    if (key == "step") r.step = static_cast<int64_t>(v), step = true;
    else if (key == "max") r.max_steps = static_cast<int64_t>(v), max = true;
    else if (key == "loss") r.loss = v, r.has_loss = true;
    else if (key == "tok_s") r.tokens_per_s = v;
    else if (key == "eta_s") r.eta_s = v;
  }
  if (!step || !max) return false;
  *out = r;
  return true;
}

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const auto s = static_cast<long long>(seconds + 0.5);
  char buf[32];
  if (s >= 3600) std::snprintf(buf, sizeof(buf), "%lldh%02lldm", s / 3600, s % 3600 / 60);
  else if (s >= 60) std::snprintf(buf, sizeof(buf), "%lldm%02llds", s / 60, s % 60);
  else std::snprintf(buf, sizeof(buf), "%llds", s);
  return buf;
}

ProgressBar::ProgressBar(int fd) : fd_(fd), active_(::isatty(fd) == 1) {}

void ProgressBar::update(int rank, const ProgressReport& report) {
  steps_[rank] = report.step;
  if (report.has_loss || !lead_.has_loss) lead_ = report;
  if (active_) draw();
}

std::string ProgressBar::render(int columns) const {
  const int64_t max = std::max<int64_t>(lead_.max_steps, 1);
  // The slowest rank decides how far the job is.
  int slowest = -1;
  int64_t step = lead_.step;
  for (const auto& [rank, s] : steps_) {
    if (slowest < 0 || s < step) slowest = rank, step = s;
  }
  step = std::clamp<int64_t>(step, 0, max);
  constexpr int kWidth = 24;
  const int filled = static_cast<int>(kWidth * step / max);
  std::string bar(static_cast<size_t>(filled), '#');
  bar.resize(kWidth, '.');
  char buf[512];
  int n = std::snprintf(buf, sizeof buf, "[%s] %lld/%lld %3d%%", bar.c_str(), static_cast<long long>(step),
                        static_cast<long long>(lead_.max_steps), static_cast<int>(100 * step / max));
  std::string text(buf, static_cast<size_t>(std::max(n, 0)));
  if (lead_.has_loss) {
    n = std::snprintf(buf, sizeof buf, " | loss %.4f | %.0f tok/s | eta %s", lead_.loss,
                      lead_.tokens_per_s, format_duration(lead_.eta_s).c_str());
    text.append(buf, static_cast<size_t>(std::max(n, 0)));
  }
  if (steps_.size() > 1) {
    n = std::snprintf(buf, sizeof buf, " | slowest: rank %d at %lld", slowest,
                      static_cast<long long>(steps_.at(slowest)));
    text.append(buf, static_cast<size_t>(std::max(n, 0)));
  }
  // One column short of the width, so the terminal never wraps the line.
  if (columns > 1 && static_cast<int>(text.size()) >= columns) text.resize(static_cast<size_t>(columns - 1));
  return text;
}

void ProgressBar::draw() {
  write_fd(fd_, "\r\x1b[2K" + render(terminal_columns(fd_)));
  drawn_ = true;
}

void ProgressBar::clear() {
  if (drawn_) write_fd(fd_, "\r\x1b[2K");
}

void ProgressBar::print(int fd, const std::string& text) {
  if (!drawn_) return write_fd(fd, text);
  clear();
  write_fd(fd, text);
  draw();
}

void ProgressBar::finish() {
  if (drawn_) write_fd(fd_, "\n");
  drawn_ = false;
  steps_.clear();
  lead_ = ProgressReport();
}

}  // namespace shardtrain::dist
