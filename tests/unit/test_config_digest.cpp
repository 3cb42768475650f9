// Ranks that compare their configurations (train/config_digest.h): the key
// that differs, the ranks named, and the files' fingerprints. Expected values
// are written by hand; the digests are sha256sum's.
#include <gtest/gtest.h>

#include <fstream>
#include <string>

#include "shardtrain/config/config.h"
#include "temp_dir.h"
#include "train/config_digest.h"

namespace shardtrain::train::detail {
namespace {

void write_file(const std::string& path, const std::string& content) {
  std::ofstream(path, std::ios::binary) << content;
}

TEST(ConfigDigest, FirstDifferenceIsTheFirstKeyInOrder) {
  const ConfigEntries a{{"x", "1"}, {"y", "2"}, {"z", "3"}};
  EXPECT_FALSE(first_difference(a, a).has_value());
  // y and z both differ: y comes first.
  const auto d = first_difference(a, {{"x", "1"}, {"y", "5"}, {"z", "4"}});
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->key, "y");
  EXPECT_EQ(d->a, "2");
  EXPECT_EQ(d->b, "5");
  // Only the last key differs.
  const auto last = first_difference(a, {{"x", "1"}, {"y", "2"}, {"z", "9"}});
  ASSERT_TRUE(last.has_value());
  EXPECT_EQ(last->key, "z");
  EXPECT_EQ(last->b, "9");
  // A key one side lacks.
  const auto lacks = first_difference(a, {{"x", "1"}, {"z", "3"}});
  ASSERT_TRUE(lacks.has_value());
  EXPECT_EQ(lacks->key, "y");
  EXPECT_EQ(lacks->b, "(absent)");
  const auto extra = first_difference(a, {{"x", "1"}, {"y", "2"}, {"z", "3"}, {"w", "0"}});
  ASSERT_TRUE(extra.has_value());
  EXPECT_EQ(extra->key, "w");
  EXPECT_EQ(extra->a, "(absent)");
  EXPECT_EQ(extra->b, "0");
}

TEST(ConfigDigest, FirstDisagreeingRankComparesWithRankZero) {
  EXPECT_EQ(first_disagreeing_rank({"d"}), -1);
  EXPECT_EQ(first_disagreeing_rank({"d", "d", "d"}), -1);
  EXPECT_EQ(first_disagreeing_rank({"d", "e"}), 1);
  EXPECT_EQ(first_disagreeing_rank({"d", "d", "e", "f"}), 2);
  // Rank 0 is the odd one out: rank 1 is named against it.
  EXPECT_EQ(first_disagreeing_rank({"e", "d", "d"}), 1);
}

TEST(ConfigDigest, ConfigsThatDifferByTheLearningRate) {
  config::Config c;
  c.optimizer.lr = 0.001;
  config::Config other = c;
  other.optimizer.lr = 0.002;
  const auto d = first_difference(config_entries(c), config_entries(other));
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->key, "optimizer.lr");
  EXPECT_EQ(d->a, "0.001");
  EXPECT_EQ(d->b, "0.002");
  EXPECT_EQ(disagreement_message(1, *d),
            "ranks 0 and 1 were started with different configurations: optimizer.lr is 0.001 on "
            "rank 0 and 0.002 on rank 1; start every rank with the same config (file and --set "
            "options)");
  // Two keys differ: the one the key table lists first (model before optimizer).
  other.model.n_embd = c.model.n_embd * 2;
  const auto first = first_difference(config_entries(c), config_entries(other));
  ASSERT_TRUE(first.has_value());
  EXPECT_EQ(first->key, "model.n_embd");
  EXPECT_EQ(first->a, std::to_string(c.model.n_embd));
  EXPECT_EQ(first->b, std::to_string(c.model.n_embd * 2));
  EXPECT_NE(entries_digest(entries_text(config_entries(c))),
            entries_digest(entries_text(config_entries(other))));
}

TEST(ConfigDigest, PerHostKeysMayDiffer) {
  config::Config c;
  config::Config other = c;
  other.distributed.threads_per_rank(c.distributed.threads_per_rank() + 3);
  other.distributed.nproc_per_node(c.distributed.nproc_per_node() + 2);
  other.trainer.progress = train::ProgressMode::None;
  EXPECT_FALSE(first_difference(config_entries(c), config_entries(other)).has_value());
  EXPECT_EQ(entries_digest(entries_text(config_entries(c))),
            entries_digest(entries_text(config_entries(other))));
}

TEST(ConfigDigest, FilesAreComparedBySizeAndContent) {
  shardtrain::testing::TempDir dir;
  write_file(dir / "a.txt", "hello\n");
  // sha256sum of "hello\n": 5891b5b522d5df086d0ff0b110fbd9d21bb4fc7163af34d08286a2e846f6be03
  EXPECT_EQ(file_fingerprint(dir / "a.txt"), "6 bytes, sha256 5891b5b522d5df08");
  // Same size, other bytes: the data entries differ, naming data.train.
  write_file(dir / "b.txt", "hellO\n");
  config::Config c;
  c.data.train = dir / "a.txt";
  config::Config other = c;
  other.data.train = dir / "b.txt";
  ConfigEntries ea = config_entries(c), eb = config_entries(other);
  // The paths differ too, but files are compared by content: the first
  // difference is the file's.
  const auto by_content = first_difference(config_entries(c), config_entries(other));
  ASSERT_TRUE(by_content.has_value());
  EXPECT_EQ(by_content->key, "file data.train");
  // A copy with the same bytes under another path (a per-rank temporary,
  // another mount point) is the same data.
  write_file(dir / "copy.txt", "hello\n");
  config::Config copy = c;
  copy.data.train = dir / "copy.txt";
  EXPECT_FALSE(first_difference(config_entries(c), config_entries(copy)).has_value());
  auto file_entry = [](const ConfigEntries& e) {
    for (const auto& [k, v] : e) {
      if (k == "file data.train") return v;
    }
    return std::string("(none)");
  };
  EXPECT_EQ(file_entry(ea), "6 bytes, sha256 5891b5b522d5df08");
  EXPECT_NE(file_entry(eb), file_entry(ea));
  // The same path with other contents on another host: the file entry alone.
  write_file(dir / "b.txt", "hello\n");
  other.data.train = c.data.train;
  write_file(dir / "a2.txt", "hellO\n");
  ConfigEntries changed = config_entries(c);
  for (auto& [k, v] : changed) {
    if (k == "file data.train") v = file_fingerprint(dir / "a2.txt");
  }
  const auto d = first_difference(config_entries(c), changed);
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->key, "file data.train");
  // sha256sum of "hellO\n": 0655937a5582c55b9ac610ed7ce474ed9be0a0fbefe9afcba31b36040be5530b
  EXPECT_EQ(d->b, "6 bytes, sha256 0655937a5582c55b");
  EXPECT_EQ(disagreement_message(3, *d),
            "ranks 0 and 3 read different files: data.train is 6 bytes, sha256 5891b5b522d5df08 on "
            "rank 0 and 6 bytes, sha256 0655937a5582c55b on rank 3; give every rank the same files "
            "(copy them alike to every host)");
}

TEST(ConfigDigest, LargeFilesByTheirEnds) {
  shardtrain::testing::TempDir dir;
  // 4 MiB of 'a', 1 MiB of 'b', 4 MiB of 'a': digested by the first and last
  // 4 MiB, i.e. 8 MiB of 'a' (sha256sum: ad97f87076920684...).
  const std::string four(4 << 20, 'a');
  write_file(dir / "big", four + std::string(1 << 20, 'b') + four);
  EXPECT_EQ(file_fingerprint(dir / "big"), "9437184 bytes, sha256 ad97f87076920684");
  // A change in the last bytes is seen.
  write_file(dir / "big", four + std::string(1 << 20, 'b') + four.substr(1) + "z");
  EXPECT_NE(file_fingerprint(dir / "big"), "9437184 bytes, sha256 ad97f87076920684");
  EXPECT_EQ(file_fingerprint(dir / "nothing-here"), "absent");
}

TEST(ConfigDigest, EntriesTravelAsText) {
  const ConfigEntries e{{"a.b", "line1\nline2\\x"}, {"c", std::string(500, 'v')}, {"d", ""}};
  const ConfigEntries back = entries_from_text(entries_text(e));
  ASSERT_EQ(back.size(), 3u);
  EXPECT_EQ(back[0].second, "line1\nline2\\x");
  EXPECT_EQ(back[1].second.size(), kMaxValueBytes);
  EXPECT_EQ(back[1].second.substr(kMaxValueBytes - 3), "...");
  EXPECT_EQ(back[2], (std::pair<std::string, std::string>{"d", ""}));
}

}  // namespace
}  // namespace shardtrain::train::detail
