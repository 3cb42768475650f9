// Ranks that compare their configurations (config_digest.h).
#include "train/config_digest.h"

#include <openssl/evp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <memory>

#include "checkpoint/detail.h"
#include "config/key_table.h"
#include "core/file.h"
#include "shardtrain/comm/communicator.h"
#include "shardtrain/config/config.h"
#include "shardtrain/core/error.h"

namespace shardtrain::train::detail {

namespace fs = std::filesystem;
using ::shardtrain::detail::str_cat;

namespace {

// A file larger than this is digested by its first and last kEndBytes.
constexpr long long kEndBytes = 4LL << 20;
constexpr size_t kMaxDirFiles = 64;

std::string hex(const unsigned char* p, size_t n) {
  static const char kHex[] = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < n; ++i) {
    out.push_back(kHex[p[i] >> 4]);
    out.push_back(kHex[p[i] & 15]);
  }
  return out;
}

// SHA-256 over `ranges` ((offset, length) pairs) of the open file `fd`, as
// hex; empty with `*why` set when a read fails.
std::string sha256_ranges(int fd, const std::vector<std::pair<long long, long long>>& ranges,
                          std::string* why) {
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> ctx(EVP_MD_CTX_new(), &EVP_MD_CTX_free);
  bool ok = ctx && EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr) == 1;
  std::vector<char> buf(1 << 20);
  for (const auto& [offset, length] : ranges) {
    for (long long done = 0; ok && done < length;) {
      const size_t want = static_cast<size_t>(std::min<long long>(length - done, buf.size()));
      const ssize_t n = ::pread(fd, buf.data(), want, offset + done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        *why = n < 0 ? std::strerror(errno) : "the file shrank while it was read";
        return {};
      }
      ok = EVP_DigestUpdate(ctx.get(), buf.data(), static_cast<size_t>(n)) == 1;
      done += n;
    }
  }
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (!ok || EVP_DigestFinal_ex(ctx.get(), digest, &len) != 1) {
    *why = "SHA-256 failed";
    return {};
  }
  return hex(digest, len);
}

std::string regular_file_fingerprint(const std::string& path) {
  std::string why;
  const int fd = ::shardtrain::detail::open_regular_for_reading(path, &why);
  if (fd < 0) return str_cat("unreadable (", why, ")");
  struct stat st {};
  std::string digest;
  long long size = -1;
  if (::fstat(fd, &st) != 0) {
    why = std::strerror(errno);
  } else {
    size = static_cast<long long>(st.st_size);
    std::vector<std::pair<long long, long long>> ranges{{0, size}};
    if (size > 2 * kEndBytes) ranges = {{0, kEndBytes}, {size - kEndBytes, kEndBytes}};
    digest = sha256_ranges(fd, ranges, &why);
  }
  ::close(fd);
  if (digest.empty()) return str_cat("unreadable (", why, ")");
  return str_cat(size, " bytes, sha256 ", digest.substr(0, 16));
}

// What a path that is neither a regular file nor a directory is.
std::string kind_of(const fs::file_status& st) {
  switch (st.type()) {
    case fs::file_type::not_found: return "absent";
    case fs::file_type::fifo: return "a FIFO (named pipe)";
    case fs::file_type::character: return "a character device";
    case fs::file_type::block: return "a block device";
    case fs::file_type::socket: return "a socket";
    default: return "not a regular file";
  }
}

std::string cut(const std::string& value) {
  if (value.size() <= kMaxValueBytes) return value;
  return value.substr(0, kMaxValueBytes - 3) + "...";
}

// Values travel one per line: newlines inside are escaped.
std::string escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '\\') out += "\\\\";
    else if (c == '\n') out += "\\n";
    else out.push_back(c);
  }
  return out;
}

std::string unescape(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\\' && i + 1 < s.size()) {
      out.push_back(s[i + 1] == 'n' ? '\n' : s[i + 1]);
      ++i;
    } else {
      out.push_back(s[i]);
    }
  }
  return out;
}

}  // namespace

std::string file_fingerprint(const std::string& path) {
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (fs::is_regular_file(st)) return regular_file_fingerprint(path);
  if (!fs::is_directory(st)) return kind_of(st);
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(path, ec)) {
    if (e.is_regular_file(ec)) names.push_back(e.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  if (names.size() > kMaxDirFiles) names.resize(kMaxDirFiles);
  std::string out = "directory";
  for (const std::string& name : names) {
    out += str_cat("; ", name, ": ", regular_file_fingerprint((fs::path(path) / name).string()));
  }
  return out;
}

ConfigEntries config_entries(const config::Config& config) {
  // The files, by content: each rank may hold its copy under a path of its
  // own (another mount point, a per-rank temporary), so their path keys
  // only say whether a path is given.
  const bool tokenizer_file = config.data.tokenizer != "bytes" && config.data.tokenizer != "auto";
  const std::pair<const char*, std::string> files[] = {
      {"data.train", config.data.train},
      {"data.tokenizer", tokenizer_file ? config.data.tokenizer : std::string()},
      {"model.init_from", config.model.init_from},
      {"lora.init_from", config.lora.init_from()}};
  ConfigEntries entries;
  for (const config::detail::Key& key : config::detail::keys()) {
    const bool per_host = std::any_of(std::begin(kPerHostKeys), std::end(kPerHostKeys),
                                      [&](const char* k) { return key.path == k; });
    if (per_host) continue;
    const auto* file = std::find_if(std::begin(files), std::end(files),
                                    [&](const auto& f) { return key.path == f.first; });
    const bool a_path = file != std::end(files) && !file->second.empty();
    entries.emplace_back(key.path, a_path ? std::string("(a file)") : key.write(config));
  }
  for (const auto& [key, path] : files) {
    entries.emplace_back(str_cat("file ", key), path.empty() ? "(none)" : file_fingerprint(path));
  }
  return entries;
}

std::optional<KeyDifference> first_difference(const ConfigEntries& a, const ConfigEntries& b) {
  auto find = [](const ConfigEntries& in, const std::string& key) -> const std::string* {
    for (const auto& [k, v] : in) {
      if (k == key) return &v;
    }
    return nullptr;
  };
  for (const auto& [key, value] : a) {
    const std::string* other = find(b, key);
    if (other == nullptr) return KeyDifference{key, value, "(absent)"};
    if (*other != value) return KeyDifference{key, value, *other};
  }
  for (const auto& [key, value] : b) {
    if (find(a, key) == nullptr) return KeyDifference{key, "(absent)", value};
  }
  return std::nullopt;
}

int first_disagreeing_rank(const std::vector<std::string>& digests) {
  for (size_t r = 1; r < digests.size(); ++r) {
    if (digests[r] != digests[0]) return static_cast<int>(r);
  }
  return -1;
}

std::string disagreement_message(int other, const KeyDifference& d) {
  if (d.key.rfind("file ", 0) == 0) {
    return str_cat("ranks 0 and ", other, " read different files: ", d.key.substr(5), " is ", d.a,
                   " on rank 0 and ", d.b, " on rank ", other,
                   "; give every rank the same files (copy them alike to every host)");
  }
  return str_cat("ranks 0 and ", other, " were started with different configurations: ", d.key,
                 " is ", d.a, " on rank 0 and ", d.b, " on rank ", other,
                 "; start every rank with the same config (file and --set options)");
}

std::string entries_text(const ConfigEntries& entries) {
  std::string text;
  for (const auto& [key, value] : entries) text += str_cat(escape(key), '\t', escape(cut(value)), '\n');
  return text;
}

ConfigEntries entries_from_text(const std::string& text) {
  ConfigEntries out;
  size_t at = 0;
  while (at < text.size()) {
    size_t end = text.find('\n', at);
    if (end == std::string::npos) end = text.size();
    const std::string line = text.substr(at, end - at);
    const size_t tab = line.find('\t');
    if (tab != std::string::npos) out.emplace_back(unescape(line.substr(0, tab)), unescape(line.substr(tab + 1)));
    at = end + 1;
  }
  return out;
}

std::string entries_digest(const std::string& text) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_Digest(text.data(), text.size(), digest, &len, EVP_sha256(), nullptr);
  return hex(digest, len);
}

void refuse_mismatched_ranks(comm::Communicator& comm, const config::Config& config) {
  if (comm.size() < 2) return;
  namespace ck = ::shardtrain::checkpoint::detail;
  const std::string text = entries_text(config_entries(config));
  const int other = first_disagreeing_rank(ck::all_gather_strings(comm, entries_digest(text)));
  if (other < 0) return;
  // Only now the entries themselves, from every rank (collective: each
  // rank saw the same digests, so all of them take this path).
  const std::vector<std::string> all = ck::all_gather_strings(comm, text);
  const std::optional<KeyDifference> d =
      first_difference(entries_from_text(all[0]), entries_from_text(all[static_cast<size_t>(other)]));
  ST_CHECK(!d, ConfigError,
           disagreement_message(other, d.value_or(KeyDifference{})));
  // Same entries, other digests: ranks built with different key tables.
  ST_CHECK(false, ConfigError, "ranks 0 and ", other, " disagree on their configurations, but no key "
           "differs: they run different builds of shardtrain; install the same build on every host");
}

}  // namespace shardtrain::train::detail
