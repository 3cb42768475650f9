// Ranks that compare their configurations before they train.
//
// Every rank of a job must train the same model on the same data with the
// same settings; one started with another optimizer.lr (a typo in one
// launcher's --set, a stale config file on one host) would otherwise train a
// diverging replica, or meet its peers with tensors of other shapes in the
// middle of a collective. At start, every rank:
//   1. flattens its resolved config into key=value entries (every key of the
//      key table, in its order, less the keys that may differ per host or
//      rank: kPerHostKeys) and adds one entry per file it reads (data.train,
//      a tokenizer path, model.init_from, lora.init_from): its size and the
//      SHA-256 of its content (of its first and last 4 MiB when it is larger
//      than 8 MiB, so that a start never reads a large dataset twice). Files
//      are compared by content, not by path: ranks may hold their copies
//      under paths of their own (another mount point, a per-rank temporary);
//   2. all-gathers the SHA-256 of those entries (one small message);
//   3. only when some rank's differs from rank 0's, all-gathers the entries
//      themselves (each value cut to kMaxValueBytes) and names the first key
//      that differs between rank 0 and the first such rank.
// Every rank then throws the same ConfigError, so the job ends with exit 2 on
// every rank before any other collective. File sizes and contents are
// compared, never modification times: copies of one dataset on two hosts
// have the same bytes but rarely the same mtime.
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace shardtrain::config {
struct Config;
}
namespace shardtrain::comm {
class Communicator;
}

namespace shardtrain::train::detail {

/// Ordered (key, value) pairs: a rank's view of its configuration.
using ConfigEntries = std::vector<std::pair<std::string, std::string>>;

/// Keys that may legitimately differ between hosts or ranks: the ranks a
/// node starts (nodes may differ since issue 44), threads per rank (set per
/// host's cores) and how progress is drawn (rank 0 alone draws it).
inline constexpr const char* kPerHostKeys[] = {"distributed.nproc_per_node",
                                               "distributed.threads_per_rank", "trainer.progress"};

/// The longest value an exchanged entry keeps (longer ones are cut and end
/// in "..."): the exchange stays small whatever a value holds.
inline constexpr size_t kMaxValueBytes = 200;

/// `path`'s size and content digest, as compared between ranks:
/// "<size> bytes, sha256 <16 hex digits>" (of the whole file up to 8 MiB,
/// else of its first and last 4 MiB); for a directory, its regular files
/// (up to 64, by name) each as "name: <size> bytes, sha256 ..."; "absent",
/// or what it is when it is neither ("a FIFO (named pipe)").
std::string file_fingerprint(const std::string& path);

/// The entries of `config` (see the top of this file): key=value for every
/// key but kPerHostKeys, then a "file <key>" entry for each file key
/// (data.train, data.tokenizer, model.init_from, lora.init_from): its
/// fingerprint, or "(none)". Files are compared by content, not by path: a
/// file key given a path reads "(a file)" among the keys.
ConfigEntries config_entries(const config::Config& config);

/// The first difference between two ranks' entries: the first key of `a`
/// (in order) whose value differs in `b` or that `b` lacks, else the first
/// key of `b` that `a` lacks; a missing value reads "(absent)". Nullopt when
/// they are the same.
struct KeyDifference {
  std::string key, a, b;
};
std::optional<KeyDifference> first_difference(const ConfigEntries& a, const ConfigEntries& b);

/// The first rank whose digest differs from rank 0's, or -1 when all agree.
int first_disagreeing_rank(const std::vector<std::string>& digests);

/// The one-line refusal for ranks 0 and `other` differing by `d`.
std::string disagreement_message(int other, const KeyDifference& d);

/// The SHA-256 (hex) of `entries` as one text, and that text (entries
/// newline-separated, values cut to kMaxValueBytes); entries_from_text
/// reads it back.
std::string entries_text(const ConfigEntries& entries);
ConfigEntries entries_from_text(const std::string& text);
std::string entries_digest(const std::string& text);

/// Collective over `comm` (every rank, before any other collective of the
/// job's training): ConfigError, the same on every rank, when ranks were
/// started with different configurations or read different files.
void refuse_mismatched_ranks(comm::Communicator& comm, const config::Config& config);

}  // namespace shardtrain::train::detail
