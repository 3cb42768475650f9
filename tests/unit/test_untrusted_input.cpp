// Values that parse but are wrong, and files that are not what they claim:
// each is refused with a typed error that names it, never accepted, wrapped,
// truncated or waited on.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <future>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "../dist/checkpoint_synthetic.h"
#include "checkpoint/detail.h"
#include "core/file.h"
#include "shardtrain/checkpoint/checkpoint.h"
#include "shardtrain/checkpoint/safetensors.h"
#include "shardtrain/comm/communicator.h"
#include "shardtrain/config/config.h"
#include "shardtrain/core/error.h"
#include "shardtrain/data/jsonl.h"
#include "shardtrain/data/samples.h"
#include "shardtrain/data/tokenizer.h"
#include "shardtrain/data/tokens.h"
#include "shardtrain/models/family.h"
#include "shardtrain/models/mlp.h"
#include "shardtrain/train/callbacks.h"
#include "shardtrain/train/plan.h"
#include "shardtrain/train/task.h"
#include "shardtrain/train/trainer.h"
#include "temp_dir.h"
#include "test_helpers.h"

namespace {

namespace fs = std::filesystem;
namespace ck = shardtrain::checkpoint;
namespace cd = shardtrain::checkpoint::detail;
using shardtrain::CheckpointError;
using shardtrain::ConfigError;
using shardtrain::config::Config;
using shardtrain::testing::TempDir;

#undef EXPECT_HAS  // each test file defines its own (the unit tests build as one unity target)
#define EXPECT_HAS(msg, part) \
  EXPECT_NE((msg).find(part), std::string::npos) << "missing \"" << (part) << "\" in: " << (msg)

// The message of the ConfigError that parse() throws; fails the test if none.
std::string config_error(const std::string& yaml, const std::vector<std::string>& overrides = {}) {
  try {
    Config::parse(yaml, overrides, "test.yaml");
  } catch (const ConfigError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no ConfigError for:\n" << yaml;
  return "";
}

// ---- duplicate keys ------------------------------------------------------------------

TEST(UntrustedConfig, DuplicateKeysAreAnErrorNamingBothLines) {
  std::string msg = config_error("optimizer:\n  lr: 1.0e-3\n  name: adamw\n  lr: -5\n");
  EXPECT_HAS(msg, "test.yaml:4: optimizer.lr");
  EXPECT_HAS(msg, "line 2 and at line 4");
  // A whole section twice, flow style, and a key under a nested section.
  msg = config_error("model:\n  n_layer: 1\nrun:\n  seed: 3\nmodel:\n  n_head: 2\n");
  EXPECT_HAS(msg, "model: the key is written twice, at line 1 and at line 5");
  msg = config_error("optimizer: {lr: 0.1, lr: 0.2}\n");
  EXPECT_HAS(msg, "optimizer.lr");
  msg = config_error("trainer:\n  early_stopping:\n    patience: 2\n    patience: 3\n");
  EXPECT_HAS(msg, "trainer.early_stopping.patience");
  EXPECT_HAS(msg, "line 3 and at line 4");
  // Overrides on top of a file with a repeated key do not hide it.
  msg = config_error("checkpoint:\n  keep: 1\n  keep: 2\n", {"checkpoint.keep=3"});
  EXPECT_HAS(msg, "checkpoint.keep");
}

// ---- integers that would be narrowed -------------------------------------------------

TEST(UntrustedConfig, IntegersAreRangeCheckedBeforeNarrowing) {
  struct Case {
    std::string yaml, got, expected;
  };
  const std::vector<Case> cases = {
      // keep becomes an int for prune(): 2^32 wrapped to 0 and deleted everything.
      {"checkpoint: {keep: 4294967296}", "checkpoint.keep: got 4294967296", "0..1000000"},
      {"checkpoint: {keep: -1}", "checkpoint.keep: got -1", "0..1000000"},
      {"distributed: {threads_per_rank: 2147483648}",
       "distributed.threads_per_rank: got 2147483648", "0..1024"},
      {"distributed: {nproc_per_node: 99999999999}",
       "distributed.nproc_per_node: got 99999999999", "1..65536"},
      // int keys: beyond 32 bits is not an int at all.
      {"loss_scaler: {hysteresis: 4294967297}", "loss_scaler.hysteresis: got '4294967297'",
       "[1, 2^31)"},
      {"loss_scaler: {initial_scale_power: 4294967296}",
       "loss_scaler.initial_scale_power: got '4294967296'", "[-2^31, 2^31)"},
      // int64 keys: beyond 64 bits is refused, not saturated.
      {"trainer: {max_steps: 99999999999999999999}", "trainer.max_steps: got '99999999999999999999'",
       "[1, 2^63)"},
  };
  for (const Case& c : cases) {
    const std::string msg = config_error(c.yaml);
    EXPECT_HAS(msg, c.got);
    EXPECT_HAS(msg, c.expected);
  }
  // The same through --set.
  const std::string msg = config_error("", {"checkpoint.keep=4294967296"});
  EXPECT_HAS(msg, "--set 'checkpoint.keep=4294967296'");
  // The bounds themselves are fine.
  EXPECT_NO_THROW(Config::parse("checkpoint: {keep: 1000000}\ndistributed: {threads_per_rank: 1024, "
                                "nproc_per_node: 65536, strategy: ddp}\n"));
}

// ---- models that cannot fit ------------------------------------------------------------

std::string fits_error(const std::vector<std::string>& overrides) {
  const Config config = Config::parse("", overrides, "test.yaml");
  try {
    shardtrain::train::make_task(config, 1);
  } catch (const ConfigError& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "not a ConfigError: " << e.what();
    return "";
  }
  ADD_FAILURE() << "no ConfigError for a model that cannot fit";
  return "";
}

// (Not n_layer 10^12: without the check its blocks would be allocated one by
// one until the machine runs out of memory, instead of failing at once.)
TEST(UntrustedConfig, ModelsThatCannotFitAreRefusedWithTheirBytes) {
  const std::string data = "data.train=" + std::string(SHARDTRAIN_SOURCE_DIR) + "/data/corpus.txt";
  for (const std::vector<std::string>& o : std::vector<std::vector<std::string>>{
           {data, "model.n_embd=1000000000000"},
           {data, "model.vocab_size=1099511627776"},
           {data, "model.block_size=1099511627776"},
           {"model.type=mlp", "model.mlp_sizes=[1000000000, 1000000000]"}}) {
    const std::string msg = fits_error(o);
    EXPECT_HAS(msg, "cannot fit in memory");
    EXPECT_HAS(msg, "bytes");
    EXPECT_HAS(msg, "available (MemAvailable");
  }
  // The default model fits, and a budget set on purpose is what is compared.
  const Config defaults = Config::parse("", {}, "test.yaml");
  EXPECT_NO_THROW(shardtrain::train::check_model_fits(defaults, 1, 1));
  const Config tight = Config::parse("distributed: {memory_budget_mb: 0.001}", {}, "test.yaml");
  try {
    shardtrain::train::check_model_fits(tight, 1, 1);
    ADD_FAILURE() << "a model larger than memory_budget_mb passed";
  } catch (const ConfigError& e) {
    EXPECT_HAS(std::string(e.what()), "distributed.memory_budget_mb");
  }
}

// check_model_fits' ConfigError message for `config`, or "" when it fits.
std::string fits_message(const Config& config, int world_size, int local_world_size) {
  try {
    shardtrain::train::check_model_fits(config, world_size, local_world_size);
    return std::string();
  } catch (const ConfigError& e) {
    return std::string(e.what());
  }
}

// A model read from files is built deferred: a rank holds only what its
// strategy keeps, so a model whose fp32 weights exceed a rank's memory is
// refused when drawn from nothing or kept whole, and passes sharded over four
// ranks or as a quantized LoRA base.
TEST(UntrustedConfig, AModelReadFromFilesNeedsOnlyWhatARankKeeps) {
  Config c = Config::parse("distributed: {strategy: fsdp}", {}, "test.yaml");
  const auto& family = shardtrain::models::family_of(c.model.type);
  const double params = family.num_parameters(c.model);
  const double act = family.activation_bytes(c.model, shardtrain::train::estimate_micro_batch(c, 4), 4);
  // Twice a quarter of the fp32 weights: a full_shard rank's share fits, the whole does not.
  c.distributed.memory_budget_mb((2.0 * params + act) / (1024.0 * 1024.0));
  const auto fits = [](const Config& config) { return fits_message(config, 4, 4); };
  EXPECT_HAS(fits(c), "fp32 weights");  // drawn from nothing: whole on every rank
  c.model.init_from = "/models/base";
  EXPECT_EQ(fits(c), "");  // read from files: a quarter per rank
  c.distributed.strategy(shardtrain::strategy::StrategyKind::Ddp);
  EXPECT_HAS(fits(c), "fp32 weights");  // ddp keeps the whole model
  c.lora.r(8).quantize(shardtrain::models::LoraQuantize::Nf4);
  EXPECT_EQ(fits(c), "");  // nf4 codes and scales: about an eighth
  c.distributed.memory_budget_mb(0.01);
  EXPECT_HAS(fits(c), "nf4 base weights");
}

// Tensor-parallel ranks read only their blocks of a model from files, and
// under sequence parallelism hold 1/tp of its activations: a model whose
// whole fp32 weights exceed a rank's memory passes at tp 4 when read from
// files, and is still refused when drawn from nothing (drawn whole on every
// rank before it is split).
TEST(UntrustedConfig, TensorParallelRanksReadOnlyTheirBlocks) {
  Config c = Config::parse("distributed: {strategy: ddp, tensor_parallel: 4}", {}, "test.yaml");
  const auto& family = shardtrain::models::family_of(c.model.type);
  const double params = family.num_parameters(c.model);
  const double act = family.activation_bytes(c.model, shardtrain::train::estimate_micro_batch(c, 1), 4);
  // Half the whole fp32 weights plus a quarter of the activations.
  c.distributed.memory_budget_mb((2.0 * params + act / 4.0 + 1.0) / (1024.0 * 1024.0));
  // One data-parallel rank, four per host.
  const auto fits = [](const Config& config) { return fits_message(config, 1, 4); };
  EXPECT_HAS(fits(c), "fp32 weights");  // drawn from nothing: whole on every rank
  c.model.init_from = "/models/base";
  EXPECT_EQ(fits(c), "");  // read from files: a quarter per rank
  c.distributed.tensor_parallel(2);
  EXPECT_HAS(fits(c), "1/2 tensor-parallel blocks");  // half the weights: over the budget
}

// ---- FIFOs and other files that are not regular -------------------------------------

// Runs `fn`, which must refuse the FIFO at `fifo` with ErrorType. A plain
// open() of a FIFO waits for its other end: after 10 s the test opens both
// ends, releasing it, and fails.
template <class ErrorType, class Fn>
std::string refused_at_once(const std::string& fifo, Fn fn) {
  auto result = std::async(std::launch::async, [&]() -> std::string {
    try {
      fn();
    } catch (const ErrorType& e) {
      return e.what();
    } catch (const std::exception& e) {
      return std::string("WRONG TYPE: ") + e.what();
    }
    return "NO ERROR";
  });
  if (result.wait_for(std::chrono::seconds(10)) == std::future_status::timeout) {
    ADD_FAILURE() << "blocked on the FIFO " << fifo;
    const int reader = ::open(fifo.c_str(), O_RDONLY | O_NONBLOCK);  // releases a writer
    const int writer = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);  // releases a reader
    if (writer >= 0) ::close(writer);                                // whose reads then end
    result.wait();
    if (reader >= 0) ::close(reader);
  }
  const std::string msg = result.get();
  EXPECT_EQ(msg.find("WRONG TYPE"), std::string::npos) << msg;
  EXPECT_NE(msg, "NO ERROR");
  EXPECT_HAS(msg, "FIFO");
  return msg;
}

TEST(UntrustedFiles, FifosAreRefusedNotWaitedOn) {
  TempDir tmp;
  const std::string fifo = tmp / "pipe";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);

  // data.train
  std::string msg = refused_at_once<ConfigError>(fifo, [&] { shardtrain::data::TokenSource::open(fifo); });
  EXPECT_HAS(msg, "data.train");
  // the config file itself
  refused_at_once<ConfigError>(fifo, [&] { Config::load(fifo); });
  // model.init_from (a safetensors file) and `generate --checkpoint x.safetensors`
  refused_at_once<CheckpointError>(fifo, [&] { ck::SafetensorsFile f(fifo); });
  refused_at_once<CheckpointError>(fifo, [&] {
    shardtrain::models::MLP mlp(std::vector<int64_t>{2, 3});
    ck::load_safetensors_into(*mlp, fifo);
  });

  // Files found in a checkpoint directory: the marker, the metadata and a
  // rank file, each replaced by a FIFO.
  const auto make_checkpoint = [&](const std::string& dir) {
    cd::save_ranks_locally(dir, {{}}, "state", {"rng"}, ck::SaveOptions().step(1));
  };
  for (const char* name : {cd::kCommitFile, cd::kMetadataFile, "rank-00000.bin"}) {
    const std::string dir = tmp / (std::string("ckpt-") + name);
    make_checkpoint(dir);
    const std::string victim = (fs::path(dir) / name).string();
    fs::remove(victim);
    ASSERT_EQ(::mkfifo(victim.c_str(), 0600), 0);
    refused_at_once<CheckpointError>(victim, [&] {
      ck::CheckpointReader reader(dir, /*check_files=*/false);
      reader.rank_state(0);
    });
    refused_at_once<CheckpointError>(victim, [&] { ck::CheckpointReader reader(dir); });
  }

  // metrics.jsonl found as a FIFO in the run directory.
  const std::string run = tmp / "run";
  fs::create_directories(run);
  const std::string metrics = (fs::path(run) / "metrics.jsonl").string();
  ASSERT_EQ(::mkfifo(metrics.c_str(), 0600), 0);
  refused_at_once<ConfigError>(metrics, [&] {
    shardtrain::train::MetricsWriter writer;
    shardtrain::train::TrainerState state;
    shardtrain::train::TrainerControl control;
    state.run_dir = run;
    writer.on_train_begin(state, control);
  });
}

// ---- safetensors headers ----------------------------------------------------------------

// A safetensors file with `header` and `data`.
std::string st_file(const TempDir& tmp, const std::string& header, const std::string& data) {
  const std::string path = tmp / "x.safetensors";
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>(n >> (8 * i)));
  out << header << data;
  return path;
}

TEST(UntrustedFiles, SafetensorsShapesAndOffsetsMustBeWholeNumbers) {
  TempDir tmp;
  const std::string eight(8, '\0');
  for (const char* header : {
           R"({"a":{"dtype":"F32","shape":[2.9],"data_offsets":[0,8]}})",
           R"({"a":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})",
           R"({"a":{"dtype":"F32","shape":[true, 2],"data_offsets":[0,8]}})",
           R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8.5]}})",
           R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0.0,8]}})",
           R"({"a":{"dtype":"F32","shape":["2"],"data_offsets":[0,8]}})",
           R"({"a":{"dtype":"F32","shape":[18446744073709551615],"data_offsets":[0,8]}})"}) {
    const std::string path = st_file(tmp, header, eight);
    const std::string msg = shardtrain::testing::checkpoint_error([&] { ck::SafetensorsFile f(path); });
    EXPECT_HAS(msg, "whole numbers");
  }
  // The same tensor with integer fields reads.
  const std::string ok = st_file(tmp, R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", eight);
  EXPECT_NO_THROW(ck::SafetensorsFile f(ok));
}

// ---- the command line -------------------------------------------------------------------

using shardtrain::testing::cli;

TEST(UntrustedCli, CountsBeyondTheirTypeAreRefused) {
  // 99999999999 once wrapped to 1215752191 ranks.
  for (const std::string args : {"train --nproc-per-node 99999999999",
                                 "train --nproc-per-node=99999999999",
                                 "launch --nproc-per-node 99999999999 -- true",
                                 "launch --nnodes 4294967297 -- true",
                                 "launch --master-port 4294967296 -- true",
                                 "estimate --nproc-per-node 99999999999"}) {
    const auto r = cli(args);
    EXPECT_EQ(r.code, 2) << args << ":\n" << r.out;
    EXPECT_HAS(r.out, "configuration error");
  }
  const auto r = cli("train " + std::string(SHARDTRAIN_SOURCE_DIR) + "/configs/default.yaml"
                     " --set distributed.strategy=single --set distributed.threads_per_rank=2147483648");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_HAS(r.out, "distributed.threads_per_rank: got 2147483648");
}

// A raw LibTorch error that reaches main (here: sampling from a model whose
// one step at a learning rate of 1e30 made its logits overflow, so that
// multinomial refuses the NaNs) is one line; its backtrace only with
// SHARDTRAIN_DEBUG=1.
TEST(UntrustedCli, RawLibTorchErrorsAreOneLineWithTheBacktraceBehindDebug) {
  TempDir tmp;
  const std::string src = SHARDTRAIN_SOURCE_DIR;
  const auto trained = cli("train " + src + "/configs/default.yaml --set run.dir=" + tmp.path() +
                           " --set data.train=" + src + "/data/corpus.txt" +
                           " --set distributed.strategy=single --set trainer.max_steps=1"
                           " --set trainer.eval_every=0 --set trainer.sample_tokens=0"
                           " --set model.n_layer=1 --set model.n_embd=32 --set model.n_head=2"
                           " --set model.block_size=16 --set batch.global=2 --set batch.micro=2"
                           " --set batch.accumulate=null --set model.vocab_size=240"
                           " --set optimizer.lr=1e30 --set schedule.warmup_steps=0");
  ASSERT_EQ(trained.code, 0) << trained.out;
  // A prompt byte beyond the vocabulary (255 >= 240) is bad input, not an
  // index error inside LibTorch.
  const auto beyond = cli("generate --checkpoint " + tmp.path() + " --prompt \"$(printf '\\377')\"");
  EXPECT_EQ(beyond.code, 2) << beyond.out;
  EXPECT_HAS(beyond.out, "the prompt holds token 255 but the model's vocabulary has 240 tokens");
  const std::string generate =
      "generate --checkpoint " + tmp.path() + " --prompt x --max-new-tokens 2";
  const auto plain = cli(generate);
  EXPECT_EQ(plain.code, 1) << plain.out;
  EXPECT_HAS(plain.out, "shardtrain generate: LibTorch error: ");
  EXPECT_HAS(plain.out, "SHARDTRAIN_DEBUG=1 shows the backtrace");
  EXPECT_EQ(plain.out.find("frame #"), std::string::npos) << plain.out;
  EXPECT_EQ(plain.out.find("Exception raised from"), std::string::npos) << plain.out;
  // The error is the last line and the only one after the source line.
  const size_t error_at = plain.out.find("shardtrain generate:");
  EXPECT_EQ(plain.out.find('\n', error_at), plain.out.size() - 1) << plain.out;

  ::setenv("SHARDTRAIN_DEBUG", "1", 1);
  const auto debug = cli(generate);
  ::unsetenv("SHARDTRAIN_DEBUG");
  EXPECT_EQ(debug.code, 1) << debug.out;
  EXPECT_HAS(debug.out, "Exception raised from");
}

// ---- checkpoint metadata: inspect refuses what load refuses ------------------------------

using Json = nlohmann::ordered_json;

// Rewrites `dir`'s metadata through `edit` and commits it again (a marker
// with the new checksum), as a tool or an attacker could.
template <class Edit>
void rewrite_metadata(const std::string& dir, Edit edit) {
  const std::string path = (fs::path(dir) / cd::kMetadataFile).string();
  std::ifstream in(path);
  Json j = Json::parse(in);
  edit(j);
  const std::string text = j.dump(1) + "\n";
  std::ofstream(path, std::ios::trunc) << text;
  std::ofstream((fs::path(dir) / cd::kCommitFile).string(), std::ios::trunc)
      << "{\"format\": \"shardtrain-checkpoint\", \"metadata_bytes\": " << text.size()
      << ", \"metadata_crc32c\": " << cd::crc32c(0, text.data(), text.size()) << "}";
}

Json& tensor(Json& j, const std::string& name) {
  for (auto& t : j["tensors"]) {
    if (t["name"] == name) return t;
  }
  throw std::runtime_error("no tensor " + name);
}

TEST(UntrustedCheckpoint, InspectAndLoadRefuseTheSameDamagedMetadata) {
  namespace syn = shardtrain::testing::synthetic;
  constexpr int64_t k2to62 = int64_t{1} << 62;
  struct Case {
    const char* what;
    std::function<void(Json&)> edit;
    const char* message;
  };
  const std::vector<Case> cases = {
      {"a tensor with no stored data", [](Json& j) { tensor(j, "wte.weight")["slices"] = Json::array(); },
       "stores no data for elements 0..34 of 35 (no data at all)"},
      {"a tensor missing its last element",
       [](Json& j) {
         auto& last = tensor(j, "big.weight")["slices"].back();
         last["count"] = last["count"].get<int64_t>() - 1;
       },
       "stores no data for elements 1000..1000"},
      {"a rank-state range whose offset + size overflows",
       [=](Json& j) {
         j["files"][0]["rank_state_offset"] = k2to62;
         j["files"][0]["rank_state_bytes"] = k2to62;
       },
       "has its rank state"},
      {"a float in a shape", [](Json& j) { tensor(j, "wte.weight")["shape"] = {7.5, 5}; },
       "expected a list of whole numbers"},
      {"a float slice count", [](Json& j) { tensor(j, "wte.weight")["slices"][0]["count"] = 3.0; },
       "'count' is 3.0"},
      {"a world size beyond int", [](Json& j) { j["world_size"] = 4294967298LL; },
       "'world_size' is 4294967298"},
      {"a rank beyond int", [](Json& j) { j["files"][1]["rank"] = 4294967297LL; },
       "'rank' is 4294967297"},
      {"a world size of 2^31-1 with three files", [](Json& j) { j["world_size"] = 2147483647; },
       "lists only 3 files"},
      {"a file size whose chunk count overflows",
       [](Json& j) { j["files"][0]["bytes"] = std::numeric_limits<int64_t>::max(); },
       "chunk checksums"},
      {"a negative checksum", [](Json& j) { j["files"][0]["chunk_crc32c"][0] = -1; },
       "not a 32-bit checksum"},
  };
  TempDir tmp;
  auto comm = shardtrain::comm::Communicator::create(
      shardtrain::comm::CommOptions().rank(0).world_size(1));
  int n = 0;
  for (const Case& c : cases) {
    const std::string dir = tmp / ("ckpt" + std::to_string(n++));
    std::vector<std::vector<shardtrain::strategy::ShardedTensor>> ranks;
    for (int r = 0; r < 2; ++r) ranks.push_back(syn::rank_tensors(2, r, 0, true));
    cd::save_ranks_locally(dir, ranks, "state", {"rng of rank 0", "rng of rank 1"},
                           ck::SaveOptions().step(3));
    rewrite_metadata(dir, c.edit);
    // load: every rank asks for its tensors; the checkpoint is refused first.
    auto targets = syn::rank_tensors(1, 0, 1, false);
    const std::string load = shardtrain::testing::checkpoint_error(
        [&] { ck::load_sharded(dir, *comm, targets); });
    EXPECT_HAS(load, c.message) << c.what;
    // inspect: the same refusal, exit 3.
    const auto inspect = cli("checkpoint inspect " + dir);
    EXPECT_EQ(inspect.code, 3) << c.what << ":\n" << inspect.out;
    EXPECT_HAS(inspect.out, c.message) << c.what;
  }
}

// JSON nested a million deep parsed, then crashed the process (SIGSEGV) in
// the message that showed it. Every reader bounds the depth first and shows
// hostile values cut short (issue 28, item 5).
std::string deep_list(int depth) { return std::string(depth, '[') + std::string(depth, ']'); }

TEST(UntrustedFiles, DeeplyNestedJsonIsRefusedNotACrash) {
  TempDir tmp;
  const std::string deep = deep_list(1000000);
  // A safetensors header, read by the library and by `lora merge`.
  const std::string st = st_file(tmp, R"({"a":{"dtype":"F32","shape":)" + deep + R"(,"data_offsets":[0,8]}})",
                                 std::string(8, '\0'));
  std::string msg = shardtrain::testing::checkpoint_error([&] { ck::SafetensorsFile f(st); });
  EXPECT_HAS(msg, "deeper than 64 levels");
  EXPECT_LT(msg.size(), 500u);
  fs::create_directories(tmp / "adapter");
  std::ofstream(tmp / "adapter/adapter_config.json") << R"({"peft_type": "LORA", "r": )" + deep_list(100) + "}";
  auto merge = cli("lora merge --base " + st + " --adapter " + tmp / "adapter" + " --out " + tmp / "m.safetensors");
  EXPECT_EQ(merge.code, 3) << merge.out;
  EXPECT_HAS(merge.out, "deeper than 64 levels");
  // Checkpoint metadata, read by every load and by `checkpoint inspect`.
  namespace syn = shardtrain::testing::synthetic;
  const std::string dir = tmp / "ckpt";
  std::vector<std::vector<shardtrain::strategy::ShardedTensor>> ranks;
  for (int r = 0; r < 2; ++r) ranks.push_back(syn::rank_tensors(2, r, 0, true));
  cd::save_ranks_locally(dir, ranks, "state", {"rng of rank 0", "rng of rank 1"}, ck::SaveOptions().step(3));
  rewrite_metadata(dir, [](Json& j) { tensor(j, "wte.weight")["shape"] = "DEEP"; });
  {
    const std::string path = (fs::path(dir) / cd::kMetadataFile).string();
    std::ifstream in(path);
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    text.replace(text.find("\"DEEP\""), 6, deep);
    std::ofstream(path, std::ios::trunc) << text;
    std::ofstream((fs::path(dir) / cd::kCommitFile).string(), std::ios::trunc)
        << "{\"format\": \"shardtrain-checkpoint\", \"metadata_bytes\": " << text.size()
        << ", \"metadata_crc32c\": " << cd::crc32c(0, text.data(), text.size()) << "}";
  }
  const auto inspect = cli("checkpoint inspect " + dir);
  EXPECT_EQ(inspect.code, 3) << inspect.out.substr(0, 2000);
  EXPECT_HAS(inspect.out, "deeper than 64 levels");
  EXPECT_LT(inspect.out.size(), 1000u);
  // A model's config.json (model.init_from).
  fs::create_directories(tmp / "hf");
  std::ofstream(tmp / "hf/config.json") << R"({"model_type": "gpt2", "n_layer": )" + deep + "}";
  msg = config_error("model: {init_from: " + tmp / "hf" + "}\n");
  EXPECT_HAS(msg, "deeper than 64 levels");
  // Shapes that are long rather than deep are shown cut short.
  std::string long_list = "[1.5";
  for (int i = 0; i < 100000; ++i) long_list += ", 1.5";
  const std::string wide = st_file(tmp, R"({"a":{"dtype":"F32","shape":)" + long_list +
                                            R"(],"data_offsets":[0,8]}})", std::string(8, '\0'));
  msg = shardtrain::testing::checkpoint_error([&] { ck::SafetensorsFile f(wide); });
  EXPECT_HAS(msg, "...");
  EXPECT_LT(msg.size(), 500u);
  // And so are names and dtypes a megabyte long.
  const std::string long_name = st_file(tmp, "{\"" + std::string(1 << 20, 'n') + "\":{\"dtype\":\"" +
                                                 std::string(1 << 20, 'F') + "\",\"shape\":[2],\"data_offsets\":[0,8]}}",
                                        std::string(8, '\0'));
  msg = shardtrain::testing::checkpoint_error([&] { ck::SafetensorsFile f(long_name); });
  EXPECT_HAS(msg, "unknown dtype 'FFFF");
  EXPECT_LT(msg.size(), 500u);
}

// A training state (train_state.bin) without its step: a CheckpointError
// naming the checkpoint, not a raw JSON exception.
TEST(UntrustedCheckpoint, DamagedTrainingStateIsACheckpointError) {
  TempDir tmp;
  Config c;
  c.run.dir = tmp / "run";
  c.model.type = shardtrain::train::ModelType::Mlp;
  c.model.mlp_sizes = {4, 8, 2};
  c.batch.global = 4;
  c.batch.micro = 4;
  c.batch.accumulate.reset();
  c.trainer.max_steps = 1;
  c.trainer.eval_every = 0;
  c.trainer.progress = shardtrain::train::ProgressMode::None;
  auto comm = shardtrain::comm::Communicator::create(
      shardtrain::comm::CommOptions().rank(0).world_size(1));
  {
    shardtrain::train::Trainer t(c, shardtrain::train::make_task(c, 1), comm);
    t.fit();
  }
  // The same tensors again, with a training state that lacks "step".
  const std::string good = ck::checkpoint_dir(c.run.dir, 1);
  const std::string bad = tmp / "bad";
  {
    ck::CheckpointReader reader(good);
    std::vector<shardtrain::strategy::ShardedTensor> tensors;
    for (const auto& t : reader.metadata().tensors) {
      tensors.push_back({t.name, t.shape, 0, reader.read_tensor(t.name), true, t.kind == "parameter"});
    }
    Json state = Json::parse(reader.train_state());
    state.erase("step");
    cd::save_ranks_locally(bad, {tensors}, state.dump(), {reader.rank_state(0)},
                           ck::SaveOptions().step(1));
  }
  shardtrain::train::Trainer t(c, shardtrain::train::make_task(c, 1), comm);
  const std::string msg = shardtrain::testing::checkpoint_error([&] { t.resume(bad); });
  EXPECT_HAS(msg, "its training state (train_state.bin) is damaged");
  EXPECT_HAS(msg, "step");
}

// ---- the one guarded reader: streams, /proc, the samples cache ---------------------------

TEST(UntrustedFiles, JsonLinesAreReadThroughTheGuardedReader) {
  TempDir tmp;
  const std::string fifo = tmp / "train.jsonl";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const std::string msg = refused_at_once<ConfigError>(fifo, [&] { shardtrain::data::read_jsonl(fifo); });
  EXPECT_HAS(msg, "is a FIFO (named pipe), not a regular file");
  EXPECT_HAS(msg, fifo);
  // A link to /dev/zero: one endless line, refused before a byte is read.
  // (A reader that waited on the FIFO would read it until memory ran out.)
  if (HasFailure()) return;
  const std::string zero = tmp / "zero.jsonl";
  fs::create_symlink("/dev/zero", zero);
  try {
    shardtrain::data::read_jsonl(zero);
    ADD_FAILURE() << "read /dev/zero as a dataset";
  } catch (const ConfigError& e) {
    EXPECT_HAS(std::string(e.what()), "is a character device, not a regular file");
  }
}

TEST(UntrustedFiles, LinesPastTheCapAreRefusedAndTheLastLineNeedsNoBreak) {
  TempDir tmp;
  const std::string path = tmp / "lines";
  { std::ofstream(path) << "ab\n\ncdefg\nxyz"; }
  shardtrain::detail::LineReader in(5);
  std::string why, line;
  ASSERT_TRUE(in.open(path, &why)) << why;
  using Status = shardtrain::detail::LineReader::Status;
  std::vector<std::string> lines;
  while (in.next(&line, &why) == Status::Line) lines.push_back(line);
  EXPECT_EQ(lines, (std::vector<std::string>{"ab", "", "cdefg", "xyz"}));
  shardtrain::detail::LineReader tight(4);
  ASSERT_TRUE(tight.open(path, &why));
  EXPECT_EQ(tight.next(&line, &why), Status::Line);
  EXPECT_EQ(tight.next(&line, &why), Status::Line);
  EXPECT_EQ(tight.next(&line, &why), Status::TooLong);
  EXPECT_HAS(why, "line 3 is longer than 4 bytes");
}

// /proc files are regular with st_size 0: read to their end, not to st_size.
TEST(UntrustedFiles, ProcFilesAreReadToTheirEnd) {
  std::string text, why;
  ASSERT_TRUE(shardtrain::detail::read_regular_file("/proc/self/stat", 1 << 16, &text, &why)) << why;
  EXPECT_EQ(text.rfind(std::to_string(::getpid()) + " (", 0), 0u) << text;
  ASSERT_TRUE(shardtrain::detail::read_regular_file("/proc/meminfo", 1 << 20, &text, &why)) << why;
  EXPECT_HAS(text, "MemAvailable:");
}

namespace samples_cache {

using shardtrain::data::load_samples;
using shardtrain::data::samples_cache_path;
using shardtrain::data::SampleOptions;

std::vector<int32_t> ids_of(const std::string& text) {
  return std::vector<int32_t>(text.begin(), text.end());  // the byte tokenizer: one id a byte
}

std::string read_all(const std::string& path) {
  std::string bytes, why;
  EXPECT_TRUE(shardtrain::detail::read_regular_file(path, 1 << 20, &bytes, &why)) << why;
  return bytes;
}

// load_samples, failing the test (instead of hanging it) past 10 s.
std::vector<shardtrain::data::Sample> load_within_10s(const std::string& path, const std::string& cache) {
  const auto tok = shardtrain::data::load_tokenizer("bytes");
  auto result = std::async(std::launch::async, [&] { return load_samples(path, *tok, SampleOptions()); });
  if (result.wait_for(std::chrono::seconds(10)) == std::future_status::timeout) {
    ADD_FAILURE() << "load_samples blocked on the cache " << cache;
    const int writer = ::open(cache.c_str(), O_WRONLY | O_NONBLOCK);  // releases a FIFO's reader
    if (writer >= 0) ::close(writer);
  }
  return result.get();
}

}  // namespace samples_cache

TEST(UntrustedFiles, SamplesCacheEditedInPlaceIsRebuilt) {
  using namespace samples_cache;
  TempDir tmp;
  const std::string path = tmp / "d.jsonl";
  { std::ofstream(path) << "{\"text\": \"hello\"}\n{\"text\": \"world\"}\n"; }
  const auto tok = shardtrain::data::load_tokenizer("bytes");
  ASSERT_EQ(load_samples(path, *tok, SampleOptions()).at(0).ids, ids_of("hello"));
  const std::string cache = samples_cache_path(path, *tok, SampleOptions());
  // The id of 'h' (104), little-endian int32 before that of 'e', set to 7
  // in place: same size, same name, same key.
  std::string bytes = read_all(cache);
  const std::string h_then_e("\x68\0\0\0\x65\0\0\0", 8);
  const size_t at = bytes.find(h_then_e);
  ASSERT_NE(at, std::string::npos);
  bytes[at] = 7;
  { std::ofstream(cache, std::ios::binary | std::ios::trunc) << bytes; }

  ::testing::internal::CaptureStderr();
  const auto samples = load_samples(path, *tok, SampleOptions());
  const std::string err = ::testing::internal::GetCapturedStderr();
  ASSERT_EQ(samples.size(), 2u);
  EXPECT_EQ(samples[0].ids, ids_of("hello"));
  EXPECT_EQ(samples[1].ids, ids_of("world"));
  EXPECT_HAS(err, cache);
  EXPECT_HAS(err, "rebuilding it");
  EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 1) << err;
  // Rebuilt: the next load reads it without a word.
  EXPECT_EQ(read_all(cache).find(h_then_e), at);
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(load_samples(path, *tok, SampleOptions()).at(0).ids, ids_of("hello"));
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
}

TEST(UntrustedFiles, SamplesCacheSeesAnEditThatKeepsSizeAndMtime) {
  using namespace samples_cache;
  TempDir tmp;
  const std::string path = tmp / "d.jsonl";
  { std::ofstream(path) << "{\"text\": \"hello\"}\n"; }
  const auto tok = shardtrain::data::load_tokenizer("bytes");
  ASSERT_EQ(load_samples(path, *tok, SampleOptions()).at(0).ids, ids_of("hello"));
  struct stat before {};
  ASSERT_EQ(::stat(path.c_str(), &before), 0);
  { std::ofstream(path, std::ios::trunc) << "{\"text\": \"jello\"}\n"; }
  const struct timespec times[2] = {before.st_atim, before.st_mtim};
  ASSERT_EQ(::utimensat(AT_FDCWD, path.c_str(), times, 0), 0);
  struct stat after {};
  ASSERT_EQ(::stat(path.c_str(), &after), 0);
  ASSERT_EQ(after.st_size, before.st_size);
  ASSERT_EQ(after.st_mtim.tv_nsec, before.st_mtim.tv_nsec);
  EXPECT_EQ(load_samples(path, *tok, SampleOptions()).at(0).ids, ids_of("jello"));
}

// A cache that is not a regular file is not read (no hang, no endless
// read): the samples are tokenized again and the cache written anew over it.
TEST(UntrustedFiles, SamplesCacheThatIsAFifoOrADeviceIsRebuilt) {
  using namespace samples_cache;
  TempDir tmp;
  const std::string path = tmp / "d.jsonl";
  { std::ofstream(path) << "{\"text\": \"hello\"}\n"; }
  const auto tok = shardtrain::data::load_tokenizer("bytes");
  const std::string cache = samples_cache_path(path, *tok, SampleOptions());
  for (const char* kind : {"fifo", "/dev/zero"}) {
    SCOPED_TRACE(kind);
    // A reader that waited on the FIFO would read /dev/zero until memory ran out.
    if (HasFailure()) return;
    fs::remove(cache);
    if (std::string(kind) == "fifo") {
      ASSERT_EQ(::mkfifo(cache.c_str(), 0600), 0);
    } else {
      fs::create_symlink(kind, cache);
    }
    ::testing::internal::CaptureStderr();
    const auto samples = load_within_10s(path, cache);
    const std::string err = ::testing::internal::GetCapturedStderr();
    ASSERT_EQ(samples.size(), 1u);
    EXPECT_EQ(samples[0].ids, ids_of("hello"));
    EXPECT_HAS(err, kind == std::string("fifo") ? "a FIFO (named pipe)" : "a character device");
    EXPECT_TRUE(fs::is_regular_file(fs::symlink_status(cache))) << "the cache was not rebuilt";
  }
}

}  // namespace
