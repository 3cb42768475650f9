// The built-in callbacks and the metrics line.
#include "shardtrain/train/callbacks.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <sstream>

#include "core/file.h"
#include "launch/progress.h"
#include "shardtrain/core/error.h"

namespace shardtrain::train {

// ---- Metrics ----------------------------------------------------------------------

void Metrics::set(const std::string& key, Value value) {
  for (auto& [k, v] : entries_) {
    if (k == key) {
      v = std::move(value);
      return;
    }
  }
  entries_.emplace_back(key, std::move(value));
}

std::optional<double> Metrics::number(const std::string& key) const {
  for (const auto& [k, v] : entries_) {
    if (k != key) continue;
    if (const auto* d = std::get_if<double>(&v)) return *d;
    if (const auto* i = std::get_if<int64_t>(&v)) return static_cast<double>(*i);
    return std::nullopt;
  }
  return std::nullopt;
}

bool Metrics::contains(const std::string& key) const {
  for (const auto& entry : entries_) {
    if (entry.first == key) return true;
  }
  return false;
}

namespace {

void write_json_string(std::ostringstream& os, const std::string& s) {
  os << '"';
  for (const char c : s) {
    switch (c) {
      case '"': os << "\\\""; break;
      case '\\': os << "\\\\"; break;
      case '\n': os << "\\n"; break;
      case '\t': os << "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          os << buf;
        } else {
          os << c;
        }
    }
  }
  os << '"';
}

// The progress lines are the run's log: a write that fails (stdout
// redirected to a full disk) stops the run with an IoError rather than
// losing lines unnoticed.
void flush_log(FILE* out) {
  errno = 0;
  const bool ok = std::fflush(out) == 0 && !std::ferror(out);
  if (ok) return;
  const std::string err = errno != 0 ? std::strerror(errno) : "write error";
  std::clearerr(out);
  ST_CHECK(false, IoError, "cannot write the progress log: ", err,
           ". Hint: free disk space where the output goes, or set trainer.progress=none");
}

}  // namespace

std::string Metrics::to_json() const {
  std::ostringstream os;
  os.precision(9);
  os << '{';
  bool first = true;
  for (const auto& [key, value] : entries_) {
    if (!first) os << ", ";
    first = false;
    write_json_string(os, key);
    os << ": ";
    const auto number = [&os](double d) {
      if (std::isfinite(d)) os << d; else os << "null";
    };
    if (const auto* d = std::get_if<double>(&value)) {
      number(*d);
    } else if (const auto* i = std::get_if<int64_t>(&value)) {
      os << *i;
    } else if (const auto* list = std::get_if<std::vector<double>>(&value)) {
      os << '[';
      for (size_t k = 0; k < list->size(); ++k) {
        if (k > 0) os << ", ";
        number((*list)[k]);
      }
      os << ']';
    } else {
      write_json_string(os, std::get<std::string>(value));
    }
  }
  os << '}';
  return os.str();
}

// ---- ProgressCallback ---------------------------------------------------------------

ProgressCallback::ProgressCallback(ProgressMode mode, FILE* out) : out_(out) {
  enabled_ = mode != ProgressMode::None;
  // Under a launcher whose output is a terminal, every rank reports to it
  // and the launcher draws the one bar; our own output is a pipe then.
  const char* launcher = std::getenv(dist::kProgressEnv);
  to_launcher_ = (mode == ProgressMode::Auto || mode == ProgressMode::Bar) && launcher &&
                 std::strcmp(launcher, "1") == 0;
  bar_ = !to_launcher_ &&
         (mode == ProgressMode::Bar || (mode == ProgressMode::Auto && isatty(fileno(out))));
}

void ProgressCallback::on_train_begin(TrainerState& state, TrainerControl&) {
  start_ = std::chrono::steady_clock::now();
}

namespace {

// " | shares 0.667/0.333" under measured load balancing (the split the step
// ran with), else "".
std::string shares_text(const Metrics& logs) {
  bool measured = false;
  const std::vector<double>* shares = nullptr;
  for (const auto& [key, value] : logs.entries()) {
    if (key == "load_balance") measured = std::get_if<std::string>(&value) && std::get<std::string>(value) == "measured";
    if (key == "shares") shares = std::get_if<std::vector<double>>(&value);
  }
  if (!measured || shares == nullptr) return "";
  std::string text = " | shares ";
  char one[32];
  for (size_t k = 0; k < shares->size(); ++k) {
    std::snprintf(one, sizeof(one), "%s%.3f", k ? "/" : "", (*shares)[k]);
    text += one;
  }
  return text;
}

}  // namespace

void ProgressCallback::on_log(TrainerState& state, TrainerControl&, const Metrics& logs) {
  if (!enabled_ || (state.rank != 0 && !to_launcher_)) return;
  const double elapsed =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  const double per_step = state.step > 0 ? elapsed / static_cast<double>(state.step) : 0.0;
  const double eta = per_step * static_cast<double>(state.max_steps - state.step);
  const double tokens_per_s = logs.number("tokens_per_s").value_or(0.0);
  using dist::format_duration;
  if (to_launcher_) {
    dist::ProgressReport r;
    r.step = state.step;
    r.max_steps = state.max_steps;
    if (state.rank == 0) {
      r.has_loss = true;
      r.loss = state.loss;
      r.tokens_per_s = tokens_per_s;
      r.eta_s = eta;
    }
    std::fprintf(out_, "%s\n", dist::format_progress_line(r).c_str());
  } else if (bar_) {
    constexpr int kWidth = 24;
    const int filled = state.max_steps > 0
                           ? static_cast<int>(kWidth * state.step / state.max_steps)
                           : kWidth;
    std::string bar(static_cast<size_t>(filled), '#');
    bar.resize(kWidth, '.');
    std::fprintf(out_, "\r[%s] %lld/%lld loss %.4f lr %.2e %.0f tok/s eta %s   ", bar.c_str(),
                 (long long)state.step, (long long)state.max_steps, state.loss, state.lr,
                 tokens_per_s, format_duration(eta).c_str());
  } else {
    std::fprintf(out_, "step %lld/%lld | loss %.4f | lr %.2e | grad_norm %.3f | %.0f tok/s | eta %s%s\n",
                 (long long)state.step, (long long)state.max_steps, state.loss, state.lr,
                 state.grad_norm, tokens_per_s, format_duration(eta).c_str(), shares_text(logs).c_str());
  }
  flush_log(out_);
}

void ProgressCallback::on_evaluate(TrainerState& state, TrainerControl&, const Metrics& metrics) {
  if (!enabled_ || state.rank != 0) return;
  std::fprintf(out_, "%sstep %lld | eval_loss %.4f\n", bar_ ? "\n" : "", (long long)state.step,
               metrics.number("eval_loss").value_or(NAN));
  flush_log(out_);
}

void ProgressCallback::on_train_end(TrainerState& state, TrainerControl&) {
  if (!enabled_ || state.rank != 0) return;
  const double elapsed =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  std::fprintf(out_, "%strained %lld steps in %s\n", bar_ ? "\n" : "", (long long)state.step,
               dist::format_duration(elapsed).c_str());
  flush_log(out_);
}

// ---- MetricsWriter --------------------------------------------------------------------

MetricsWriter::~MetricsWriter() {
  if (fd_ >= 0) ::close(fd_);
}

void MetricsWriter::on_train_begin(TrainerState& state, TrainerControl&) {
  if (state.rank != 0) return;
  std::error_code ec;
  std::filesystem::create_directories(state.run_dir, ec);
  ST_CHECK(!ec, IoError, "cannot create the run directory '", state.run_dir, "': ", ec.message(),
           "; check run.dir, its permissions and free disk space");
  path_ = (std::filesystem::path(state.run_dir) / "metrics.jsonl").string();
  std::string why;
  fd_ = ::shardtrain::detail::open_regular_for_append(path_, &why);
  ST_CHECK(fd_ >= 0, ConfigError, "cannot open ", path_, " for writing: ", why,
           "; check run.dir and its permissions");
}

void MetricsWriter::append_line(const std::string& json) {
  // One line, one write() to a file opened O_APPEND. Should it come short
  // (a full disk), the file is cut back to where it was before the error
  // is raised, so readers never see half a line.
  ::shardtrain::detail::append_whole(fd_, json + '\n', path_, "line");
}

void MetricsWriter::on_step_end(TrainerState& state, TrainerControl&) {
  if (state.rank != 0) return;
  append_line(state.metrics.to_json());
}

void MetricsWriter::on_evaluate(TrainerState& state, TrainerControl&, const Metrics& metrics) {
  if (state.rank != 0) return;
  append_line(metrics.to_json());
}

// ---- LearningRateMonitor --------------------------------------------------------------

void LearningRateMonitor::on_step_end(TrainerState& state, TrainerControl&) {
  for (size_t i = 0; i < state.group_lrs.size(); ++i) {
    state.metrics.set("lr_group" + std::to_string(i), state.group_lrs[i]);
  }
}

// ---- EarlyStopping ----------------------------------------------------------------------

EarlyStopping::EarlyStopping(std::string monitor, int64_t patience, double min_delta,
                             MonitorMode mode)
    : monitor_(std::move(monitor)), patience_(patience), min_delta_(min_delta) {
  ST_CHECK(patience_ >= 1, ConfigError, "trainer.early_stopping.patience ", patience_,
           " must be at least 1");
  maximize_ = mode == MonitorMode::Max;
  best_ = maximize_ ? -INFINITY : INFINITY;
}

void EarlyStopping::on_evaluate(TrainerState&, TrainerControl& control, const Metrics& metrics) {
  const auto value = metrics.number(monitor_);
  ST_CHECK(value.has_value(), ConfigError, "trainer.early_stopping.monitor '", monitor_,
           "' is not an evaluation metric; evaluation reports eval_loss");
  const bool improved = maximize_ ? *value > best_ + min_delta_ : *value < best_ - min_delta_;
  if (improved) {
    best_ = *value;
    wait_ = 0;
  } else if (++wait_ >= patience_) {
    control.should_training_stop = true;
  }
}

}  // namespace shardtrain::train
