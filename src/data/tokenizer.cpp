// load_tokenizer: which kind a spec names, and the byte tokenizer.
#include "shardtrain/data/tokenizer.h"

#include <dlfcn.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <mutex>

#include "core/file.h"
#include "data/tokenizer_kinds.h"
#include "shardtrain/core/error.h"

namespace shardtrain::data {

namespace detail {

namespace {

// Bytes are tokens (ByteTokenizer's ids, without LibTorch): vocabulary 256,
// lossless for any text, no special tokens.
class BytesTokenizer : public Tokenizer {
 public:
  std::vector<int32_t> encode(std::string_view text, bool) const override {
    std::vector<int32_t> ids(text.size());
    for (size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
    return ids;
  }
  std::string decode(const std::vector<int32_t>& ids, bool) const override {
    std::string text(ids.size(), '\0');
    for (size_t i = 0; i < ids.size(); ++i) {
      ST_CHECK(ids[i] >= 0 && ids[i] < 256, ConfigError, "decode: id ", ids[i], " at position ", i,
               " is outside the byte vocabulary 0..255; hint: the model's vocab_size must be 256 to use the byte tokenizer");
      text[i] = static_cast<char>(static_cast<unsigned char>(ids[i]));
    }
    return text;
  }
  int64_t vocab_size() const override { return 256; }
  std::optional<int32_t> token_to_id(std::string_view token) const override {
    if (token.size() != 1) return std::nullopt;
    return static_cast<unsigned char>(token[0]);
  }
  std::optional<int32_t> bos_id() const override { return std::nullopt; }
  std::optional<int32_t> eos_id() const override { return std::nullopt; }
  std::string kind() const override { return "bytes"; }
  std::string fingerprint() const override { return fingerprint_hex(kind(), fnv1a("bytes")); }
};

bool is_file(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}
bool is_dir(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}
bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// Why `path`, which is there, cannot be read: a dangling link, a FIFO, a
// device ("" when it is a readable regular file).
std::string unreadable(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) == 0 && S_ISLNK(st.st_mode) && ::stat(path.c_str(), &st) != 0 && errno == ENOENT) {
    char target[4096];
    const ssize_t n = ::readlink(path.c_str(), target, sizeof(target) - 1);
    return "it is a dangling link (to '" + std::string(target, n > 0 ? static_cast<size_t>(n) : 0) + "', which does not exist)";
  }
  std::string why;
  const int fd = ::shardtrain::detail::open_regular_for_reading(path, &why);
  if (fd < 0) return why.empty() ? "it cannot be opened" : why;
  ::close(fd);
  return "";
}

// tokenizer.json, else tokenizer.model, in `dir`; "" when neither is there.
// One that is there but cannot be read (a dangling link: a download that did
// not finish) is a ConfigError, never passed over: under "auto" the run would
// quietly fall back to the byte tokenizer.
std::string find_in_dir(const std::string& dir) {
  const std::string base = ends_with(dir, "/") ? dir : dir + "/";
  for (const char* name : {"tokenizer.json", "tokenizer.model"}) {
    const std::string path = base + name;
    struct stat st {};
    if (::lstat(path.c_str(), &st) != 0 && errno == ENOENT) continue;
    const std::string why = unreadable(path);
    ST_CHECK(why.empty(), ConfigError, "the model directory's ", name, " cannot be read: '", path, "': ", why,
             "; hint: fetch the model's tokenizer files again, or set data.tokenizer (--tokenizer) to another file or to bytes");
    return path;
  }
  return "";
}

// ---- SentencePiece, through its own module (see src/data/sentencepiece/module.cpp).

using MakeSentencePiece = Tokenizer* (*)(const std::string& path, const std::string& bytes);

// libshardtrain_sentencepiece.so beside this library (the build tree and the
// install keep them together), loaded once and kept.
MakeSentencePiece sentencepiece_factory() {
  static std::once_flag once;
  static MakeSentencePiece make = nullptr;
  static std::string error;
  std::call_once(once, [] {
    Dl_info info{};
    std::string dir = ".";
    if (::dladdr(reinterpret_cast<void*>(&sentencepiece_factory), &info) != 0 && info.dli_fname != nullptr) {
      const std::string self = info.dli_fname;
      const size_t slash = self.find_last_of('/');
      if (slash != std::string::npos) dir = self.substr(0, slash);
    }
    const std::string module = dir + "/libshardtrain_sentencepiece.so";
    void* handle = ::dlopen(module.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND);
    if (handle == nullptr) {
      error = ::dlerror();
      return;
    }
    make = reinterpret_cast<MakeSentencePiece>(::dlsym(handle, "shardtrain_make_sentencepiece_tokenizer"));
    if (make == nullptr) error = "no shardtrain_make_sentencepiece_tokenizer in " + module;
  });
  ST_CHECK(make != nullptr, ConfigError, "SentencePiece support is not available: ", error,
           "; hint: install libsentencepiece0 and keep libshardtrain_sentencepiece.so beside libshardtrain.so");
  return make;
}

}  // namespace

std::shared_ptr<const Tokenizer> load_sentencepiece_tokenizer(const std::string& path) {
  const std::string bytes = read_tokenizer_file(path);
  return std::shared_ptr<const Tokenizer>(sentencepiece_factory()(path, bytes));
}

namespace {

std::shared_ptr<const Tokenizer> load_file(const std::string& path) {
  if (ends_with(path, ".model")) return load_sentencepiece_tokenizer(path);
  if (ends_with(path, ".json")) return load_hf_tokenizer(path);
  // Another name: a JSON file starts with '{', a SentencePiece model never does.
  const std::string head = read_tokenizer_file(path).substr(0, 1);
  return head == "{" ? load_hf_tokenizer(path) : load_sentencepiece_tokenizer(path);
}

}  // namespace

std::shared_ptr<const Tokenizer> make_byte_tokenizer() { return std::make_shared<BytesTokenizer>(); }

}  // namespace detail

std::shared_ptr<const Tokenizer> load_tokenizer(const std::string& spec, const std::string& model_dir) {
  if (spec == "bytes") return detail::make_byte_tokenizer();
  if (spec == "auto") {
    if (model_dir.empty() || !detail::is_dir(model_dir)) return detail::make_byte_tokenizer();
    const std::string found = detail::find_in_dir(model_dir);
    return found.empty() ? detail::make_byte_tokenizer() : detail::load_file(found);
  }
  if (detail::is_dir(spec)) {
    const std::string found = detail::find_in_dir(spec);
    ST_CHECK(!found.empty(), ConfigError, "tokenizer directory '", spec,
             "' holds neither tokenizer.json nor tokenizer.model (supported: a Hugging Face tokenizer.json with a BPE model, a SentencePiece tokenizer.model, \"bytes\", \"auto\"); hint: point --tokenizer at the model's directory or file");
    return detail::load_file(found);
  }
  struct stat st {};
  if (::lstat(spec.c_str(), &st) == 0) {
    const std::string why = detail::unreadable(spec);
    ST_CHECK(why.empty(), ConfigError, "cannot read tokenizer '", spec, "': ", why,
             "; hint: point --tokenizer / data.tokenizer at a regular tokenizer.json or tokenizer.model");
  }
  ST_CHECK(detail::is_file(spec), ConfigError, "tokenizer '", spec,
           "' is neither \"bytes\", \"auto\", a file nor a directory (supported: a Hugging Face tokenizer.json with a BPE model, a SentencePiece tokenizer.model, \"bytes\", \"auto\"); hint: check the path");
  return detail::load_file(spec);
}

std::vector<std::string> tokenizer_files(const std::string& spec, const std::string& model_dir) {
  std::string file;
  if (spec == "auto") {
    if (!model_dir.empty() && detail::is_dir(model_dir)) file = detail::find_in_dir(model_dir);
  } else if (spec != "bytes") {
    file = detail::is_dir(spec) ? detail::find_in_dir(spec) : spec;
  }
  if (file.empty()) return {};
  std::vector<std::string> files = {file};
  const size_t slash = file.find_last_of('/');
  const std::string dir = slash == std::string::npos ? "" : file.substr(0, slash + 1);
  for (const char* extra : {"tokenizer_config.json", "special_tokens_map.json"}) {
    if (detail::is_file(dir + extra)) files.push_back(dir + extra);
  }
  return files;
}

}  // namespace shardtrain::data
