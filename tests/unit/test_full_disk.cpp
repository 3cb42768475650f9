// Writes that fail half-way (a full disk) leave nothing half-written: no
// temporary file or directory, no torn checkpoint, no half line in
// metrics.jsonl, no half record in a TensorBoard event file. A full disk is simulated with RLIMIT_FSIZE (writes beyond
// the limit fail with EFBIG, as they would with ENOSPC) or with the
// checkpoint write hook; tests/dist/train_full_disk.sh does it with a real
// tmpfs end to end.
#include <signal.h>
#include <sys/resource.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "../dist/checkpoint_synthetic.h"
#include "checkpoint/detail.h"
#include "shardtrain/checkpoint/checkpoint.h"
#include "shardtrain/checkpoint/safetensors.h"
#include "shardtrain/comm/communicator.h"
#include "shardtrain/core/error.h"
#include "shardtrain/train/callbacks.h"
#include "temp_dir.h"

namespace {

namespace fs = std::filesystem;
namespace ck = shardtrain::checkpoint;
namespace cd = shardtrain::checkpoint::detail;
namespace syn = shardtrain::testing::synthetic;
using shardtrain::CheckpointError;
using shardtrain::IoError;
using shardtrain::testing::TempDir;

// While alive, no file of this process may grow beyond `bytes`: writes past
// that fail with EFBIG (SIGXFSZ ignored), like writes to a full disk.
class FileSizeLimit {
 public:
  explicit FileSizeLimit(rlim_t bytes) {
    getrlimit(RLIMIT_FSIZE, &saved_);
    old_handler_ = signal(SIGXFSZ, SIG_IGN);
    rlimit limit = saved_;
    limit.rlim_cur = bytes;
    setrlimit(RLIMIT_FSIZE, &limit);
  }
  ~FileSizeLimit() {
    setrlimit(RLIMIT_FSIZE, &saved_);
    signal(SIGXFSZ, old_handler_);
  }

 private:
  rlimit saved_{};
  sighandler_t old_handler_;
};

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// Names under `dir` (recursively) that a failed write must not leave.
std::vector<std::string> temporaries(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name.find(".tmp") != std::string::npos || name.find(".old") != std::string::npos) {
      out.push_back(e.path().string());
    }
  }
  return out;
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += x + " ";
  return s;
}

TEST(FullDisk, MetricsLineIsWrittenWholeOrNotAtAll) {
  TempDir tmp;
  shardtrain::train::TrainerState state;
  shardtrain::train::TrainerControl control;
  state.rank = 0;
  state.run_dir = tmp.path();
  shardtrain::train::MetricsWriter writer;
  writer.on_train_begin(state, control);
  state.metrics.set("step", int64_t{1});
  writer.on_step_end(state, control);
  const std::string path = tmp / "metrics.jsonl";
  const std::string before = read_all(path);
  ASSERT_FALSE(before.empty());
  {
    const FileSizeLimit limit(before.size() + 10);  // room for 10 bytes of the next line
    state.metrics.set("note", std::string(200, 'x'));
    try {
      writer.on_step_end(state, control);
      FAIL() << "no IoError when the line does not fit";
    } catch (const IoError& e) {
      EXPECT_NE(std::string(e.what()).find("metrics.jsonl"), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(read_all(path), before) << "a partial line was left in metrics.jsonl";
  // Once there is room again, lines are appended as before.
  state.metrics.set("step", int64_t{2});
  writer.on_step_end(state, control);
  const std::string after = read_all(path);
  EXPECT_EQ(after.rfind(before, 0), 0u);
  EXPECT_EQ(after.back(), '\n');
}

TEST(FullDisk, TensorBoardRecordsAreWrittenWholeOrNotAtAll) {
  TempDir tmp;
  shardtrain::train::TrainerState state;
  shardtrain::train::TrainerControl control;
  state.rank = 0;
  state.run_dir = tmp.path();
  shardtrain::train::TensorBoardWriter writer;
  writer.on_train_begin(state, control);
  shardtrain::train::Metrics logs;
  logs.set("step", int64_t{1});
  logs.set("loss", 5.5);
  writer.on_log(state, control, logs);
  const std::string before = read_all(writer.path());
  ASSERT_FALSE(before.empty());
  {
    const FileSizeLimit limit(before.size() + 10);  // room for 10 bytes of the next record
    logs.set("lr", 3e-4);
    try {
      writer.on_log(state, control, logs);
      FAIL() << "no IoError when the record does not fit";
    } catch (const IoError& e) {
      EXPECT_NE(std::string(e.what()).find("events.out.tfevents"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("the partial record was removed"), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(read_all(writer.path()), before) << "a partial record was left in the event file";
  writer.on_log(state, control, logs);
  EXPECT_GT(read_all(writer.path()).size(), before.size());
}

TEST(FullDisk, AtomicFileWriteLeavesNoTemporary) {
  TempDir tmp;
  const std::string path = tmp / "config.yaml";
  std::ofstream(path) << "old\n";
  {
    const FileSizeLimit limit(100);
    EXPECT_THROW(cd::write_file_atomically(path, std::string(5000, 'y')), CheckpointError);
  }
  EXPECT_EQ(read_all(path), "old\n");
  EXPECT_TRUE(temporaries(tmp.path()).empty()) << join(temporaries(tmp.path()));
}

TEST(FullDisk, SafetensorsWriterLeavesNoTemporary) {
  TempDir tmp;
  const std::vector<std::pair<std::string, at::Tensor>> tensors = {
      {"a", torch::ones({1000})}, {"b", torch::ones({10})}};
  // The header itself does not fit (the constructor throws), then the data.
  for (const rlim_t bytes : {rlim_t{16}, rlim_t{2000}}) {
    {
      const FileSizeLimit limit(bytes);
      EXPECT_THROW(ck::save_safetensors(tmp / "model.safetensors", tensors), CheckpointError)
          << "limit " << bytes;
    }
    EXPECT_FALSE(fs::exists(tmp / "model.safetensors")) << "limit " << bytes;
    EXPECT_TRUE(temporaries(tmp.path()).empty()) << "limit " << bytes << ": "
                                                 << join(temporaries(tmp.path()));
  }
}

std::vector<std::vector<shardtrain::strategy::ShardedTensor>> ranks(int world, int salt) {
  std::vector<std::vector<shardtrain::strategy::ShardedTensor>> out;
  for (int r = 0; r < world; ++r) out.push_back(syn::rank_tensors(world, r, salt, true));
  return out;
}

// Reads every tensor of a checkpoint (every checksum is verified).
void read_everything(const std::string& dir) {
  ck::CheckpointReader reader(dir);
  for (const auto& t : reader.metadata().tensors) reader.read_tensor(t.name);
}

TEST(FullDisk, FailedSaveLeavesThePreviousCheckpointAndNoTemporary) {
  TempDir tmp;
  const std::string dir = tmp / "checkpoints/step-000007";
  const auto options = ck::SaveOptions().strategy("synthetic").step(7);
  cd::save_ranks_locally(dir, ranks(2, 0), "state", {}, options);  // written by 2 ranks

  // Out of space in a rank file: the save of another step fails cleanly.
  {
    const FileSizeLimit limit(200);
    EXPECT_THROW(cd::save_ranks_locally(tmp / "checkpoints/step-000008", ranks(2, 1), "state", {},
                                        ck::SaveOptions(options).step(8)),
                 CheckpointError);
  }
  EXPECT_FALSE(fs::exists(tmp / "checkpoints/step-000008"));

  // Out of space for the marker of a save over the same step, through the
  // collective path: renamed into place but never committed, so it goes
  // and the previous complete checkpoint comes back.
  cd::set_write_hook([](const std::string& path, int64_t) {
    if (path.find(cd::kCommitFile) != std::string::npos) {
      throw CheckpointError("cannot write '" + path + "': No space left on device");
    }
  });
  auto comm = shardtrain::comm::Communicator::create(
      shardtrain::comm::CommOptions().rank(0).world_size(1));
  EXPECT_THROW(ck::save_sharded(dir, *comm, syn::rank_tensors(1, 0, 5, true), "state", "", options),
               CheckpointError);
  cd::set_write_hook(nullptr);

  ASSERT_TRUE(ck::is_complete(dir));
  EXPECT_EQ(ck::read_metadata(dir).world_size, 2) << "not the previous checkpoint";
  EXPECT_NO_THROW(read_everything(dir));
  EXPECT_TRUE(temporaries(tmp.path()).empty()) << join(temporaries(tmp.path()));
}

}  // namespace
