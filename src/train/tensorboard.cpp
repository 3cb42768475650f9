// TensorBoardWriter: the logged scalars as TensorBoard event files.
//
// An event file is a sequence of TFRecords, each
//   uint64 length (little-endian), uint32 masked CRC32C of those 8 bytes,
//   `length` bytes of data, uint32 masked CRC32C of the data,
// whose data is an Event protocol buffer (proto/tensorboard_event.proto).
// The first record carries only file_version "brain.Event:2".
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>

#include "checkpoint/detail.h"
#include "core/file.h"
#include "shardtrain/core/error.h"
#include "shardtrain/train/callbacks.h"
#include "tensorboard_event.pb.h"
#include "train/series.h"

namespace shardtrain::train {

namespace {

namespace pb = ::shardtrain::tensorboard;

// The metrics of a step line that become scalars under the same names.
constexpr const char* kStepScalars[] = {"loss",     "lr",      "grad_norm",  "tokens_per_s",
                                        "loss_scale", "skipped", "peak_rss_mb"};

// TFRecord's masked CRC: a CRC stored next to the data it covers is rotated
// and offset, so that a CRC of bytes that contain CRCs stays well mixed.
uint32_t masked_crc32c(const void* data, size_t n) {
  const uint32_t crc = ::shardtrain::checkpoint::detail::crc32c(0, data, n);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

void put_le(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xFFu));
}

// One framed record around `data`, appended to `out`.
void append_record(std::string& out, const std::string& data) {
  std::string header;
  put_le(header, data.size(), 8);
  out += header;
  put_le(out, masked_crc32c(header.data(), header.size()), 4);
  out += data;
  put_le(out, masked_crc32c(data.data(), data.size()), 4);
}

double unix_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

void add_scalar(pb::Summary& summary, const std::string& tag, double value) {
  if (!std::isfinite(value)) return;
  auto* v = summary.add_value();
  v->set_tag(tag);
  v->set_simple_value(static_cast<float>(value));
}

std::string framed_event(int64_t step, const pb::Summary& summary) {
  pb::Event event;
  event.set_wall_time(unix_seconds());
  event.set_step(step);
  *event.mutable_summary() = summary;
  std::string out;
  append_record(out, event.SerializeAsString());
  return out;
}

}  // namespace

TensorBoardWriter::~TensorBoardWriter() {
  if (fd_ >= 0) ::close(fd_);
}

void TensorBoardWriter::on_train_begin(TrainerState& state, TrainerControl&) {
  if (state.rank != 0) return;
  const std::filesystem::path dir = std::filesystem::path(state.run_dir) / "tb";
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  ST_CHECK(!ec, IoError, "cannot create '", dir.string(), "' for TensorBoard files: ", ec.message(),
           "; check run.dir, its permissions and free disk space");
  char host[256] = "localhost";
  if (::gethostname(host, sizeof(host) - 1) != 0) std::strcpy(host, "localhost");
  host[sizeof(host) - 1] = '\0';
  const auto seconds = static_cast<long long>(unix_seconds());
  path_ = (dir / ("events.out.tfevents." + std::to_string(seconds) + "." + host + "." +
                  std::to_string(::getpid())))
              .string();
  std::string why;
  fd_ = ::shardtrain::detail::open_regular_for_append(path_, &why);
  ST_CHECK(fd_ >= 0, ConfigError, "cannot open ", path_, " for writing: ", why,
           "; check run.dir and its permissions");
  pb::Event version;
  version.set_wall_time(unix_seconds());
  version.set_file_version("brain.Event:2");
  std::string record;
  append_record(record, version.SerializeAsString());
  append(record);
}

void TensorBoardWriter::append(const std::string& records) {
  ::shardtrain::detail::append_whole(fd_, records, path_, "record");
}

void TensorBoardWriter::on_log(TrainerState& state, TrainerControl&, const Metrics& logs) {
  if (state.rank != 0 || fd_ < 0) return;
  pb::Summary summary;
  for (const char* key : kStepScalars) {
    if (const auto v = logs.number(key)) add_scalar(summary, key, *v);
  }
  for (const auto& [key, value] : logs.entries()) {
    if (key != "peak_rss_mb_ranks") continue;
    if (const auto* ranks = std::get_if<std::vector<double>>(&value)) {
      for (size_t r = 0; r < ranks->size(); ++r) {
        add_scalar(summary, "peak_rss_mb/rank" + std::to_string(r), (*ranks)[r]);
      }
    }
  }
  const auto busy = logs.number("comm_busy_s"), exposed = logs.number("comm_exposed_s");
  if (busy && exposed) add_scalar(summary, "comm_hidden", detail::comm_hidden(*busy, *exposed));
  append(framed_event(static_cast<int64_t>(logs.number("step").value_or(state.step)), summary));
}

void TensorBoardWriter::on_evaluate(TrainerState& state, TrainerControl&, const Metrics& metrics) {
  if (state.rank != 0 || fd_ < 0) return;
  pb::Summary summary;
  if (const auto v = metrics.number("eval_loss")) add_scalar(summary, "eval_loss", *v);
  append(framed_event(static_cast<int64_t>(metrics.number("step").value_or(state.step)), summary));
}

}  // namespace shardtrain::train
