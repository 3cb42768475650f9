// Sharded checkpoints in one process: the checksum, saving and loading at
// world size 1, resharding between simulated world sizes, torn saves (a
// writer killed with SIGKILL), damaged and foreign inputs, retention, and
// optimizer state.
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "../dist/checkpoint_synthetic.h"
#include "checkpoint/detail.h"
#include "shardtrain/checkpoint/checkpoint.h"
#include "shardtrain/checkpoint/optimizer_state.h"
#include "shardtrain/comm/communicator.h"
#include "shardtrain/core/error.h"
#include "temp_dir.h"
#include "test_helpers.h"

using shardtrain::testing::checkpoint_error;

namespace {

namespace fs = std::filesystem;
namespace ck = shardtrain::checkpoint;
namespace cd = shardtrain::checkpoint::detail;
namespace syn = shardtrain::testing::synthetic;
using shardtrain::CheckpointError;
using shardtrain::strategy::ShardedTensor;

// Each test's files go to its own fresh directory.
struct CheckpointDir : shardtrain::testing::TempDir {
  CheckpointDir() : shardtrain::testing::TempDir("shardtrain_ckpt") {}
};

std::shared_ptr<shardtrain::comm::Communicator> world_of_one() {
  return shardtrain::comm::Communicator::create(
      shardtrain::comm::CommOptions().rank(0).world_size(1));
}

// The per-rank lists a world of `world` holds, with true values.
std::vector<std::vector<ShardedTensor>> all_ranks(int world, int salt) {
  std::vector<std::vector<ShardedTensor>> out;
  for (int r = 0; r < world; ++r) out.push_back(syn::rank_tensors(world, r, salt, true));
  return out;
}

std::vector<std::string> rank_states(int world) {
  std::vector<std::string> out;
  for (int r = 0; r < world; ++r) out.push_back("rng of rank " + std::to_string(r));
  return out;
}

std::string save_world(const std::string& dir, int world, int64_t chunk = 64) {
  return cd::save_ranks_locally(dir, all_ranks(world, 0), "train state", rank_states(world),
                                ck::SaveOptions().strategy("synthetic").step(7).checksum_chunk_bytes(chunk));
}

void flip_byte(const std::string& path, int64_t offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(offset);
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x5A);
  f.seekp(offset);
  f.write(&c, 1);
}


// ---- checksum -------------------------------------------------------------------------

TEST(Crc32c, KnownValuesAndBothImplementationsAgree) {
  const std::string check = "123456789";
  EXPECT_EQ(cd::crc32c(0, check.data(), check.size()), 0xE3069283u);
  EXPECT_EQ(cd::crc32c_software(0, check.data(), check.size()), 0xE3069283u);
  EXPECT_EQ(cd::crc32c(0, nullptr, 0), 0u);
  std::vector<unsigned char> zeros(32, 0);
  EXPECT_EQ(cd::crc32c(0, zeros.data(), zeros.size()), 0x8A9136AAu);  // RFC 3720 B.4
  std::vector<unsigned char> ones(32, 0xFF);
  EXPECT_EQ(cd::crc32c(0, ones.data(), ones.size()), 0x62A8AB43u);
  // Unaligned starts, odd lengths, and streaming in pieces.
  std::vector<unsigned char> data(4099);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<unsigned char>(i * 131 + 7);
  for (size_t start : {0, 1, 3, 7}) {
    const size_t n = data.size() - start;
    const uint32_t whole = cd::crc32c_software(0, data.data() + start, n);
    EXPECT_EQ(cd::crc32c(0, data.data() + start, n), whole);
    uint32_t streamed = 0;
    for (size_t off = 0; off < n; off += 1000) {
      streamed = cd::crc32c(streamed, data.data() + start + off, std::min<size_t>(1000, n - off));
    }
    EXPECT_EQ(streamed, whole);
  }
}

TEST(Crc32c, ChunkedMatchesPieces) {
  std::vector<unsigned char> data(1000);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<unsigned char>(i ^ (i >> 3));
  cd::ChunkedCrc c(64);
  c.update(data.data(), 10);
  c.update(data.data() + 10, 990);
  c.finish();
  ASSERT_EQ(c.chunk_crcs().size(), 16u);  // 15 whole pieces and one of 40 bytes
  EXPECT_EQ(c.file_crc(), cd::crc32c(0, data.data(), data.size()));
  for (size_t i = 0; i < 16; ++i) {
    const size_t n = std::min<size_t>(64, data.size() - i * 64);
    EXPECT_EQ(c.chunk_crcs()[i], cd::crc32c(0, data.data() + i * 64, n));
  }
}

// ---- save and load --------------------------------------------------------------------

TEST(ShardedCheckpoint, SaveAndLoadWithACommunicator) {
  CheckpointDir tmp;
  auto comm = world_of_one();
  const std::string dir = tmp / "ckpt";
  auto tensors = syn::rank_tensors(1, 0, 0, true);
  EXPECT_EQ(ck::save_sharded(dir, *comm, tensors, "blob\0with nul" + std::string(1, '\0'),
                             "rank zero rng", ck::SaveOptions().strategy("single").step(42)),
            dir);
  EXPECT_TRUE(ck::is_complete(dir));
  EXPECT_FALSE(fs::exists(dir + ".tmp"));
  for (const char* f : {"rank-00000.bin", "metadata.json", "train_state.bin", "COMMITTED"}) {
    EXPECT_TRUE(fs::exists(fs::path(dir) / f)) << f;
  }

  auto targets = syn::rank_tensors(1, 0, 1, false);
  const ck::LoadResult r = ck::load_sharded(dir, *comm, targets);
  syn::expect_values(targets, "world 1");
  EXPECT_EQ(r.train_state, "blob\0with nul" + std::string(1, '\0'));
  EXPECT_TRUE(r.rank_state_restored);
  EXPECT_EQ(r.rank_state, "rank zero rng");
  EXPECT_EQ(r.metadata.world_size, 1);
  EXPECT_EQ(r.metadata.strategy, "single");
  EXPECT_EQ(r.metadata.step, 42);

  // The metadata describes every tensor once, with its global shape and dtype.
  const ck::Metadata m = ck::read_metadata(dir);
  EXPECT_EQ(m.tensors.size(), syn::specs().size());
  const ck::TensorInfo* t = m.find_tensor("h.0.attn.c_attn.weight");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->dtype, "BF16");
  EXPECT_EQ(t->shape, std::vector<int64_t>{13});
  EXPECT_EQ(m.find_tensor("mask")->kind, "buffer");
  EXPECT_EQ(m.find_tensor("wte.weight")->kind, "parameter");
}

TEST(ShardedCheckpoint, SavingOverAnExistingCheckpointReplacesIt) {
  CheckpointDir tmp;
  auto comm = world_of_one();
  const std::string dir = tmp / "ckpt";
  auto tensors = syn::rank_tensors(1, 0, 0, true);
  ck::save_sharded(dir, *comm, tensors, "first", "");
  EXPECT_EQ(ck::save_sharded(dir + "/", *comm, tensors, "second", ""), dir);
  EXPECT_EQ(ck::CheckpointReader(dir).train_state(), "second");
  EXPECT_FALSE(fs::exists(dir + ".old"));
  EXPECT_FALSE(fs::exists(dir + ".tmp"));
}

TEST(ShardedCheckpoint, DtypeIsConvertedOnLoad) {
  CheckpointDir tmp;
  save_world(tmp / "ckpt", 2);
  ck::CheckpointReader reader(tmp / "ckpt");
  const auto all = syn::specs();
  std::vector<ShardedTensor> targets(1);
  targets[0].name = "wte.weight";  // stored as F32
  targets[0].global_shape = {7, 5};
  targets[0].local = at::zeros({7, 5}, at::kBFloat16);
  reader.read(targets);
  EXPECT_TRUE(at::equal(targets[0].local, syn::full_value(0, all[0]).to(at::kBFloat16)));
  // A non-contiguous target (a transposed view) is filled in row-major order.
  auto base = at::zeros({5, 7}, at::kFloat);
  targets[0].local = base.t();
  reader.read(targets);
  EXPECT_TRUE(at::equal(base.t(), syn::full_value(0, all[0])));
}

// Write at world A with one slicing, read at world B with another.
TEST(ShardedCheckpoint, ReshardsBetweenAnyWorldSizes) {
  const std::vector<std::pair<int, int>> matrix = {{4, 2}, {2, 3}, {3, 1}, {1, 4}, {3, 3}, {5, 2}};
  for (const auto& [a, b] : matrix) {
    CheckpointDir tmp;
    const std::string dir = save_world(tmp / "ckpt", a);
    ck::CheckpointReader reader(dir);
    EXPECT_EQ(reader.metadata().world_size, a);
    for (int r = 0; r < b; ++r) {
      auto targets = syn::rank_tensors(b, r, 1, false);
      reader.read(targets);
      syn::expect_values(targets, std::to_string(a) + " -> " + std::to_string(b) + " rank " +
                                      std::to_string(r));
      // The same slicing as the save, too.
      if (r < a) {
        auto same = syn::rank_tensors(a, r, 0, false);
        reader.read(same);
        syn::expect_values(same, "same slicing");
      }
    }
    for (int r = 0; r < a; ++r) EXPECT_EQ(reader.rank_state(r), rank_states(a)[r]);
    EXPECT_EQ(reader.rank_state(a), "");
    EXPECT_EQ(reader.train_state(), "train state");
    for (const auto& status : reader.verify_all()) EXPECT_EQ(status, "");
  }
}

TEST(ShardedCheckpoint, EveryElementIsStoredOnce) {
  CheckpointDir tmp;
  const std::string dir = save_world(tmp / "ckpt", 3);
  const ck::Metadata m = ck::read_metadata(dir);
  for (const auto& t : m.tensors) {
    int64_t total = 0;
    for (const auto& s : t.slices) total += s.count;
    EXPECT_EQ(total, t.numel()) << t.name;
  }
  // Whole tensors held by every rank are written by rank 0 only.
  const auto all = syn::specs();
  for (size_t k = 0; k < all.size(); ++k) {
    if (syn::layout_for(k, 0) != syn::Layout::WholeOnRank0 || all[k].shape == std::vector<int64_t>{0})
      continue;
    const auto* t = m.find_tensor(all[k].name);
    if (t->numel() == 0) continue;
    ASSERT_EQ(t->slices.size(), 1u) << t->name;
    EXPECT_EQ(t->slices[0].rank, 0);
  }
}

TEST(ShardedCheckpoint, SaveRejectsBadPrimaryFlagsAndDisagreeingRanks) {
  CheckpointDir tmp;
  auto ranks = all_ranks(2, 0);
  // A whole tensor (rank 0 primary) of several elements: make both ranks primary.
  const auto all = syn::specs();
  size_t whole = 0;
  while (syn::layout_for(whole, 0) != syn::Layout::WholeOnRank0 || all[whole].shape.empty() ||
         syn::full_value(whole, all[whole]).numel() < 2) {
    ++whole;
  }
  auto twice = ranks;
  twice[1][whole].primary = true;
  std::string msg = checkpoint_error([&] { cd::save_ranks_locally(tmp / "a", twice, "", {}); });
  EXPECT_NE(msg.find("primary on two ranks"), std::string::npos) << msg;
  EXPECT_NE(msg.find(all[whole].name), std::string::npos) << msg;

  auto nobody = ranks;
  nobody[0][whole].primary = false;
  msg = checkpoint_error([&] { cd::save_ranks_locally(tmp / "b", nobody, "", {}); });
  EXPECT_NE(msg.find("primary on no rank"), std::string::npos) << msg;

  auto disagree = ranks;
  disagree[1][0].global_shape = {5, 7};
  disagree[1][0].primary = true;
  msg = checkpoint_error([&] { cd::save_ranks_locally(tmp / "c", disagree, "", {}); });
  EXPECT_NE(msg.find("every rank must describe the same model"), std::string::npos) << msg;
  EXPECT_FALSE(ck::is_complete(tmp / "a"));
  EXPECT_FALSE(ck::is_complete(tmp / "b"));
  EXPECT_FALSE(ck::is_complete(tmp / "c"));
}

// ---- damaged and foreign input ----------------------------------------------------------

// What a rank sends rank 0 during a save is the metadata format itself (one
// file, its slices), read back through the same checked from_json and
// validate() as metadata.json; it once had a reader of its own that took a
// slice outside its file or a float count without a word (issue 28, item 13).
TEST(ShardedCheckpoint, RankResultsAreReadThroughTheValidatingReader) {
  cd::RankResult r;
  r.rank = 1;
  r.file.name = cd::rank_file_name(1);
  r.file.rank = 1;
  r.file.bytes = 256;
  r.file.crc32c = 7;
  r.file.chunk_bytes = 1 << 20;
  r.file.chunk_crc32c = {7};
  r.file.rank_state_offset = 200;
  r.file.rank_state_bytes = 56;
  ck::TensorInfo t;
  t.name = "w";
  t.shape = {4, 4};
  t.dtype = "F32";
  t.kind = "parameter";
  t.slices.push_back({1, r.file.name, 8, 8, 64});
  r.tensors.push_back(t);
  ck::TensorInfo replica = t;
  replica.name = "b";
  replica.slices.clear();
  r.tensors.push_back(replica);
  const std::string bytes = cd::rank_result_to_bytes(r);
  const cd::RankResult back = cd::rank_result_from_bytes(bytes);
  EXPECT_EQ(back.rank, 1);
  EXPECT_EQ(back.file.name, r.file.name);
  EXPECT_EQ(back.file.chunk_crc32c, r.file.chunk_crc32c);
  EXPECT_EQ(back.file.rank_state_offset, 200);
  ASSERT_EQ(back.tensors.size(), 2u);
  EXPECT_EQ(back.tensors[0].slices.at(0).byte_offset, 64);
  EXPECT_TRUE(back.tensors[1].slices.empty());

  using Json = nlohmann::ordered_json;
  struct Case {
    std::function<void(Json&)> edit;
    const char* message;
  };
  const std::vector<Case> cases = {
      {[](Json& j) { j["metadata"]["tensors"][0]["slices"][0]["byte_offset"] = 250; }, "outside its file"},
      {[](Json& j) { j["metadata"]["tensors"][0]["slices"][0]["count"] = 3.5; }, "'count' is 3.5"},
      {[](Json& j) { j["metadata"]["tensors"][0]["slices"][0]["offset"] = 12; }, "outside its 16 elements"},
      {[](Json& j) { j["metadata"]["tensors"][0]["slices"][0]["rank"] = 0; }, "has a slice of rank 0"},
      {[](Json& j) { j["metadata"]["files"][0]["chunk_crc32c"] = Json::array(); }, "chunk checksums"},
      {[](Json& j) { j["metadata"]["files"][0]["rank_state_bytes"] = 57; }, "has its rank state"},
      {[](Json& j) { j["metadata"]["tensors"][0]["dtype"] = "F33"; }, "unknown dtype 'F33'"},
      {[](Json& j) { j["metadata"]["tensors"][0]["shape"] = {4.5}; }, "expected a list of whole numbers"},
  };
  for (const Case& c : cases) {
    Json j = Json::parse(bytes);
    c.edit(j);
    const std::string msg = checkpoint_error([&] { cd::rank_result_from_bytes(j.dump()); });
    EXPECT_NE(msg.find(c.message), std::string::npos) << msg;
  }
  // A failed rank sends its error alone.
  cd::RankResult failed;
  failed.rank = 2;
  failed.error = "disk full";
  EXPECT_EQ(cd::rank_result_from_bytes(cd::rank_result_to_bytes(failed)).error, "disk full");
}

TEST(ShardedCheckpoint, FlippedByteIsAChecksumErrorNamingTheFile) {
  CheckpointDir tmp;
  const std::string dir = save_world(tmp / "ckpt", 2);
  const ck::Metadata m = ck::read_metadata(dir);
  // A byte of big.weight's largest slice.
  const ck::TensorInfo* big = m.find_tensor("big.weight");
  const ck::SliceInfo* slice = &big->slices[0];
  for (const auto& s : big->slices) {
    if (s.count > slice->count) slice = &s;
  }
  ASSERT_GT(slice->count, 300);
  const std::string file = (fs::path(dir) / slice->file).string();
  flip_byte(file, slice->byte_offset + 40 * 4 + 1);

  ck::CheckpointReader reader(dir);
  auto targets = syn::rank_tensors(1, 0, 0, false);
  std::string msg = checkpoint_error([&] { reader.read(targets); });
  EXPECT_NE(msg.find("checksum mismatch"), std::string::npos) << msg;
  EXPECT_NE(msg.find(slice->file), std::string::npos) << msg;

  // Only the pieces a load reads are checked: elements far from the damage load.
  std::vector<ShardedTensor> far(1);
  far[0].name = "big.weight";
  far[0].global_shape = {1001};
  far[0].offset = slice->offset + 200;
  far[0].local = at::zeros({50});
  reader.read(far);
  syn::expect_values(far, "far from the flipped byte");

  const auto status = reader.verify_all();
  int bad = 0;
  for (size_t i = 0; i < status.size(); ++i) {
    if (!status[i].empty()) {
      ++bad;
      EXPECT_EQ(m.files[i].name, slice->file);
    }
  }
  EXPECT_EQ(bad, 1);
}

TEST(ShardedCheckpoint, TruncatedMissingAndTamperedFilesAreNamed) {
  CheckpointDir tmp;
  const std::string dir = save_world(tmp / "ckpt", 3);
  const std::string copy = tmp / "copy";

  fs::copy(dir, copy, fs::copy_options::recursive);
  fs::resize_file(fs::path(copy) / "rank-00002.bin", fs::file_size(fs::path(copy) / "rank-00002.bin") - 5);
  std::string msg = checkpoint_error([&] { ck::CheckpointReader r(copy); });
  EXPECT_NE(msg.find("rank-00002.bin"), std::string::npos) << msg;
  EXPECT_NE(msg.find("truncated"), std::string::npos) << msg;

  fs::remove_all(copy);
  fs::copy(dir, copy, fs::copy_options::recursive);
  fs::remove(fs::path(copy) / "rank-00001.bin");
  msg = checkpoint_error([&] { ck::CheckpointReader r(copy); });
  EXPECT_NE(msg.find("rank-00001.bin"), std::string::npos) << msg;
  EXPECT_NE(msg.find("missing"), std::string::npos) << msg;

  fs::remove_all(copy);
  fs::copy(dir, copy, fs::copy_options::recursive);
  fs::remove(fs::path(copy) / "train_state.bin");
  msg = checkpoint_error([&] { ck::CheckpointReader r(copy); });
  EXPECT_NE(msg.find("train_state.bin"), std::string::npos) << msg;

  // metadata.json edited after the commit: its checksum no longer matches.
  fs::remove_all(copy);
  fs::copy(dir, copy, fs::copy_options::recursive);
  {
    std::string text;
    {
      std::ifstream in(fs::path(copy) / "metadata.json");
      text.assign(std::istreambuf_iterator<char>(in), {});
    }
    const auto pos = text.find("\"world_size\": 3");
    ASSERT_NE(pos, std::string::npos);
    text.replace(pos, 15, "\"world_size\": 2");
    std::ofstream(fs::path(copy) / "metadata.json", std::ios::trunc) << text;
  }
  msg = checkpoint_error([&] { ck::CheckpointReader r(copy); });
  EXPECT_NE(msg.find("metadata.json"), std::string::npos) << msg;

  // A rank file of another checkpoint put in place of this one's.
  CheckpointDir other;
  const std::string odir = cd::save_ranks_locally(other / "ckpt", all_ranks(3, 2), "x", {},
                                                  ck::SaveOptions().checksum_chunk_bytes(64));
  fs::remove_all(copy);
  fs::copy(dir, copy, fs::copy_options::recursive);
  fs::copy_file(fs::path(odir) / "rank-00000.bin", fs::path(copy) / "rank-00000.bin",
                fs::copy_options::overwrite_existing);
  msg = checkpoint_error([&] {
    ck::CheckpointReader r(copy);
    auto t = syn::rank_tensors(1, 0, 0, false);
    r.read(t);
  });
  EXPECT_NE(msg.find("rank-00000.bin"), std::string::npos) << msg;
}

TEST(ShardedCheckpoint, ForeignInputIsRejectedClearly) {
  CheckpointDir tmp;
  std::string msg = checkpoint_error([&] { ck::CheckpointReader r(tmp / "nothing-here"); });
  EXPECT_NE(msg.find("does not exist"), std::string::npos) << msg;

  std::ofstream(tmp / "file.bin") << "hello";
  msg = checkpoint_error([&] { ck::CheckpointReader r(tmp / "file.bin"); });
  EXPECT_NE(msg.find("is a file"), std::string::npos) << msg;

  fs::create_directories(tmp / "foreign");
  std::ofstream(tmp / "foreign/weights.pt") << "not ours";
  msg = checkpoint_error([&] { ck::CheckpointReader r(tmp / "foreign"); });
  EXPECT_NE(msg.find("not a shardtrain checkpoint"), std::string::npos) << msg;

  // A foreign COMMITTED and metadata.json.
  std::ofstream(tmp / "foreign/COMMITTED") << "done";
  std::ofstream(tmp / "foreign/metadata.json") << "{\"a\": 1}";
  msg = checkpoint_error([&] { ck::CheckpointReader r(tmp / "foreign"); });
  EXPECT_NE(msg.find("COMMITTED"), std::string::npos) << msg;

  // Valid marker, metadata of another program: checked field by field.
  const std::string other_meta = "{\"format\": \"something-else\"}";
  std::ofstream(tmp / "foreign/metadata.json", std::ios::trunc) << other_meta;
  std::ofstream(tmp / "foreign/COMMITTED", std::ios::trunc)
      << "{\"format\": \"shardtrain-checkpoint\", \"metadata_bytes\": " << other_meta.size()
      << ", \"metadata_crc32c\": " << cd::crc32c(0, other_meta.data(), other_meta.size()) << "}";
  msg = checkpoint_error([&] { ck::CheckpointReader r(tmp / "foreign"); });
  EXPECT_NE(msg.find("not shardtrain checkpoint metadata"), std::string::npos) << msg;

  // Metadata that parses but lies (a slice beyond its file) is refused too.
  save_world(tmp / "real", 1);
  {
    ck::Metadata m = ck::read_metadata(tmp / "real");
    m.tensors[0].slices[0].byte_offset = m.files[0].bytes;
    const std::string text = cd::metadata_to_json(m);
    std::ofstream(tmp / "real/metadata.json", std::ios::trunc) << text;
    std::ofstream(tmp / "real/COMMITTED", std::ios::trunc)
        << "{\"format\": \"shardtrain-checkpoint\", \"metadata_bytes\": " << text.size()
        << ", \"metadata_crc32c\": " << cd::crc32c(0, text.data(), text.size()) << "}";
  }
  msg = checkpoint_error([&] { ck::CheckpointReader r(tmp / "real"); });
  EXPECT_NE(msg.find("outside its file"), std::string::npos) << msg;

  // An incomplete checkpoint (no marker) is refused with a hint.
  save_world(tmp / "torn", 1);
  fs::remove(fs::path(tmp / "torn") / "COMMITTED");
  msg = checkpoint_error([&] { ck::CheckpointReader r(tmp / "torn"); });
  EXPECT_NE(msg.find("incomplete"), std::string::npos) << msg;
}

TEST(ShardedCheckpoint, ModelMismatchNamesTheTensors) {
  CheckpointDir tmp;
  const std::string dir = save_world(tmp / "ckpt", 2);
  auto comm = world_of_one();

  auto targets = syn::rank_tensors(1, 0, 0, false);
  targets[0].global_shape = {5, 7};
  targets[0].local = at::zeros({5, 7});
  ShardedTensor extra;
  extra.name = "h.9.ln_1.weight";
  extra.global_shape = {4};
  extra.local = at::zeros({4});
  targets.push_back(extra);
  std::string msg = checkpoint_error([&] { ck::load_sharded(dir, *comm, targets); });
  EXPECT_NE(msg.find("h.9.ln_1.weight"), std::string::npos) << msg;
  EXPECT_NE(msg.find("wte.weight"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[7, 5]"), std::string::npos) << msg;
  // Nothing was read: shapes and names are checked first.
  EXPECT_TRUE(targets[7].local.isnan().all().item<bool>());

  // strict: a checkpoint parameter the model lacks is an error; not strict: fine.
  auto fewer = syn::rank_tensors(1, 0, 0, false);
  fewer.erase(fewer.begin());
  msg = checkpoint_error([&] { ck::load_sharded(dir, *comm, fewer); });
  EXPECT_NE(msg.find("wte.weight"), std::string::npos) << msg;
  EXPECT_NE(msg.find("does not have"), std::string::npos) << msg;
  ck::load_sharded(dir, *comm, fewer, ck::LoadOptions().strict(false));
  syn::expect_values(fewer, "non-strict subset");

  // Asking for elements past the end.
  auto past = syn::rank_tensors(1, 0, 0, false);
  past[1].name = "big.weight";
  past[1].global_shape = {1001};
  past[1].offset = 1000;
  past[1].local = at::zeros({2});
  msg = checkpoint_error([&] { ck::CheckpointReader(dir).check(past); });
  EXPECT_NE(msg.find("big.weight"), std::string::npos) << msg;
}

// ---- torn saves -------------------------------------------------------------------------

// The child of KilledWriter: started with SHARDTRAIN_CKPT_KILL_RUN set, it
// saves a large checkpoint and stops for good in the middle (the write hook
// creates a flag file and sleeps), waiting for the SIGKILL.
TEST(KilledWriterChild, SaveThenHang) {
  const char* run = std::getenv("SHARDTRAIN_CKPT_KILL_RUN");
  if (!run) GTEST_SKIP() << "only run as the child of KilledWriter";
  const std::string at = std::getenv("SHARDTRAIN_CKPT_KILL_AT");
  const std::string flag = std::string(run) + "/paused";
  cd::set_write_hook([=](const std::string& path, int64_t bytes) {
    const bool stop = at == "rank" ? path.find("rank-00000.bin") != std::string::npos && bytes > (4 << 20)
                                   : path.find("COMMITTED") != std::string::npos;
    if (!stop) return;
    std::ofstream(flag) << "paused";
    for (;;) ::pause();
  });
  auto comm = world_of_one();
  std::vector<ShardedTensor> tensors(1);
  tensors[0].name = "w";
  tensors[0].global_shape = {4 << 20};
  tensors[0].local = at::full({4 << 20}, 2.0f);
  ck::save_sharded(ck::checkpoint_dir(run, 20), *comm, tensors, "step 20", "");
  FAIL() << "the write hook should have stopped the save";
}

void kill_writer_midway(const std::string& at) {
  CheckpointDir run;
  auto comm = world_of_one();
  std::vector<ShardedTensor> tensors(1);
  tensors[0].name = "w";
  tensors[0].global_shape = {4 << 20};
  tensors[0].local = at::full({4 << 20}, 1.0f);
  ck::save_sharded(ck::checkpoint_dir(run.path(), 10), *comm, tensors, "step 10", "");

  const pid_t pid = ::fork();
  if (pid == 0) {
    ::setenv("SHARDTRAIN_CKPT_KILL_RUN", run.path().c_str(), 1);
    ::setenv("SHARDTRAIN_CKPT_KILL_AT", at.c_str(), 1);
    const int devnull = ::open("/dev/null", O_WRONLY);
    ::dup2(devnull, 1);
    ::execl("/proc/self/exe", "test_sharded_checkpoint",
            "--gtest_filter=KilledWriterChild.SaveThenHang", static_cast<char*>(nullptr));
    ::_exit(99);
  }
  ASSERT_GT(pid, 0);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (!fs::exists(run / "paused") && std::chrono::steady_clock::now() < deadline) {
    int status = 0;
    if (::waitpid(pid, &status, WNOHANG) == pid) FAIL() << "the writer exited before pausing";
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_TRUE(fs::exists(run / "paused")) << "the writer never reached the pause point";
  ::kill(pid, SIGKILL);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);

  // The torn step 20 is there but ignored; step 10 loads.
  const std::string torn = at == "rank" ? ck::checkpoint_dir(run.path(), 20) + ".tmp"
                                        : ck::checkpoint_dir(run.path(), 20);
  EXPECT_TRUE(fs::exists(torn)) << torn;
  EXPECT_FALSE(ck::is_complete(ck::checkpoint_dir(run.path(), 20)));
  const auto latest = ck::latest_complete(run.path());
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(latest->step, 10);
  EXPECT_EQ(ck::list_complete(run.path()).size(), 1u);
  std::vector<ShardedTensor> targets(1);
  targets[0].name = "w";
  targets[0].global_shape = {4 << 20};
  targets[0].local = at::zeros({4 << 20});
  const auto r = ck::load_sharded(latest->path, *comm, targets);
  EXPECT_EQ(r.train_state, "step 10");
  EXPECT_TRUE(at::equal(targets[0].local, at::full({4 << 20}, 1.0f)));
  EXPECT_THROW(ck::CheckpointReader{torn}, CheckpointError);

  // prune clears the torn directory and keeps the complete one.
  const auto removed = ck::prune(run.path(), 1);
  ASSERT_EQ(removed.size(), 1u);
  EXPECT_EQ(fs::path(removed[0]).filename(), fs::path(torn).filename());
  EXPECT_TRUE(ck::is_complete(latest->path));
}

TEST(KilledWriter, DuringTheRankFilesThePreviousCheckpointLoads) { kill_writer_midway("rank"); }
TEST(KilledWriter, BeforeTheMarkerThePreviousCheckpointLoads) { kill_writer_midway("commit"); }

// ---- retention --------------------------------------------------------------------------

TEST(Retention, ListsNewestFirstAndPrunes) {
  CheckpointDir run;
  EXPECT_FALSE(ck::latest_complete(run.path()).has_value());
  EXPECT_TRUE(ck::prune(run.path(), 2).empty());
  EXPECT_EQ(ck::checkpoint_dir(run.path(), 120), run / "checkpoints/step-000120");
  EXPECT_EQ(ck::checkpoint_dir(run.path(), 12345678), run / "checkpoints/step-12345678");
  for (int64_t step : {10, 30, 20, 1000000}) save_world(ck::checkpoint_dir(run.path(), step), 1);
  // A torn one (newer than all), a temporary one, and things that are not ours.
  save_world(ck::checkpoint_dir(run.path(), 2000000), 1);
  fs::remove(fs::path(ck::checkpoint_dir(run.path(), 2000000)) / "COMMITTED");
  fs::create_directories(ck::checkpoint_dir(run.path(), 40) + ".tmp");
  fs::create_directories(run / "checkpoints/notes");
  fs::create_directories(run / "checkpoints/step-abc");
  std::ofstream(run / "checkpoints/README") << "keep me";

  auto all = ck::list_complete(run.path());
  ASSERT_EQ(all.size(), 4u);
  EXPECT_EQ(all[0].step, 1000000);
  EXPECT_EQ(all[1].step, 30);
  EXPECT_EQ(all[2].step, 20);
  EXPECT_EQ(all[3].step, 10);
  EXPECT_EQ(ck::latest_complete(run.path())->step, 1000000);

  // Keep two, protect step 10 (say, the best one).
  const auto removed = ck::prune(run.path(), 2, {ck::checkpoint_dir(run.path(), 10)});
  EXPECT_EQ(removed.size(), 3u);  // step 20, the torn step 2000000, the .tmp
  all = ck::list_complete(run.path());
  ASSERT_EQ(all.size(), 3u);
  EXPECT_EQ(all[0].step, 1000000);
  EXPECT_EQ(all[1].step, 30);
  EXPECT_EQ(all[2].step, 10);
  EXPECT_FALSE(fs::exists(ck::checkpoint_dir(run.path(), 2000000)));
  EXPECT_FALSE(fs::exists(ck::checkpoint_dir(run.path(), 40) + ".tmp"));
  EXPECT_TRUE(fs::exists(run / "checkpoints/notes"));
  EXPECT_TRUE(fs::exists(run / "checkpoints/step-abc"));
  EXPECT_TRUE(fs::exists(run / "checkpoints/README"));

  ck::prune(run.path(), 0);
  EXPECT_TRUE(ck::list_complete(run.path()).empty());
}

// A checkpoint linked in from elsewhere (to resume from a shared one) is
// another run's: retention never deletes through a link, nor the link
// (issue 28, item 6).
TEST(Retention, NeverDeletesThroughASymbolicLink) {
  CheckpointDir run, shared;
  save_world(ck::checkpoint_dir(run.path(), 1), 1);
  const std::string theirs = shared / "step-000002";
  save_world(theirs, 1);
  const std::string torn_theirs = shared / "torn";
  fs::create_directories(torn_theirs);
  std::ofstream(fs::path(torn_theirs) / "rank-00000.bin") << "their work in progress";
  fs::create_directory_symlink(theirs, ck::checkpoint_dir(run.path(), 2));
  fs::create_directory_symlink(torn_theirs, ck::checkpoint_dir(run.path(), 5) + ".tmp");
  fs::create_directory_symlink(torn_theirs, ck::checkpoint_dir(run.path(), 6));
  save_world(ck::checkpoint_dir(run.path(), 3), 1);
  // The linked checkpoint is still one to resume from.
  ASSERT_EQ(ck::list_complete(run.path()).size(), 3u);

  const auto removed = ck::prune(run.path(), 1);
  ASSERT_EQ(removed.size(), 1u);  // our own step 1 only
  EXPECT_EQ(removed[0], ck::checkpoint_dir(run.path(), 1));
  EXPECT_TRUE(ck::is_complete(theirs)) << "retention deleted COMMITTED through the link";
  EXPECT_TRUE(fs::exists(fs::path(torn_theirs) / "rank-00000.bin"));
  for (const int64_t step : {2, 6}) EXPECT_TRUE(fs::is_symlink(ck::checkpoint_dir(run.path(), step)));
  EXPECT_TRUE(fs::is_symlink(ck::checkpoint_dir(run.path(), 5) + ".tmp"));
  EXPECT_TRUE(ck::is_complete(ck::checkpoint_dir(run.path(), 3)));
  ck::prune(run.path(), 0);
  EXPECT_TRUE(ck::is_complete(theirs));
}

// ---- optimizer state --------------------------------------------------------------------

struct Net : torch::nn::Module {
  Net() {
    fc = register_module("fc", torch::nn::Linear(6, 5));
    gain = register_parameter("gain", torch::ones({}));
    empty = register_parameter("empty", torch::zeros({0}));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return fc->forward(x) * gain + empty.sum();
  }
  torch::nn::Linear fc{nullptr};
  torch::Tensor gain, empty;
};

std::vector<ShardedTensor> whole_params(torch::nn::Module& m) {
  std::vector<ShardedTensor> out;
  for (const auto& p : m.named_parameters()) {
    ShardedTensor s;
    s.name = p.key();
    s.global_shape = p.value().sizes().vec();
    s.local = p.value();
    out.push_back(s);
  }
  return out;
}

void train_step(Net& net, torch::optim::Optimizer& opt, int seed) {
  torch::manual_seed(seed);
  opt.zero_grad();
  net.forward(torch::randn({3, 6})).pow(2).sum().backward();
  opt.step();
}

template <typename MakeOpt>
void optimizer_round_trip(MakeOpt make_opt) {
  CheckpointDir tmp;
  auto comm = world_of_one();
  torch::manual_seed(0);
  Net a;
  auto opt_a = make_opt(a.parameters());
  train_step(a, *opt_a, 1);
  train_step(a, *opt_a, 2);
  auto params_a = whole_params(a);
  auto tensors = params_a;
  for (auto& e : ck::optimizer_state(*opt_a, params_a)) tensors.push_back(e);
  ck::save_sharded(tmp / "ckpt", *comm, tensors, "", "");

  Net b;
  auto opt_b = make_opt(b.parameters());
  auto params_b = whole_params(b);
  ck::load_sharded(tmp / "ckpt", *comm, params_b);
  ck::load_optimizer_state(tmp / "ckpt", *comm, *opt_b, params_b);
  auto sa = ck::optimizer_state(*opt_a, params_a);
  auto sb = ck::optimizer_state(*opt_b, params_b);
  ASSERT_EQ(sa.size(), sb.size());
  ASSERT_FALSE(sa.empty());
  for (size_t i = 0; i < sa.size(); ++i) {
    EXPECT_EQ(sa[i].name, sb[i].name);
    EXPECT_TRUE(at::equal(sa[i].local, sb[i].local)) << sa[i].name;
  }
  // The same next step from both.
  train_step(a, *opt_a, 3);
  train_step(b, *opt_b, 3);
  for (size_t i = 0; i < params_a.size(); ++i) {
    EXPECT_TRUE(at::equal(params_a[i].local, params_b[i].local)) << params_a[i].name;
  }
}

TEST(OptimizerState, AdamWRoundTripAfterARealStep) {
  optimizer_round_trip([](std::vector<torch::Tensor> p) {
    return std::make_unique<torch::optim::AdamW>(p, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  });
}

TEST(OptimizerState, AdamWWithAmsgradRoundTrip) {
  optimizer_round_trip([](std::vector<torch::Tensor> p) {
    return std::make_unique<torch::optim::AdamW>(p, torch::optim::AdamWOptions(1e-2).amsgrad(true));
  });
}

TEST(OptimizerState, SGDMomentumRoundTripAfterARealStep) {
  optimizer_round_trip([](std::vector<torch::Tensor> p) {
    return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.1).momentum(0.9).dampening(0.1));
  });
}

TEST(OptimizerState, NamesAndStepEntry) {
  Net net;
  torch::optim::AdamW opt(net.parameters());
  auto params = whole_params(net);
  EXPECT_TRUE(ck::optimizer_state(opt, params).empty());  // no step yet: no state
  train_step(net, opt, 1);
  auto st = ck::optimizer_state(opt, params);
  std::set<std::string> names;
  for (const auto& e : st) names.insert(e.name);
  for (const char* n : {"optim.fc.weight.exp_avg", "optim.fc.weight.exp_avg_sq", "optim.fc.weight.step",
                        "optim.gain.exp_avg", "optim.gain.step", "optim.empty.exp_avg"}) {
    EXPECT_TRUE(names.count(n)) << n;
  }
  EXPECT_FALSE(names.count("optim.fc.weight.max_exp_avg_sq"));
  for (const auto& e : st) {
    if (e.name == "optim.fc.weight.step") {
      EXPECT_EQ(e.local.dim(), 0);
      EXPECT_EQ(e.local.item<int64_t>(), 1);
      EXPECT_TRUE(e.global_shape.empty());
    }
  }
  EXPECT_FALSE(names.count("optim.empty.step"));  // no element holds it
  // An optimizer parameter the optimizer does not hold is a usage error.
  auto stranger = params;
  stranger[0].local = torch::zeros_like(stranger[0].local);
  EXPECT_THROW(ck::optimizer_state(opt, stranger), shardtrain::InvalidArgument);
  torch::optim::RMSprop rms(net.parameters());
  EXPECT_THROW(ck::optimizer_state(rms, params), shardtrain::InvalidArgument);
}

// AdamW over 1-D shards at world A, reloaded over other shards at world B.
TEST(OptimizerState, ShardedAdamWReshards) {
  const std::vector<std::vector<int64_t>> shapes = {{7, 3}, {1}, {0}, {}, {10}};
  const auto full_param = [&](size_t k) {
    int64_t n = 1;
    for (auto d : shapes[k]) n *= d;
    return torch::arange(n, torch::kFloat).mul(0.1).add(static_cast<double>(k)).reshape(shapes[k]);
  };
  const auto shard_params = [&](int world, int rank, bool uneven) {
    std::vector<ShardedTensor> out;
    for (size_t k = 0; k < shapes.size(); ++k) {
      const auto full = full_param(k);
      int64_t off, count;
      if (uneven) {
        std::tie(off, count) = syn::uneven_range(full.numel(), world, rank);
      } else {
        const auto r = shardtrain::comm::shard_range(full.numel(), world, rank);
        off = r.offset;
        count = r.count;
      }
      ShardedTensor s;
      s.name = "p" + std::to_string(k);
      s.global_shape = shapes[k];
      s.offset = off;
      s.local = full.reshape({-1}).narrow(0, off, count).clone().requires_grad_(true);
      out.push_back(s);
    }
    return out;
  };
  for (const auto& [a, b] : std::vector<std::pair<int, int>>{{3, 2}, {1, 4}, {4, 1}}) {
    CheckpointDir tmp;
    std::vector<std::vector<ShardedTensor>> saved(a);
    std::vector<std::vector<ShardedTensor>> per_rank(a);
    std::vector<std::unique_ptr<torch::optim::AdamW>> opts;
    for (int r = 0; r < a; ++r) {
      saved[r] = shard_params(a, r, false);
      std::vector<torch::Tensor> locals;
      for (auto& p : saved[r]) locals.push_back(p.local);
      opts.push_back(std::make_unique<torch::optim::AdamW>(locals, torch::optim::AdamWOptions(0.1)));
      for (int step = 0; step < 2; ++step) {
        for (auto& p : saved[r]) {
          p.local.mutable_grad() = p.local.detach().mul(0.5).sub(0.25).sin();
        }
        opts.back()->step();
      }
      per_rank[r] = saved[r];
      for (auto& e : ck::optimizer_state(*opts.back(), saved[r])) per_rank[r].push_back(e);
    }
    const std::string dir = cd::save_ranks_locally(tmp / "ckpt", per_rank, "", {},
                                                   ck::SaveOptions().checksum_chunk_bytes(16));
    // The whole exp_avg / exp_avg_sq of each parameter, from the savers.
    const auto whole_state = [&](size_t k, const char* key) {
      std::vector<torch::Tensor> parts;
      for (int r = 0; r < a; ++r) {
        for (auto& e : ck::optimizer_state(*opts[r], saved[r])) {
          if (e.name == "optim.p" + std::to_string(k) + "." + key) parts.push_back(e.local.reshape({-1}));
        }
      }
      return torch::cat(parts);
    };
    ck::CheckpointReader reader(dir);
    for (int r = 0; r < b; ++r) {
      auto params = shard_params(b, r, true);
      std::vector<torch::Tensor> locals;
      for (auto& p : params) locals.push_back(p.local);
      torch::optim::AdamW opt(locals, torch::optim::AdamWOptions(0.1));
      auto targets = ck::optimizer_state_targets(reader.metadata(), params);
      reader.read(targets);
      ck::set_optimizer_state(opt, params, targets);
      for (const auto& e : ck::optimizer_state(opt, params)) {
        const std::string key = e.name.substr(e.name.rfind('.') + 1);
        const size_t k = std::stoul(e.name.substr(7, e.name.find('.', 7) - 7));
        if (key == "step") {
          EXPECT_EQ(e.local.item<int64_t>(), 2) << e.name;
          continue;
        }
        const auto want = whole_state(k, key.c_str()).narrow(0, e.offset, e.local.numel());
        EXPECT_TRUE(at::equal(e.local.reshape({-1}), want))
            << a << " -> " << b << " rank " << r << " " << e.name;
      }
      // Every non-empty parameter shard has its state, and a zero-element
      // one takes the step of the others.
      auto& state = opt.state();
      for (auto& p : params) {
        auto it = state.find(c10::guts::to_string(p.local.unsafeGetTensorImpl()));
        ASSERT_NE(it, state.end()) << p.name;
        EXPECT_EQ(static_cast<torch::optim::AdamWParamState&>(*it->second).step(), 2) << p.name;
      }
    }
  }
}

}  // namespace

// A save of a step that already has a complete checkpoint moves the old one
// aside with its marker; if the new one never commits (a crash), the aside
// copy stands in for that step, prune keeps it, and the next save of that
// step replaces both.
TEST(Retention, CheckpointMovedAsideStandsInUntilItsReplacementCommits) {
  CheckpointDir run;
  const std::string dir = ck::checkpoint_dir(run.path(), 5);
  save_world(dir, 1);
  // What a crash between "move aside" and "commit" leaves behind.
  fs::rename(dir, dir + ".old");
  fs::create_directories(dir);  // the new one, renamed into place, no marker yet
  std::ofstream(fs::path(dir) / "metadata.json") << "{}";

  auto all = ck::list_complete(run.path());
  ASSERT_EQ(all.size(), 1u);
  EXPECT_EQ(all[0].step, 5);
  EXPECT_EQ(all[0].path, dir + ".old");
  EXPECT_TRUE(ck::prune(run.path(), 1).size() == 1u);  // the torn step-000005 only
  EXPECT_TRUE(ck::is_complete(dir + ".old"));

  save_world(dir, 1);  // the same step again: commits, then drops the aside copy
  all = ck::list_complete(run.path());
  ASSERT_EQ(all.size(), 1u);
  EXPECT_EQ(all[0].path, dir);
  EXPECT_FALSE(fs::exists(dir + ".old"));
}
