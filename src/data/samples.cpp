// Tokenizing records into masked samples, and the samples' cache file.
#include "shardtrain/data/samples.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <sstream>

#include "checkpoint/detail.h"
#include "core/file.h"
#include "shardtrain/core/error.h"
#include "shardtrain/data/chat_template.h"

namespace shardtrain::data {

namespace {

// Version 02: the file ends with the SHA-256 of everything before it.
constexpr char kCacheMagic[8] = {'S', 'T', 'S', 'M', 'P', 'L', '0', '2'};
constexpr size_t kChecksumBytes = 64;  // hex digits

void append(Sample& s, const std::vector<int32_t>& ids, bool trained) {
  s.ids.insert(s.ids.end(), ids.begin(), ids.end());
  s.trained.insert(s.trained.end(), ids.size(), trained ? 1 : 0);
}

// FNV-1a, 64 bits: a digest that is the same on every platform and library.
uint64_t fnv1a(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ULL;
  return h;
}

// Everything that decides the samples' ids and masks. The dataset enters by
// the SHA-256 of its content (one pass over the file per load, at disk or
// hashing speed, whichever is slower: about a second per GB), not by its size
// and mtime: a file edited at the same size with its mtime put back would
// otherwise be served the old samples.
std::string cache_key(const std::string& path, const Tokenizer& tokenizer,
                      const SampleOptions& options) {
  std::string digest, why;
  long long bytes = 0;
  ST_CHECK(::shardtrain::detail::sha256_of_file(path, &digest, &bytes, &why), ConfigError,
           "data.train '", path, "' cannot be read: ", why,
           "; hint: point data.train at a JSON-lines file");
  std::ostringstream key;
  key << "tokenizer=" << tokenizer.fingerprint() << ";template="
      << enum_name(options.chat_template) << ";train_on_inputs=" << options.train_on_inputs
      << ";size=" << bytes << ";sha256=" << digest << ";format=2";
  return key.str();
}

std::string cache_path_of(const std::string& path, const std::string& key) {
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(fnv1a(key)));
  return path + ".shardtrain-" + hex + ".samples";
}

template <class T>
void put(std::string& out, const T& v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(T));
}

std::string serialise(const std::string& key, const std::vector<Sample>& samples) {
  std::string out(kCacheMagic, sizeof(kCacheMagic));
  put(out, static_cast<uint64_t>(key.size()));
  out += key;
  put(out, static_cast<uint64_t>(samples.size()));
  for (const Sample& s : samples) {
    put(out, static_cast<uint64_t>(s.ids.size()));
    out.append(reinterpret_cast<const char*>(s.ids.data()), s.ids.size() * sizeof(int32_t));
    out.append(reinterpret_cast<const char*>(s.trained.data()), s.trained.size());
  }
  return out + ::shardtrain::detail::sha256_hex(out.data(), out.size());
}

enum class CacheState { Read, OtherKey, Damaged };

// The cached samples (Read); OtherKey when the file is for other inputs;
// Damaged when its checksum or its layout is wrong (edited in place,
// truncated, another program's file).
CacheState deserialise(const std::string& file, const std::string& key, std::vector<Sample>* out) {
  if (file.size() < sizeof(kCacheMagic) + kChecksumBytes) return CacheState::Damaged;
  const size_t end = file.size() - kChecksumBytes;  // the checksummed bytes: [0, end)
  if (file.compare(end, kChecksumBytes, ::shardtrain::detail::sha256_hex(file.data(), end)) != 0) {
    return CacheState::Damaged;
  }
  size_t at = 0;
  const auto take = [&](void* dst, size_t n) {
    if (end - at < n) return false;
    std::memcpy(dst, file.data() + at, n);
    at += n;
    return true;
  };
  char magic[sizeof(kCacheMagic)];
  uint64_t key_size = 0, count = 0;
  if (!take(magic, sizeof(magic)) || std::memcmp(magic, kCacheMagic, sizeof(magic)) != 0) {
    return CacheState::Damaged;
  }
  if (!take(&key_size, sizeof(key_size)) || key_size != key.size()) return CacheState::OtherKey;
  if (file.compare(at, key.size(), key) != 0) return CacheState::OtherKey;
  at += key.size();
  if (!take(&count, sizeof(count))) return CacheState::Damaged;
  std::vector<Sample> samples;
  for (uint64_t i = 0; i < count; ++i) {
    uint64_t n = 0;
    if (!take(&n, sizeof(n)) || n > end) return CacheState::Damaged;
    Sample s;
    s.ids.resize(n);
    s.trained.resize(n);
    if (!take(s.ids.data(), n * sizeof(int32_t)) || !take(s.trained.data(), n)) {
      return CacheState::Damaged;
    }
    samples.push_back(std::move(s));
  }
  if (at != end) return CacheState::Damaged;
  *out = std::move(samples);
  return CacheState::Read;
}

// The cache's samples when it is there, whole and for these inputs. A cache
// that is not a regular file (a FIFO, a link to a device) or fails its
// checksum is not read: it is rebuilt (the rename replaces the entry itself,
// never what a link points at), and stderr says so once.
bool read_cache(const std::string& cache, const std::string& key, std::vector<Sample>* out) {
  const std::string kind = ::shardtrain::detail::file_kind(cache);
  if (kind == "absent") return false;
  std::string bytes, why;
  if (!::shardtrain::detail::read_regular_file(cache, int64_t{1} << 40, &bytes, &why)) {
    std::fprintf(stderr, "samples cache '%s' cannot be read (%s); rebuilding it\n", cache.c_str(),
                 why.c_str());
    return false;
  }
  switch (deserialise(bytes, key, out)) {
    case CacheState::Read: return true;
    case CacheState::OtherKey: return false;
    case CacheState::Damaged:
      std::fprintf(stderr,
                   "samples cache '%s' fails its checksum (edited or damaged since it was "
                   "written); rebuilding it\n",
                   cache.c_str());
      return false;
  }
  return false;
}

}  // namespace

Sample tokenize_record(const Record& record, const Tokenizer& tokenizer,
                       const SampleOptions& options) {
  Sample s;
  const bool inputs = options.train_on_inputs;
  const auto bos = tokenizer.bos_id();
  const auto eos = tokenizer.eos_id();
  switch (record.kind) {
    case Record::Kind::Text:
      if (bos) append(s, {*bos}, false);
      append(s, tokenizer.encode(record.text), true);
      if (eos) append(s, {*eos}, true);
      break;
    case Record::Kind::PromptCompletion:
      if (bos) append(s, {*bos}, false);
      append(s, tokenizer.encode(record.prompt), inputs);
      append(s, tokenizer.encode(record.completion), true);
      if (eos) append(s, {*eos}, true);
      break;
    case Record::Kind::Chat:
      ST_CHECK(options.chat_template != ChatTemplateKind::Auto, ConfigError, record.origin,
               ": a chat record needs a chat template, and none was found: ", options.no_template);
      for (const Piece& p : render_chat(options.chat_template, record.messages, record.origin)) {
        append(s, tokenizer.encode(p.text), p.trained || inputs);
      }
      break;
  }
  return s;
}

std::string samples_cache_path(const std::string& path, const Tokenizer& tokenizer,
                               const SampleOptions& options) {
  return cache_path_of(path, cache_key(path, tokenizer, options));
}

std::vector<Sample> load_samples(const std::string& path, const Tokenizer& tokenizer,
                                 const SampleOptions& options) {
  const std::string key = cache_key(path, tokenizer, options);
  const std::string cache = cache_path_of(path, key);
  if (std::vector<Sample> cached; read_cache(cache, key, &cached)) return cached;
  std::vector<Sample> samples;
  for (const Record& r : read_jsonl(path)) samples.push_back(tokenize_record(r, tokenizer, options));
  // Written under a name of this process's own, then renamed over the
  // cache: readers see the old file or the whole new one, never a part.
  const std::string mine = cache + "." + std::to_string(::getpid());
  try {
    checkpoint::detail::write_file_atomically(mine, serialise(key, samples));
    std::filesystem::rename(mine, cache);
  } catch (const std::exception&) {
    std::error_code ec;
    std::filesystem::remove(mine, ec);  // no cache: the next run tokenizes again
  }
  return samples;
}

}  // namespace shardtrain::data
