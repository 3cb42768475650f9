// TensorBoard event files written by `shardtrain train`, read back by a
// decoder of this test's own (TFRecord framing, masked CRC32C and protobuf
// wire format written here, sharing no code with the library), and compared
// with metrics.jsonl of the same run.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "shardtrain/train/callback.h"
#include "temp_dir.h"
#include "test_helpers.h"

namespace fs = std::filesystem;
namespace st = shardtrain;

namespace {

// ---- an independent reader ----------------------------------------------------------

// CRC-32C bit by bit (reflected polynomial 0x82F63B78): slow and obvious.
uint32_t crc32c_bitwise(const std::string& bytes) {
  uint32_t crc = 0xFFFFFFFFu;
  for (const unsigned char b : bytes) {
    crc ^= b;
    for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0x82F63B78u & (0u - (crc & 1u)));
  }
  return ~crc;
}

uint32_t masked(uint32_t crc) { return ((crc >> 15) | (crc << 17)) + 0xa282ead8u; }

uint64_t read_le(const std::string& s, size_t at, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(static_cast<unsigned char>(s[at + i])) << (8 * i);
  return v;
}

struct Scalar {
  std::string tag;
  float value = NAN;
};

struct Event {
  double wall_time = 0;
  int64_t step = 0;
  std::string file_version;
  std::vector<Scalar> scalars;
};

// Protobuf wire format: a cursor over one message's bytes.
struct Wire {
  const std::string& s;
  size_t at;
  size_t end;

  bool done() const { return at >= end; }
  uint64_t varint() {
    uint64_t v = 0;
    for (int shift = 0;; shift += 7) {
      if (at >= end || shift > 63) throw std::runtime_error("varint runs past the message");
      const auto b = static_cast<unsigned char>(s[at++]);
      v |= static_cast<uint64_t>(b & 0x7Fu) << shift;
      if ((b & 0x80u) == 0) return v;
    }
  }
  std::string bytes() {
    const uint64_t n = varint();
    if (at + n > end) throw std::runtime_error("length-delimited field runs past the message");
    std::string out = s.substr(at, n);
    at += n;
    return out;
  }
  void skip(int wire_type) {
    if (wire_type == 0) varint();
    else if (wire_type == 1) at += 8;
    else if (wire_type == 2) bytes();
    else if (wire_type == 5) at += 4;
    else throw std::runtime_error("unknown wire type " + std::to_string(wire_type));
  }
};

Scalar parse_value(const std::string& bytes) {
  Scalar v;
  Wire w{bytes, 0, bytes.size()};
  while (!w.done()) {
    const uint64_t key = w.varint();
    const int field = static_cast<int>(key >> 3), type = static_cast<int>(key & 7);
    if (field == 1 && type == 2) {
      v.tag = w.bytes();
    } else if (field == 2 && type == 5) {
      const auto bits = static_cast<uint32_t>(read_le(bytes, w.at, 4));
      std::memcpy(&v.value, &bits, 4);
      w.at += 4;
    } else {
      w.skip(type);
    }
  }
  return v;
}

Event parse_event(const std::string& bytes) {
  Event e;
  Wire w{bytes, 0, bytes.size()};
  while (!w.done()) {
    const uint64_t key = w.varint();
    const int field = static_cast<int>(key >> 3), type = static_cast<int>(key & 7);
    if (field == 1 && type == 1) {
      const uint64_t bits = read_le(bytes, w.at, 8);
      std::memcpy(&e.wall_time, &bits, 8);
      w.at += 8;
    } else if (field == 2 && type == 0) {
      e.step = static_cast<int64_t>(w.varint());
    } else if (field == 3 && type == 2) {
      e.file_version = w.bytes();
    } else if (field == 5 && type == 2) {
      const std::string summary = w.bytes();
      Wire sw{summary, 0, summary.size()};
      while (!sw.done()) {
        const uint64_t k = sw.varint();
        if ((k >> 3) == 1 && (k & 7) == 2) e.scalars.push_back(parse_value(sw.bytes()));
        else sw.skip(static_cast<int>(k & 7));
      }
    } else {
      w.skip(type);
    }
  }
  return e;
}

// Every record of an event file, each CRC checked; throws on any damage.
std::vector<Event> read_event_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  const std::string s((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::vector<Event> events;
  size_t at = 0;
  while (at < s.size()) {
    if (at + 12 > s.size()) throw std::runtime_error("a record header is cut off");
    const std::string header = s.substr(at, 8);
    if (read_le(s, at + 8, 4) != masked(crc32c_bitwise(header))) {
      throw std::runtime_error("length CRC mismatch at byte " + std::to_string(at));
    }
    const uint64_t n = read_le(s, at, 8);
    if (at + 12 + n + 4 > s.size()) throw std::runtime_error("a record is cut off");
    const std::string data = s.substr(at + 12, n);
    if (read_le(s, at + 12 + n, 4) != masked(crc32c_bitwise(data))) {
      throw std::runtime_error("data CRC mismatch at byte " + std::to_string(at));
    }
    events.push_back(parse_event(data));
    at += 12 + n + 4;
  }
  return events;
}

std::map<std::string, float> by_tag(const Event& e) {
  std::map<std::string, float> m;
  for (const auto& s : e.scalars) m[s.tag] = s.value;
  return m;
}

// ---- the tests ------------------------------------------------------------------------

TEST(TensorBoardReader, KnownCrc32c) {
  // The check value of CRC-32C, so the reader itself is right.
  EXPECT_EQ(crc32c_bitwise("123456789"), 0xE3069283u);
}

// A tiny two-rank DDP run with evaluations: one event per logged step and
// per evaluation, after the file_version record, holding the values of
// metrics.jsonl (as floats).
TEST(TensorBoardWriter, EventsMatchMetricsOfARealRun) {
  st::testing::TempDir tmp("shardtrain_tb");
  const std::string run = tmp / "run";
  const std::string src = SHARDTRAIN_SOURCE_DIR;
  const auto r = st::testing::cli(
      "train " + src + "/configs/default.yaml --nproc-per-node 2 --set distributed.strategy=ddp"
      " --set data.train=" + src + "/data/corpus.txt --set trainer.progress=plain"
      " --set trainer.sample_tokens=0 --set model.n_layer=1 --set model.n_head=2"
      " --set model.n_embd=32 --set model.block_size=16 --set batch.global=4 --set batch.micro=2"
      " --set batch.accumulate=null --set distributed.threads_per_rank=1"
      " --set trainer.max_steps=4 --set trainer.eval_every=2 --set trainer.eval_batches=1"
      " --set run.dir=" + run);
  ASSERT_EQ(r.code, 0) << r.out;

  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(run + "/tb")) files.push_back(e.path().filename().string());
  ASSERT_EQ(files.size(), 1u);
  EXPECT_EQ(files[0].rfind("events.out.tfevents.", 0), 0u) << files[0];

  const std::vector<Event> events = read_event_file(run + "/tb/" + files[0]);
  ASSERT_EQ(events.size(), 1u + 4u + 2u);  // version, 4 steps, 2 evaluations
  EXPECT_EQ(events[0].file_version, "brain.Event:2");
  EXPECT_TRUE(events[0].scalars.empty());

  std::vector<nlohmann::json> steps, evals;
  std::ifstream metrics(run + "/metrics.jsonl");
  for (std::string line; std::getline(metrics, line);) {
    const auto row = nlohmann::json::parse(line);
    (row.contains("eval_loss") ? evals : steps).push_back(row);
  }
  ASSERT_EQ(steps.size(), 4u);
  ASSERT_EQ(evals.size(), 2u);

  size_t s = 0, v = 0;
  for (size_t i = 1; i < events.size(); ++i) {
    const Event& e = events[i];
    EXPECT_GT(e.wall_time, 1.5e9);
    const auto tags = by_tag(e);
    if (tags.count("eval_loss")) {
      ASSERT_LT(v, evals.size());
      EXPECT_EQ(e.step, evals[v]["step"].get<int64_t>());
      EXPECT_FLOAT_EQ(tags.at("eval_loss"), static_cast<float>(evals[v]["eval_loss"].get<double>()));
      EXPECT_EQ(tags.size(), 1u);
      ++v;
      continue;
    }
    ASSERT_LT(s, steps.size());
    const auto& row = steps[s++];
    EXPECT_EQ(e.step, row["step"].get<int64_t>());
    for (const char* key : {"loss", "lr", "grad_norm", "tokens_per_s", "loss_scale", "skipped", "peak_rss_mb"}) {
      ASSERT_TRUE(tags.count(key)) << key << " missing at step " << e.step;
      // metrics.jsonl keeps 9 significant digits: equal as floats to an ulp or so.
      EXPECT_FLOAT_EQ(tags.at(key), static_cast<float>(row[key].get<double>())) << key;
    }
    ASSERT_EQ(row["peak_rss_mb_ranks"].size(), 2u);
    for (int rank = 0; rank < 2; ++rank) {
      const std::string tag = "peak_rss_mb/rank" + std::to_string(rank);
      ASSERT_TRUE(tags.count(tag)) << tag;
      EXPECT_FLOAT_EQ(tags.at(tag), static_cast<float>(row["peak_rss_mb_ranks"][rank].get<double>()));
      EXPECT_GT(tags.at(tag), 0.0f);
    }
    EXPECT_EQ(tags.at("peak_rss_mb"), std::max(tags.at("peak_rss_mb/rank0"), tags.at("peak_rss_mb/rank1")));
    const double busy = row["comm_busy_s"].get<double>(), exposed = row["comm_exposed_s"].get<double>();
    ASSERT_GT(busy, 0.0);  // DDP communicates every step
    ASSERT_TRUE(tags.count("comm_hidden"));
    const double hidden = std::min(1.0, std::max(0.0, 1.0 - exposed / busy));
    EXPECT_NEAR(tags.at("comm_hidden"), hidden, 1e-6);  // from 9-digit JSON values
    EXPECT_EQ(tags.size(), 10u);
  }
  EXPECT_EQ(s, 4u);
  EXPECT_EQ(v, 2u);

  // The report is written at the end of every run.
  EXPECT_TRUE(fs::exists(run + "/report.html"));
  EXPECT_NE(r.out.find("report: " + run + "/report.html"), std::string::npos) << r.out;
}

TEST(TensorBoardReader, RejectsADamagedRecord) {
  st::testing::TempDir tmp("shardtrain_tb");
  // A record framed by hand, then one bit flipped in its data.
  const std::string data = "\x1a\x0d" "brain.Event:2";
  std::string rec;
  for (int i = 0; i < 8; ++i) rec.push_back(static_cast<char>((data.size() >> (8 * i)) & 0xFF));
  const uint32_t lc = masked(crc32c_bitwise(rec.substr(0, 8)));
  for (int i = 0; i < 4; ++i) rec.push_back(static_cast<char>((lc >> (8 * i)) & 0xFF));
  rec += data;
  const uint32_t dc = masked(crc32c_bitwise(data));
  for (int i = 0; i < 4; ++i) rec.push_back(static_cast<char>((dc >> (8 * i)) & 0xFF));
  const std::string path = tmp / "events";
  std::ofstream(path, std::ios::binary) << rec;
  EXPECT_EQ(read_event_file(path).at(0).file_version, "brain.Event:2");
  rec[14] ^= 0x01;
  std::ofstream(path, std::ios::binary | std::ios::trunc) << rec;
  EXPECT_THROW(read_event_file(path), std::runtime_error);
}

TEST(MetricsLine, ListsOfNumbers) {
  st::train::Metrics m;
  m.set("step", int64_t{3});
  m.set("peak_rss_mb_ranks", std::vector<double>{301.5, NAN, 298});
  EXPECT_EQ(m.to_json(), "{\"step\": 3, \"peak_rss_mb_ranks\": [301.5, null, 298]}");
  EXPECT_FALSE(m.number("peak_rss_mb_ranks").has_value());
}

}  // namespace
