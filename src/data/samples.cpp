// Tokenizing records into masked samples, and the samples' cache file.
#include "shardtrain/data/samples.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "checkpoint/detail.h"
#include "shardtrain/core/error.h"
#include "shardtrain/data/chat_template.h"

namespace shardtrain::data {

namespace {

constexpr char kCacheMagic[8] = {'S', 'T', 'S', 'M', 'P', 'L', '0', '1'};

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

// Everything that decides the samples' ids and masks.
std::string cache_key(const std::string& path, const Tokenizer& tokenizer,
                      const SampleOptions& options) {
  struct stat st {};
  ST_CHECK(::stat(path.c_str(), &st) == 0, ConfigError, "data.train '", path,
           "' cannot be read: ", std::strerror(errno));
  std::ostringstream key;
  key << "tokenizer=" << tokenizer.fingerprint() << ";template="
      << enum_name(options.chat_template) << ";train_on_inputs=" << options.train_on_inputs
      << ";size=" << st.st_size << ";mtime=" << st.st_mtim.tv_sec << "." << st.st_mtim.tv_nsec
      << ";format=1";
  return key.str();
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
  return out;
}

// The cached samples, or false when the file is absent, for other inputs
// (key differs) or damaged.
bool deserialise(const std::string& bytes, const std::string& key, std::vector<Sample>* out) {
  size_t at = 0;
  const auto take = [&](void* dst, size_t n) {
    if (bytes.size() - at < n) return false;
    std::memcpy(dst, bytes.data() + at, n);
    at += n;
    return true;
  };
  char magic[sizeof(kCacheMagic)];
  uint64_t key_size = 0, count = 0;
  if (!take(magic, sizeof(magic)) || std::memcmp(magic, kCacheMagic, sizeof(magic)) != 0) return false;
  if (!take(&key_size, sizeof(key_size)) || key_size != key.size()) return false;
  if (bytes.compare(at, key.size(), key) != 0) return false;
  at += key.size();
  if (!take(&count, sizeof(count))) return false;
  std::vector<Sample> samples;
  for (uint64_t i = 0; i < count; ++i) {
    uint64_t n = 0;
    if (!take(&n, sizeof(n)) || n > bytes.size()) return false;
    Sample s;
    s.ids.resize(n);
    s.trained.resize(n);
    if (!take(s.ids.data(), n * sizeof(int32_t)) || !take(s.trained.data(), n)) return false;
    samples.push_back(std::move(s));
  }
  if (at != bytes.size()) return false;
  *out = std::move(samples);
  return true;
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
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx",
                static_cast<unsigned long long>(fnv1a(cache_key(path, tokenizer, options))));
  return path + ".shardtrain-" + hex + ".samples";
}

std::vector<Sample> load_samples(const std::string& path, const Tokenizer& tokenizer,
                                 const SampleOptions& options) {
  const std::string key = cache_key(path, tokenizer, options);
  const std::string cache = samples_cache_path(path, tokenizer, options);
  {
    std::ifstream in(cache, std::ios::binary);
    if (in.good()) {
      std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      std::vector<Sample> cached;
      if (deserialise(bytes, key, &cached)) return cached;
    }
  }
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
