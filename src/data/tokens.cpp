// Byte tokenizer, token sources (text, or token files read with pread) and the
// window sampler.
#include "shardtrain/data/tokens.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <torch/torch.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <random>

#include "checkpoint/detail.h"
#include "core/file.h"
#include "shardtrain/core/error.h"
#include "shuffle.h"

namespace shardtrain::data {

namespace {

constexpr int64_t kHeaderWords = 256;
constexpr int64_t kHeaderBytes = kHeaderWords * static_cast<int64_t>(sizeof(int32_t));

// Closes a file descriptor on every path out of open().
struct FdGuard {
  int fd;
  ~FdGuard() {
    if (fd >= 0) ::close(fd);
  }
  int release() {
    const int out = fd;
    fd = -1;
    return out;
  }
};

// Reads exactly `n` bytes at `offset`; false on a short read.
bool read_exact(int fd, void* buf, size_t n, off_t offset) {
  auto* p = static_cast<char*>(buf);
  while (n > 0) {
    const ssize_t got = ::pread(fd, p, n, offset);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;
    p += got;
    n -= static_cast<size_t>(got);
    offset += got;
  }
  return true;
}

}  // namespace

// ---- tokenizer --------------------------------------------------------------------------

std::vector<int64_t> ByteTokenizer::encode(const std::string& text) {
  std::vector<int64_t> ids(text.size());
  for (size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
  return ids;
}

std::string ByteTokenizer::decode(const std::vector<int64_t>& ids) {
  std::string text(ids.size(), '\0');
  for (size_t i = 0; i < ids.size(); ++i) {
    ST_CHECK(ids[i] >= 0 && ids[i] < kVocabSize, ConfigError, "ByteTokenizer::decode: id ", ids[i],
             " at position ", i, " is outside the byte vocabulary 0..255",
             "; hint: the model's vocab_size must be 256 to use the byte tokenizer");
    text[i] = static_cast<char>(static_cast<unsigned char>(ids[i]));
  }
  return text;
}

// ---- token files ---------------------------------------------------------------------------

// Token files are written as every output is (checkpoint/detail.h: a new
// temporary beside the target, fsynced, renamed over it): a full disk is a
// CheckpointError (exit 3) that leaves what `path` held, and a link planted
// at `path` or beside it is never written through.
namespace {

// The header of a token file of `count` tokens: version 1 (uint16 tokens),
// or 2 with the width (4) in word 3 when `wide`.
std::vector<int32_t> token_file_header(const std::string& path, size_t count, bool wide) {
  ST_CHECK(count <= static_cast<size_t>(INT32_MAX), ConfigError, "cannot write ", count, " tokens to '", path,
           "': the token-file header holds an int32 count; hint: split the data into shards");
  std::vector<int32_t> header(kHeaderWords, 0);
  header[0] = kTokenFileMagic;
  header[1] = wide ? kTokenFileVersionWide : kTokenFileVersion;
  header[2] = static_cast<int32_t>(count);
  if (wide) header[3] = 4;  // token width in bytes
  return header;
}

}  // namespace

void write_token_file(const std::string& path, const std::vector<uint16_t>& tokens) {
  const std::vector<int32_t> header = token_file_header(path, tokens.size(), /*wide=*/false);
  checkpoint::detail::write_file_atomically(
      path, {{header.data(), kHeaderBytes}, {tokens.data(), tokens.size() * sizeof(uint16_t)}});
}

int write_token_runs(const std::string& path, std::vector<std::vector<int32_t>>& runs) {
  size_t count = 0;
  int32_t largest = 0;
  for (const auto& run : runs) {
    for (size_t i = 0; i < run.size(); ++i) {
      ST_CHECK(run[i] >= 0, InvalidArgument, "write_token_file_v2: token ", count + i, " is ", run[i],
               "; token ids are never negative");
      largest = std::max(largest, run[i]);
    }
    count += run.size();
  }
  // Version 1 (every reader of llm.c's layout takes it) when the ids fit.
  const bool narrow = largest < 65536;
  const std::vector<int32_t> header = token_file_header(path, count, /*wide=*/!narrow);
  std::vector<std::pair<const void*, size_t>> pieces{{header.data(), kHeaderBytes}};
  for (auto& run : runs) {
    if (narrow) {
      // In place, front to back: id i's two bytes land at 2i, never past
      // the four bytes of an id not yet read.
      auto* bytes = reinterpret_cast<unsigned char*>(run.data());
      for (size_t i = 0; i < run.size(); ++i) {
        const auto id = static_cast<uint16_t>(run[i]);
        std::memcpy(bytes + 2 * i, &id, sizeof id);
      }
    }
    pieces.emplace_back(run.data(), run.size() * (narrow ? sizeof(uint16_t) : sizeof(int32_t)));
  }
  checkpoint::detail::write_file_atomically(path, pieces);
  return narrow ? 2 : 4;
}

int write_token_file_v2(const std::string& path, const std::vector<int32_t>& tokens) {
  std::vector<std::vector<int32_t>> runs{tokens};
  return write_token_runs(path, runs);
}

// ---- token sources ---------------------------------------------------------------------------

// The tokens behind one or more TokenSources: bytes (text), uint16 words
// (tokens given in memory) or a token file read with pread. Immutable once
// built.
//
// Why pread and not a memory map: a mapped file that is truncated while
// training (a re-copy, a regeneration in place) turns the next read of a
// vanished page into SIGBUS, which kills the rank with no message. A short
// pread is an ordinary return value: the rank names the file and exits 3. A
// SIGBUS handler would be process-wide state shared with LibTorch and every
// loader thread, and checking the size with fstat first still races the
// truncation. A window is a few KB, one pread each from the page cache;
// against a training step that costs nothing.
struct TokenSource::Storage {
  const uint8_t* bytes = nullptr;    // text: one token per byte
  const uint16_t* words = nullptr;   // from_tokens
  int64_t size = 0;

  std::string text;                  // owner of `bytes`
  std::vector<uint16_t> owned;       // owner of `words`
  int fd = -1;                       // a token file: tokens at data_offset, width bytes each
  int64_t width = 0;
  std::string path;

  Storage() = default;
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  ~Storage() {
    if (fd >= 0) ::close(fd);
  }

  /// Tokens [first, first + count) of a token file into out[0, count).
  void read_file(int64_t first, int64_t count, int64_t* out) const;
};

void TokenSource::Storage::read_file(int64_t first, int64_t count, int64_t* out) const {
  constexpr int64_t kChunkTokens = 8192;
  unsigned char buf[kChunkTokens * 4];
  for (int64_t done = 0; done < count;) {
    const int64_t n = std::min(kChunkTokens, count - done);
    const off_t offset = static_cast<off_t>(kHeaderBytes + (first + done) * width);
    const size_t want = static_cast<size_t>(n * width);
    size_t got = 0;
    while (got < want) {
      const ssize_t r = ::pread(fd, buf + got, want - got, offset + static_cast<off_t>(got));
      if (r < 0 && errno == EINTR) continue;
      ST_CHECK(r >= 0, IoError, "cannot read token file '", path, "': ", std::strerror(errno),
               "; hint: check the disk, then resume with checkpoint.resume=auto");
      if (r == 0) {
        struct stat st {};
        const long long now = ::fstat(fd, &st) == 0 ? static_cast<long long>(st.st_size) : -1;
        ST_CHECK(false, IoError, "token file '", path, "' is shorter than when training started: tokens ",
                 first + done, "..", first + done + n - 1, " of ", size, " lie beyond its ", now,
                 " bytes now (it had ", kHeaderBytes + size * width,
                 "); it was truncated or replaced while training; hint: restore the file, then "
                 "resume with checkpoint.resume=auto");
      }
      got += static_cast<size_t>(r);
    }
    if (width == 4) {
      for (int64_t i = 0; i < n; ++i) {
        uint32_t v;
        std::memcpy(&v, buf + 4 * i, 4);
        out[done + i] = v;
      }
    } else {
      for (int64_t i = 0; i < n; ++i) {
        uint16_t v;
        std::memcpy(&v, buf + 2 * i, 2);
        out[done + i] = v;
      }
    }
    done += n;
  }
}

TokenSource::TokenSource(std::shared_ptr<const Storage> storage, int64_t begin, int64_t end,
                         std::string origin)
    : storage_(std::move(storage)), begin_(begin), end_(end), origin_(std::move(origin)) {}

TokenSource TokenSource::from_text(const std::string& text) {
  auto storage = std::make_shared<Storage>();
  storage->text = text;
  storage->bytes = reinterpret_cast<const uint8_t*>(storage->text.data());
  storage->size = static_cast<int64_t>(storage->text.size());
  const int64_t n = storage->size;
  return TokenSource(std::move(storage), 0, n, "<text>");
}

TokenSource TokenSource::from_tokens(std::vector<uint16_t> tokens) {
  auto storage = std::make_shared<Storage>();
  storage->owned = std::move(tokens);
  storage->words = storage->owned.data();
  storage->size = static_cast<int64_t>(storage->owned.size());
  const int64_t n = storage->size;
  return TokenSource(std::move(storage), 0, n, "<tokens>");
}

// Rules beyond the header's: a token file whose header says 0 tokens is a
// ConfigError like an empty text file (write_token_file may still write one);
// a file is taken as text only if it holds no NUL byte, so binary data in
// another layout (a header-less nanoGPT .bin) is an error, not 256-way noise.
TokenSource TokenSource::open(const std::string& path) {
  std::string why;
  const int fd = ::shardtrain::detail::open_regular_for_reading(path, &why);
  ST_CHECK(fd >= 0, ConfigError, "cannot open token source '", path, "': ", why,
           "; hint: check data.train (a UTF-8 text file or a token file with magic ",
           kTokenFileMagic, ")");
  FdGuard guard{fd};
  struct stat st {};
  ST_CHECK(::fstat(fd, &st) == 0, ConfigError, "cannot stat token source '", path, "': ",
           std::strerror(errno), "; hint: check data.train");
  ST_CHECK(S_ISREG(st.st_mode), ConfigError, "token source '", path,
           "' is not a regular file; hint: point data.train at a text or token file");
  const int64_t file_size = static_cast<int64_t>(st.st_size);
  ST_CHECK(file_size > 0, ConfigError, "token source '", path,
           "' is empty; hint: point data.train at a non-empty text or token file");

  int32_t magic = 0;
  if (file_size >= static_cast<int64_t>(sizeof(int32_t))) {
    ST_CHECK(read_exact(fd, &magic, sizeof(magic), 0), ConfigError, "cannot read '", path, "': ",
             std::strerror(errno), "; hint: check data.train");
  }

  if (magic == kTokenFileMagic) {
    // ---- token file: check the header; tokens are read on demand.
    ST_CHECK(file_size >= kHeaderBytes, ConfigError, "token file '", path,
             "' is truncated: expected at least ", kHeaderBytes, " bytes of header, found ",
             file_size, " bytes; hint: regenerate the file");
    std::vector<int32_t> header(kHeaderWords);
    ST_CHECK(read_exact(fd, header.data(), kHeaderBytes, 0), ConfigError, "cannot read header of '",
             path, "': ", std::strerror(errno), "; hint: check data.train");
    ST_CHECK(header[1] == kTokenFileVersion || header[1] == kTokenFileVersionWide, ConfigError,
             "token file '", path, "' has version ", header[1], ", expected ", kTokenFileVersion,
             " (uint16 tokens) or ", kTokenFileVersionWide,
             " (its token width in header word 3); hint: regenerate it with `shardtrain tokenize`");
    // Version 2 records the width; llm.c's own version-2 files leave it 0 and hold uint32.
    const int64_t width = header[1] == kTokenFileVersion ? 2 : header[3] == 0 ? 4 : header[3];
    ST_CHECK(width == 2 || width == 4, ConfigError, "token file '", path, "' has token width ",
             width, " bytes in its header, expected 2 or 4; hint: regenerate it with `shardtrain tokenize`");
    const int64_t count = header[2];
    ST_CHECK(count > 0, ConfigError, "token file '", path, "' holds ", count,
             " tokens; hint: a training source needs at least one window of tokens");
    const int64_t expected = kHeaderBytes + count * width;
    ST_CHECK(file_size == expected, ConfigError, "token file '", path, "' is ",
             file_size < expected ? "truncated" : "longer than its header says", ": header says ",
             count, " tokens, so expected ", expected, " bytes, found ", file_size,
             " bytes; hint: regenerate the file or re-copy it completely");

    auto storage = std::make_shared<Storage>();
    storage->fd = guard.release();
    storage->width = width;
    storage->path = path;
    storage->size = count;
    return TokenSource(std::move(storage), 0, count, path);
  }

  // ---- text: read it whole; each byte is a token.
  auto storage = std::make_shared<Storage>();
  storage->text.resize(static_cast<size_t>(file_size));
  ST_CHECK(read_exact(fd, storage->text.data(), storage->text.size(), 0), ConfigError,
           "cannot read '", path, "': ", std::strerror(errno), "; hint: check data.train");
  // Text never holds NUL bytes; a file that does is binary data in some other
  // layout (a header-less .bin, a token file of another version, a checkpoint).
  const auto nul = storage->text.find('\0');
  ST_CHECK(nul == std::string::npos, ConfigError, "'", path,
           "' is neither text nor a token file: it holds a NUL byte at offset ", nul,
           " and does not start with the token-file magic ", kTokenFileMagic,
           "; hint: convert it with write_token_file or point data.train at UTF-8 text");
  storage->bytes = reinterpret_cast<const uint8_t*>(storage->text.data());
  storage->size = file_size;
  return TokenSource(std::move(storage), 0, file_size, path);
}

TokenSource TokenSource::slice(int64_t begin, int64_t end) const {
  ST_CHECK(0 <= begin && begin <= end && end <= size(), InvalidArgument, "TokenSource::slice [",
           begin, ", ", end, ") is outside [0, ", size(), ") of ", origin_);
  return TokenSource(storage_, begin_ + begin, begin_ + end, origin_);
}

void TokenSource::copy_to(int64_t start, int64_t count, int64_t* out) const {
  ST_CHECK(start >= 0 && count >= 0 && start + count <= size(), InvalidArgument,
           "TokenSource::copy_to [", start, ", ", start + count, ") is outside [0, ", size(),
           ") of ", origin_);
  const int64_t first = begin_ + start;
  if (storage_->bytes != nullptr) {
    const uint8_t* src = storage_->bytes + first;
    for (int64_t i = 0; i < count; ++i) out[i] = src[i];
  } else if (storage_->words != nullptr) {
    const uint16_t* src = storage_->words + first;
    for (int64_t i = 0; i < count; ++i) out[i] = src[i];
  } else {
    storage_->read_file(first, count, out);
  }
}

int64_t TokenSource::max_token() const {
  int64_t best = -1;
  std::vector<int64_t> chunk(static_cast<size_t>(std::min<int64_t>(size(), int64_t{1} << 16)));
  for (int64_t i = 0; i < size(); i += static_cast<int64_t>(chunk.size())) {
    const int64_t n = std::min<int64_t>(static_cast<int64_t>(chunk.size()), size() - i);
    copy_to(i, n, chunk.data());
    for (int64_t k = 0; k < n; ++k) best = std::max(best, chunk[static_cast<size_t>(k)]);
  }
  return best;
}

// ---- window sampler ---------------------------------------------------------------------------

WindowSampler::WindowSampler(TokenSource tokens, int64_t block_size, int64_t global_batch,
                             uint64_t seed, bool shuffle)
    : tokens_(std::move(tokens)),
      block_size_(block_size),
      global_batch_(global_batch),
      seed_(seed),
      shuffle_(shuffle),
      num_windows_(0) {
  ST_CHECK(block_size_ > 0, ConfigError, "model.block_size=", block_size_,
           " must be positive; hint: set model.block_size");
  ST_CHECK(global_batch_ > 0, ConfigError, "global batch size ", global_batch_,
           " must be positive; hint: set batch.global");
  // A window needs block_size + 1 tokens (inputs plus the shifted targets);
  // windows start at multiples of block_size and overlap by one token.
  num_windows_ = tokens_.size() >= 1 ? (tokens_.size() - 1) / block_size_ : 0;
  ST_CHECK(num_windows_ >= global_batch_, ConfigError, "'", tokens_.origin(), "' holds ",
           tokens_.size(), " tokens = ", num_windows_, " windows of block_size+1=",
           block_size_ + 1, " tokens, fewer than one global batch (batch.global) of ",
           global_batch_,
           " windows; hint: use more data, a smaller global batch or a smaller block_size");
}

// The permutation is recomputed only when the epoch changes, so one call
// costs O(1) within an epoch. The cache makes a sampler unsafe to share
// between threads: give each loader thread its own copy.
int64_t WindowSampler::window_at(int64_t epoch, int64_t i) const {
  if (!shuffle_) return i;
  if (cached_epoch_ != epoch) {
    cached_order_ = detail::permutation(num_windows_, seed_, epoch);
    cached_epoch_ = epoch;
  }
  return cached_order_[static_cast<size_t>(i)];
}

Batch WindowSampler::micro_batch(int64_t step, int64_t micro_step, int64_t micro_batch, int rank,
                                 int world_size) const {
  ST_CHECK(step >= 0, InvalidArgument, "WindowSampler::micro_batch: step ", step,
           " must be >= 0");
  ST_CHECK(micro_batch > 0 && world_size > 0 && rank >= 0 && rank < world_size, InvalidArgument,
           "WindowSampler::micro_batch: micro_batch=", micro_batch, ", rank=", rank,
           ", world_size=", world_size, " are not a valid split");
  ST_CHECK(micro_step >= 0 && (micro_step + 1) * world_size * micro_batch <= global_batch_,
           InvalidArgument, "WindowSampler::micro_batch: micro-step ", micro_step, " of ",
           micro_batch, " rows on ", world_size, " ranks runs past the global batch of ",
           global_batch_, "; hint: micro_batch * world_size * accumulation must equal it");

  return step_rows(step, (micro_step * world_size + rank) * micro_batch, micro_batch);
}

Batch WindowSampler::step_rows(int64_t step, int64_t first, int64_t count) const {
  ST_CHECK(step >= 0 && first >= 0 && count >= 0 && first + count <= global_batch_, InvalidArgument,
           "WindowSampler::step_rows: rows [", first, ", ", first + count, ") of step ", step,
           " are outside its global batch of ", global_batch_);
  const int64_t t = block_size_;
  const int64_t epoch = epoch_of(step);
  const int64_t start_row = (step % steps_per_epoch()) * global_batch_ + first;
  auto input = torch::empty({count, t}, torch::kLong);
  auto target = torch::empty({count, t}, torch::kLong);
  int64_t* in = input.data_ptr<int64_t>();
  int64_t* tg = target.data_ptr<int64_t>();
  for (int64_t r = 0; r < count; ++r) {
    const int64_t start = window_at(epoch, start_row + r) * t;
    tokens_.copy_to(start, t, in + r * t);
    tokens_.copy_to(start + 1, t, tg + r * t);
  }
  return Batch{input, target, {}, {}};
}

}  // namespace shardtrain::data
