// safetensors: a round trip through a GPT (with the Conv1D transposes), a
// file assembled byte by byte from the format's specification, every header
// error, the export of a sharded checkpoint, and the `shardtrain checkpoint`
// command.
#include <sys/wait.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "checkpoint/detail.h"
#include "shardtrain/checkpoint/checkpoint.h"
#include "shardtrain/checkpoint/safetensors.h"
#include "shardtrain/comm/communicator.h"
#include "shardtrain/core/error.h"
#include "shardtrain/models/gpt.h"
#include "temp_dir.h"
#include "test_helpers.h"

using shardtrain::testing::cli;
using shardtrain::testing::CliRun;
using shardtrain::testing::checkpoint_error;

namespace {

namespace fs = std::filesystem;
namespace ck = shardtrain::checkpoint;
namespace cd = shardtrain::checkpoint::detail;
using shardtrain::CheckpointError;
using shardtrain::models::GPT;
using shardtrain::models::GPTConfig;
using shardtrain::strategy::ShardedTensor;

// Each test's files go to its own fresh directory.
struct SafetensorsDir : shardtrain::testing::TempDir {
  SafetensorsDir() : shardtrain::testing::TempDir("shardtrain_st") {}
};

GPTConfig tiny_gpt() {
  GPTConfig c;
  c.n_layer = 2;
  c.n_head = 2;
  c.n_embd = 8;
  c.block_size = 6;
  c.vocab_size = 11;
  return c;
}

std::vector<std::pair<std::string, at::Tensor>> named(torch::nn::Module& m) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& p : m.named_parameters()) out.emplace_back(p.key(), p.value());
  return out;
}

void expect_same_parameters(torch::nn::Module& a, torch::nn::Module& b) {
  auto pa = a.named_parameters();
  auto pb = b.named_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (const auto& p : pa) {
    ASSERT_TRUE(pb.contains(p.key())) << p.key();
    EXPECT_TRUE(at::equal(p.value(), pb[p.key()])) << p.key();
  }
}


// ---- files assembled by hand, from the specification --------------------------------------

void put_u64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}

template <typename T>
void put(std::string& out, T v) {
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));  // this machine is little-endian, as the format
  out.append(b, sizeof(T));
}

// 8-byte little-endian N, N bytes of JSON header, data.
std::string st_file(std::string header, const std::string& data, bool pad = true) {
  if (pad) header.append((8 - header.size() % 8) % 8, ' ');
  std::string out;
  put_u64(out, header.size());
  return out + header + data;
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

// A module named like a piece of GPT-2: attn.c_attn (a Linear 2 -> 3 whose
// weight HF stores as [2, 3]), a BF16-stored scale, and an int64 buffer.
struct Piece : torch::nn::Module {
  struct Attn : torch::nn::Module {
    Attn() { c_attn = register_module("c_attn", torch::nn::Linear(2, 3)); }
    torch::nn::Linear c_attn{nullptr};
  };
  Piece() {
    attn = register_module("attn", std::make_shared<Attn>());
    scale = register_parameter("scale", torch::zeros({2}));
    counts = register_buffer("counts", torch::zeros({3}, torch::kLong));
  }
  std::shared_ptr<Attn> attn;
  torch::Tensor scale, counts;
};

std::string piece_file() {
  std::string data;
  // attn.c_attn.weight, [in=2, out=3] row-major: 1 2 3 / 4 5 6 (F32, bytes 0..24)
  for (float v : {1.f, 2.f, 3.f, 4.f, 5.f, 6.f}) put(data, v);
  // attn.c_attn.bias [3] F32 (24..36)
  for (float v : {0.5f, -0.5f, 0.25f}) put(data, v);
  // scale [2] BF16 (36..40): 0x3F80 = 1.0, 0xC040 = -3.0
  put<uint16_t>(data, 0x3F80);
  put<uint16_t>(data, 0xC040);
  // counts [3] I64 (40..64)
  for (int64_t v : {int64_t{7}, int64_t{-8}, int64_t{1} << 40}) put(data, v);
  const std::string header =
      R"({"__metadata__":{"format":"pt","note":"by hand"},)"
      R"("counts":{"dtype":"I64","shape":[3],"data_offsets":[40,64]},)"
      R"("attn.c_attn.weight":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},)"
      R"("scale":{"dtype":"BF16","shape":[2],"data_offsets":[36,40]},)"
      R"("attn.c_attn.bias":{"dtype":"F32","shape":[3],"data_offsets":[24,36]}})";
  return st_file(header, data);
}

TEST(Safetensors, HandWrittenFileFromTheSpecificationLoads) {
  SafetensorsDir tmp;
  write_bytes(tmp / "piece.safetensors", piece_file());
  ck::SafetensorsFile f(tmp / "piece.safetensors");
  ASSERT_EQ(f.entries().size(), 4u);
  EXPECT_EQ(f.metadata().at("note"), "by hand");
  EXPECT_EQ(f.find("scale")->dtype, "BF16");
  EXPECT_TRUE(at::equal(f.read("counts"), torch::tensor({int64_t{7}, int64_t{-8}, int64_t{1} << 40})));

  Piece m;
  ck::load_safetensors_into(m, tmp / "piece.safetensors",
                            ck::SafetensorsLoadOptions().transpose_conv1d(true));
  EXPECT_TRUE(at::equal(m.attn->c_attn->weight, torch::tensor({{1.f, 4.f}, {2.f, 5.f}, {3.f, 6.f}})));
  EXPECT_TRUE(at::equal(m.attn->c_attn->bias, torch::tensor({0.5f, -0.5f, 0.25f})));
  EXPECT_TRUE(at::equal(m.scale, torch::tensor({1.f, -3.f})));  // BF16 -> F32
  EXPECT_TRUE(at::equal(m.counts, torch::tensor({int64_t{7}, int64_t{-8}, int64_t{1} << 40})));

  // Without the transpose the [2, 3] weight does not fit the [3, 2] Linear.
  Piece plain;
  const std::string msg = checkpoint_error([&] { ck::load_safetensors_into(plain, tmp / "piece.safetensors"); });
  EXPECT_NE(msg.find("attn.c_attn.weight"), std::string::npos) << msg;
  EXPECT_NE(msg.find("shape mismatch"), std::string::npos) << msg;
}

TEST(Safetensors, HeaderErrorsAreCheckpointErrors) {
  SafetensorsDir tmp;
  const std::string path = tmp / "bad.safetensors";
  const auto expect_error = [&](const std::string& bytes, const std::string& needle) {
    write_bytes(path, bytes);
    const std::string msg = checkpoint_error([&] { ck::SafetensorsFile f(path); });
    EXPECT_NE(msg.find(needle), std::string::npos) << "want '" << needle << "' in: " << msg;
    EXPECT_NE(msg.find(path), std::string::npos) << msg;
  };
  const std::string four(16, '\0');
  const std::string ok_header = R"({"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}})";
  write_bytes(path, st_file(ok_header, four));
  EXPECT_NO_THROW(ck::SafetensorsFile{path});

  expect_error("abc", "too short");
  // Header length beyond the file, absurdly large, or zero.
  {
    std::string b;
    put_u64(b, 1000);
    expect_error(b + "{}", "declares a header of 1000 bytes");
    b.clear();
    put_u64(b, ~uint64_t{0});
    expect_error(b + "{}", "declares a header");
    b.clear();
    put_u64(b, 0);
    expect_error(b + "{}", "declares a header of 0 bytes");
  }
  expect_error(st_file("not json at all!", four), "not valid JSON");
  expect_error(st_file("[1, 2, 3]", ""), "not a JSON object");
  // Offsets beyond the data, truncated data, inconsistent sizes, gaps, overlaps.
  expect_error(st_file(R"({"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}})", std::string(12, '\0')),
               "beyond the 12 bytes of data");
  expect_error(st_file(R"({"a":{"dtype":"F32","shape":[2,2],"data_offsets":[100,116]}})", four),
               "beyond");
  expect_error(st_file(R"({"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,12]}})", four),
               "needs 16");
  expect_error(st_file(R"({"a":{"dtype":"F32","shape":[2,2],"data_offsets":[16,0]}})", four),
               "begin must be");
  expect_error(st_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", four.substr(0, 8)),
               "contiguous");
  expect_error(st_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                       R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                       std::string(12, '\0')),
               "must not overlap");
  expect_error(st_file(ok_header, four + "extra!!!"), "bytes of data after the header");
  // Unknown dtypes and malformed entries.
  expect_error(st_file(R"({"a":{"dtype":"F8_E4M3","shape":[4],"data_offsets":[0,4]}})", std::string(4, '\0')),
               "unknown dtype 'F8_E4M3'");
  expect_error(st_file(R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", std::string(4, '\0')),
               "impossible shape");
  expect_error(st_file(R"({"a":{"dtype":"F32","shape":[1]}})", std::string(4, '\0')), "needs dtype");
  expect_error(st_file(R"({"a":{"dtype":7,"shape":[1],"data_offsets":[0,4]}})", std::string(4, '\0')),
               "malformed");
  expect_error(st_file(R"({"__metadata__":{"k":1}})", ""), "not a string");
}

TEST(Safetensors, GPTRoundTripWithConv1DTransposes) {
  SafetensorsDir tmp;
  torch::manual_seed(3);
  GPT a(tiny_gpt());
  ck::save_safetensors(tmp / "gpt.safetensors", named(*a), /*transpose_conv1d=*/true,
                       {{"format", "pt"}});
  ck::SafetensorsFile f(tmp / "gpt.safetensors");
  // HF's layout: Conv1D weights [in, out]; everything else as ours.
  EXPECT_EQ(f.find("h.0.attn.c_attn.weight")->shape, (std::vector<int64_t>{8, 24}));
  EXPECT_EQ(f.find("h.1.mlp.c_fc.weight")->shape, (std::vector<int64_t>{8, 32}));
  EXPECT_EQ(f.find("h.1.mlp.c_proj.weight")->shape, (std::vector<int64_t>{32, 8}));
  EXPECT_EQ(f.find("h.0.attn.c_proj.weight")->shape, (std::vector<int64_t>{8, 8}));
  EXPECT_EQ(f.find("wte.weight")->shape, (std::vector<int64_t>{11, 8}));
  EXPECT_TRUE(at::equal(f.read("h.0.attn.c_attn.weight"), a->h[0]->named_parameters()["attn.c_attn.weight"].t()));
  EXPECT_EQ(f.metadata().at("format"), "pt");

  // The header is padded with spaces so the data starts 8-byte aligned.
  std::ifstream in(tmp / "gpt.safetensors", std::ios::binary);
  uint64_t n = 0;
  in.read(reinterpret_cast<char*>(&n), 8);
  EXPECT_EQ(n % 8, 0u);

  torch::manual_seed(4);
  GPT b(tiny_gpt());
  ck::load_safetensors_into(*b, tmp / "gpt.safetensors",
                            ck::SafetensorsLoadOptions().transpose_conv1d(true));
  expect_same_parameters(*a, *b);

  // Without transposes both ways, too.
  ck::save_safetensors(tmp / "plain.safetensors", named(*a));
  GPT c(tiny_gpt());
  ck::load_safetensors_into(*c, tmp / "plain.safetensors");
  expect_same_parameters(*a, *c);
}

TEST(Safetensors, MissingUnexpectedAndMismatchedNamesAreListed) {
  SafetensorsDir tmp;
  GPT a(tiny_gpt());
  auto tensors = named(*a);
  tensors.erase(tensors.begin() + 3);  // one missing
  const std::string gone = named(*a)[3].first;
  tensors.emplace_back("h.0.attn.gate", torch::ones({1, 1, 6, 6}));  // not in the model
  ck::save_safetensors(tmp / "x.safetensors", tensors, true);
  GPT b(tiny_gpt());
  std::string msg = checkpoint_error([&] {
    ck::load_safetensors_into(*b, tmp / "x.safetensors", ck::SafetensorsLoadOptions().transpose_conv1d(true));
  });
  EXPECT_NE(msg.find(gone), std::string::npos) << msg;
  EXPECT_NE(msg.find("h.0.attn.gate"), std::string::npos) << msg;

  GPTConfig wider = tiny_gpt();
  wider.vocab_size = 12;
  GPT w(wider);
  ck::save_safetensors(tmp / "w.safetensors", named(*w), true);
  msg = checkpoint_error([&] {
    ck::load_safetensors_into(*b, tmp / "w.safetensors", ck::SafetensorsLoadOptions().transpose_conv1d(true));
  });
  EXPECT_NE(msg.find("wte.weight (file [12, 8], model [11, 8])"), std::string::npos) << msg;

  // Hugging Face GPT-2 files carry attention masks (h.N.attn.bias and
  // .masked_bias): a GPT-2 import (transpose_conv1d) skips them even when strict.
  tensors = named(*a);
  tensors.emplace_back("h.0.attn.bias", torch::ones({1, 1, 6, 6}));
  tensors.emplace_back("h.0.attn.masked_bias", torch::ones({}));
  ck::save_safetensors(tmp / "masks.safetensors", tensors, true);
  ck::load_safetensors_into(*b, tmp / "masks.safetensors", ck::SafetensorsLoadOptions().transpose_conv1d(true));
  expect_same_parameters(*a, *b);

  // strict(false) ignores any extra tensors.
  tensors = named(*a);
  tensors.emplace_back("h.0.attn.bias", torch::ones({1, 1, 6, 6}));
  ck::save_safetensors(tmp / "hf.safetensors", tensors, true);
  ck::load_safetensors_into(*b, tmp / "hf.safetensors",
                            ck::SafetensorsLoadOptions().transpose_conv1d(true).strict(false));
  expect_same_parameters(*a, *b);
}

// A GPT saved sharded over 3 simulated ranks, with optimizer-like extras.
std::string save_sharded_gpt(GPT& model, const std::string& dir) {
  const int world = 3;
  std::vector<std::vector<ShardedTensor>> per_rank(world);
  for (const auto& p : model->named_parameters()) {
    for (int r = 0; r < world; ++r) {
      const auto range = shardtrain::comm::shard_range(p.value().numel(), world, r);
      ShardedTensor s;
      s.name = p.key();
      s.global_shape = p.value().sizes().vec();
      s.offset = range.offset;
      s.local = p.value().detach().reshape({-1}).narrow(0, range.offset, range.count).clone();
      per_rank[r].push_back(s);
      s.name = "optim." + p.key() + ".exp_avg";
      s.is_parameter = false;
      per_rank[r].push_back(s);
    }
  }
  return cd::save_ranks_locally(dir, per_rank, "state", {},
                                ck::SaveOptions().strategy("fsdp/full_shard").step(120));
}

TEST(Safetensors, ConsolidateAShardedCheckpoint) {
  SafetensorsDir tmp;
  torch::manual_seed(5);
  GPT a(tiny_gpt());
  const std::string dir = save_sharded_gpt(a, tmp / "step-000120");
  EXPECT_EQ(ck::consolidate_to_safetensors(dir, tmp / "model.safetensors"),
            static_cast<int64_t>(a->named_parameters().size()));
  ck::SafetensorsFile f(tmp / "model.safetensors");
  EXPECT_EQ(f.find("optim.wte.weight.exp_avg"), nullptr);  // parameters and buffers only
  EXPECT_EQ(f.find("h.1.attn.c_attn.weight")->shape, (std::vector<int64_t>{8, 24}));
  EXPECT_EQ(f.metadata().at("step"), "120");
  GPT b(tiny_gpt());
  ck::load_safetensors_into(*b, tmp / "model.safetensors",
                            ck::SafetensorsLoadOptions().transpose_conv1d(true));
  expect_same_parameters(*a, *b);
  // A failed export leaves no file behind.
  fs::remove(fs::path(dir) / "rank-00001.bin");
  EXPECT_THROW(ck::consolidate_to_safetensors(dir, tmp / "broken.safetensors"), CheckpointError);
  EXPECT_FALSE(fs::exists(tmp / "broken.safetensors"));
  EXPECT_FALSE(shardtrain::testing::temporary_left_beside(tmp / "broken.safetensors"));
}

// ---- the command ------------------------------------------------------------------------


TEST(CheckpointCommand, InspectConsolidateAndList) {
  SafetensorsDir tmp;
  torch::manual_seed(6);
  GPT a(tiny_gpt());
  const std::string run = tmp / "run";
  const std::string dir = save_sharded_gpt(a, ck::checkpoint_dir(run, 120));

  CliRun r = cli("checkpoint inspect " + dir);
  EXPECT_EQ(r.code, 0) << r.out;
  for (const char* want : {"format version  1", "world size      3", "strategy        fsdp/full_shard",
                           "step            120", "training state  5 bytes",
                           "h.0.attn.c_attn.weight", "[24, 8]", "F32", "3 slices, ranks 0-2",
                           "optim.wte.weight.exp_avg", "rank-00002.bin", "train_state.bin", "ok"}) {
    EXPECT_NE(r.out.find(want), std::string::npos) << "want '" << want << "' in:\n" << r.out;
  }
  // A run directory means its newest complete checkpoint.
  r = cli("checkpoint inspect " + run + " --no-verify");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("step-000120"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("not verified"), std::string::npos) << r.out;

  r = cli("checkpoint list " + run);
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("120"), std::string::npos) << r.out;

  r = cli("checkpoint consolidate " + dir + " --out " + (tmp / "model.safetensors"));
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("wrote"), std::string::npos) << r.out;
  GPT b(tiny_gpt());
  ck::load_safetensors_into(*b, tmp / "model.safetensors",
                            ck::SafetensorsLoadOptions().transpose_conv1d(true));
  expect_same_parameters(*a, *b);

  // Links planted at the output and its old temporary name are replaced
  // or left alone, never written through (issue 47, item 4).
  const std::string linked = tmp / "linked.safetensors";
  const shardtrain::testing::PlantedLinks planted(linked);
  r = cli("checkpoint consolidate " + dir + " --out " + linked);
  EXPECT_EQ(r.code, 0) << r.out;
  planted.expect_intact();
  GPT d(tiny_gpt());
  ck::load_safetensors_into(*d, linked, ck::SafetensorsLoadOptions().transpose_conv1d(true));
  expect_same_parameters(*a, *d);

  r = cli("checkpoint consolidate " + dir + " --no-transpose --out " + (tmp / "ours.safetensors"));
  EXPECT_EQ(r.code, 0) << r.out;
  GPT c(tiny_gpt());
  ck::load_safetensors_into(*c, tmp / "ours.safetensors");
  expect_same_parameters(*a, *c);

  // Damage: inspect names the file and exits with the checkpoint error code.
  {
    std::fstream f(fs::path(dir) / "rank-00001.bin", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(200);
    f.put('\x7f');
  }
  r = cli("checkpoint inspect " + dir);
  EXPECT_EQ(r.code, 3) << r.out;
  EXPECT_NE(r.out.find("DAMAGED"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("rank-00001.bin"), std::string::npos) << r.out;
  r = cli("checkpoint consolidate " + dir + " --out " + (tmp / "bad.safetensors"));
  EXPECT_EQ(r.code, 3) << r.out;
  EXPECT_NE(r.out.find("checksum mismatch"), std::string::npos) << r.out;

  // Foreign input and usage errors.
  r = cli("checkpoint inspect " + (tmp / "model.safetensors"));
  EXPECT_EQ(r.code, 3) << r.out;
  EXPECT_NE(r.out.find("is a file"), std::string::npos) << r.out;
  r = cli("checkpoint consolidate " + dir);
  EXPECT_EQ(r.code, 2) << r.out;
  r = cli("checkpoint frobnicate " + dir);
  EXPECT_EQ(r.code, 2) << r.out;
  r = cli("checkpoint --help");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("consolidate"), std::string::npos) << r.out;
}

}  // namespace
