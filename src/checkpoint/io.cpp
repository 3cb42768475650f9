// The checksum, raw file I/O and dtype names shared by the checkpoint and
// safetensors code.
//
// CRC32C is our own: Debian offers no usable library here (libxxhash0 is
// installed without headers and is not among the Makefile's packages;
// Google's crc32c is not packaged), and LibTorch's copy is internal. It is
// the standard Castagnoli CRC, so `crc32c` tools elsewhere can check files.
#include <fcntl.h>
#include <nmmintrin.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <random>
#include <utility>

#include "checkpoint/detail.h"
#include "core/file.h"
#include "shardtrain/core/error.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "checkpoint files are little-endian and are written with memcpy: a big-endian port must swap bytes"
#endif

namespace shardtrain::checkpoint::detail {

namespace fs = std::filesystem;

// ---- CRC32C ---------------------------------------------------------------------------

namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // Castagnoli, reflected

using Tables = std::array<std::array<uint32_t, 256>, 8>;

Tables make_tables() {
  Tables t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ ((c & 1u) ? kPoly : 0u);
    t[0][i] = c;
  }
  for (uint32_t i = 0; i < 256; ++i) {
    for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFFu];
  }
  return t;
}

const Tables& tables() {
  static const Tables t = make_tables();
  return t;
}

__attribute__((target("sse4.2"))) uint32_t crc32c_sse42(uint32_t crc, const void* data,
                                                        size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint64_t c = ~crc & 0xFFFFFFFFu;
  while (n > 0 && (reinterpret_cast<uintptr_t>(p) & 7u) != 0) {
    c = _mm_crc32_u8(static_cast<uint32_t>(c), *p++);
    --n;
  }
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c = _mm_crc32_u64(c, v);
    p += 8;
    n -= 8;
  }
  while (n > 0) {
    c = _mm_crc32_u8(static_cast<uint32_t>(c), *p++);
    --n;
  }
  return ~static_cast<uint32_t>(c);
}

using CrcFn = uint32_t (*)(uint32_t, const void*, size_t);

CrcFn pick_crc() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("sse4.2") ? crc32c_sse42 : crc32c_software;
}

}  // namespace

uint32_t crc32c_software(uint32_t crc, const void* data, size_t n) {
  const Tables& t = tables();
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t c = ~crc;
  while (n > 0 && (reinterpret_cast<uintptr_t>(p) & 7u) != 0) {
    c = t[0][(c ^ *p++) & 0xFFu] ^ (c >> 8);
    --n;
  }
  while (n >= 8) {
    uint32_t lo, hi;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + 4, 4);
    lo ^= c;
    c = t[7][lo & 0xFFu] ^ t[6][(lo >> 8) & 0xFFu] ^ t[5][(lo >> 16) & 0xFFu] ^ t[4][lo >> 24] ^
        t[3][hi & 0xFFu] ^ t[2][(hi >> 8) & 0xFFu] ^ t[1][(hi >> 16) & 0xFFu] ^ t[0][hi >> 24];
    p += 8;
    n -= 8;
  }
  while (n > 0) {
    c = t[0][(c ^ *p++) & 0xFFu] ^ (c >> 8);
    --n;
  }
  return ~c;
}

uint32_t crc32c(uint32_t crc, const void* data, size_t n) {
  static const CrcFn fn = pick_crc();
  return fn(crc, data, n);
}

void ChunkedCrc::update(const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  file_crc_ = crc32c(file_crc_, p, n);
  while (n > 0) {
    const size_t take = std::min<size_t>(n, static_cast<size_t>(chunk_bytes_ - in_chunk_));
    chunk_crc_ = crc32c(chunk_crc_, p, take);
    in_chunk_ += static_cast<int64_t>(take);
    bytes_ += static_cast<int64_t>(take);
    p += take;
    n -= take;
    if (in_chunk_ == chunk_bytes_) {
      chunks_.push_back(chunk_crc_);
      chunk_crc_ = 0;
      in_chunk_ = 0;
    }
  }
}

void ChunkedCrc::finish() {
  if (in_chunk_ > 0) chunks_.push_back(chunk_crc_);
  chunk_crc_ = 0;
  in_chunk_ = 0;
}

// ---- files ----------------------------------------------------------------------------

namespace {

std::mutex& hook_mutex() {
  static std::mutex m;
  return m;
}
WriteHook& hook_slot() {
  static WriteHook hook;
  return hook;
}

std::string errno_text() { return std::strerror(errno); }

}  // namespace

void set_write_hook(WriteHook hook) {
  std::lock_guard<std::mutex> lock(hook_mutex());
  hook_slot() = std::move(hook);
}

OutFile::OutFile(std::string path, int64_t chunk_bytes)
    : OutFile(path, chunk_bytes, ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0644)) {}

OutFile::OutFile(std::string path, int64_t chunk_bytes, int fd)
    : path_(std::move(path)), fd_(fd), crc_(chunk_bytes), chunk_bytes_(chunk_bytes) {
  ST_CHECK(fd_ >= 0, CheckpointError, "cannot create '", path_, "': ", errno_text(),
           ". Hint: check that the directory is writable and the disk is not full.");
}

std::string temporary_name_beside(const std::string& target) {
  static std::mutex mutex;
  static std::mt19937_64 bits{std::random_device{}() ^ (static_cast<uint64_t>(::getpid()) << 32)};
  uint64_t r = 0;
  {
    std::lock_guard<std::mutex> lock(mutex);
    r = bits();
  }
  static const char* kHex = "0123456789abcdef";
  std::string name = target + ".tmp.";
  for (int i = 0; i < 12; ++i, r >>= 4) name.push_back(kHex[r & 15]);
  return name;
}

std::unique_ptr<OutFile> OutFile::beside(const std::string& target, int64_t chunk_bytes) {
  // A FIFO, a device or a directory named as the output is refused: the
  // rename would put a file in its place (as root, over /dev/null too).
  struct stat st {};
  ST_CHECK(::lstat(target.c_str(), &st) != 0 || S_ISREG(st.st_mode) || S_ISLNK(st.st_mode), ConfigError,
           "cannot write '", target, "': it is ", ::shardtrain::detail::file_kind(target),
           ", not a regular file; nothing was written. Hint: name a new file, or a regular one to replace");
  // A name already taken (a planted file or link, a crashed writer's
  // leftover) is skipped, not reused: O_EXCL fails on it, and O_NOFOLLOW
  // keeps even a dangling link from being created through.
  for (int attempt = 0;; ++attempt) {
    std::string tmp = temporary_name_beside(target);
    const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd >= 0 || errno != EEXIST || attempt == 15) {
      return std::unique_ptr<OutFile>(new OutFile(std::move(tmp), chunk_bytes, fd));
    }
  }
}

OutFile::~OutFile() {
  if (fd_ >= 0) ::close(fd_);
}

void OutFile::write(const void* data, size_t n) {
  // Blocks of at most 8 MiB: the checksum of a block is computed while it
  // is still in cache, and the test hook sees progress on big tensors.
  constexpr size_t kBlock = size_t{8} << 20;
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    const size_t block = std::min(n, kBlock);
    crc_.update(p, block);
    size_t done = 0;
    while (done < block) {
      const ssize_t w = ::write(fd_, p + done, block - done);
      if (w < 0 && errno == EINTR) continue;
      ST_CHECK(w > 0, CheckpointError, "cannot write '", path_, "': ", errno_text(),
               ". Hint: check free disk space.");
      done += static_cast<size_t>(w);
    }
    p += block;
    n -= block;
    WriteHook hook;
    {
      std::lock_guard<std::mutex> lock(hook_mutex());
      hook = hook_slot();
    }
    if (hook) hook(path_, crc_.bytes());
  }
}

void OutFile::pad_to(int64_t alignment) {
  static const char zeros[256] = {};
  int64_t pad = (alignment - bytes() % alignment) % alignment;
  while (pad > 0) {
    const int64_t n = std::min<int64_t>(pad, sizeof(zeros));
    write(zeros, static_cast<size_t>(n));
    pad -= n;
  }
}

FileInfo OutFile::close_and_sync() {
  crc_.finish();
  ST_CHECK(::fsync(fd_) == 0, CheckpointError, "cannot fsync '", path_, "': ", errno_text());
  const int rc = ::close(fd_);
  fd_ = -1;
  ST_CHECK(rc == 0, CheckpointError, "cannot close '", path_, "': ", errno_text());
  FileInfo info;
  info.name = fs::path(path_).filename().string();
  info.bytes = crc_.bytes();
  info.crc32c = crc_.file_crc();
  info.chunk_bytes = chunk_bytes_;
  info.chunk_crc32c = crc_.chunk_crcs();
  return info;
}

void fsync_dir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  ST_CHECK(fd >= 0, CheckpointError, "cannot open directory '", dir, "': ", errno_text());
  const int rc = ::fsync(fd);
  const std::string err = errno_text();
  ::close(fd);
  ST_CHECK(rc == 0, CheckpointError, "cannot fsync directory '", dir, "': ", err);
}

void write_file_atomically(const std::string& path, const std::string& bytes) {
  write_file_atomically(path, {{bytes.data(), bytes.size()}});
}

void write_file_atomically(const std::string& path, const std::vector<std::pair<const void*, size_t>>& pieces) {
  std::unique_ptr<OutFile> f = OutFile::beside(path, int64_t{1} << 20);
  const std::string tmp = f->path();
  std::error_code ec;
  try {
    for (const auto& [data, n] : pieces) f->write(data, n);
    f->close_and_sync();
    f.reset();
    fs::rename(tmp, path, ec);
    ST_CHECK(!ec, CheckpointError, "cannot rename '", tmp, "' to '", path, "': ", ec.message());
  } catch (...) {
    f.reset();
    fs::remove(tmp, ec);  // a full disk leaves no half-written file behind
    throw;
  }
  const std::string parent = fs::path(path).parent_path().string();
  fsync_dir(parent.empty() ? "." : parent);
}

void pread_exact(int fd, void* buf, size_t n, int64_t offset, const std::string& path) {
  auto* p = static_cast<char*>(buf);
  while (n > 0) {
    const ssize_t r = ::pread(fd, p, n, static_cast<off_t>(offset));
    if (r < 0 && errno == EINTR) continue;
    ST_CHECK(r >= 0, CheckpointError, "cannot read '", path, "': ", errno_text());
    ST_CHECK(r > 0, CheckpointError, "'", path, "' ends at byte ", offset,
             " but more data was expected: the file is truncated. Hint: load an older "
             "checkpoint or restore the file.");
    p += r;
    n -= static_cast<size_t>(r);
    offset += r;
  }
}

std::string read_small_file(const std::string& path, int64_t max_bytes) {
  std::string why;
  const int fd = ::shardtrain::detail::open_regular_for_reading(path, &why);
  ST_CHECK(fd >= 0, CheckpointError, "cannot open '", path, "': ", why,
           "; it is not part of a shardtrain checkpoint");
  struct stat st {};
  if (::fstat(fd, &st) != 0 || st.st_size > max_bytes) {
    ::close(fd);
    ST_CHECK(false, CheckpointError, "'", path, "' is not a regular file of at most ", max_bytes,
             " bytes; it is not part of a shardtrain checkpoint");
  }
  std::string out(static_cast<size_t>(st.st_size), '\0');
  try {
    pread_exact(fd, out.data(), out.size(), 0, path);
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
  return out;
}

// ---- dtypes ----------------------------------------------------------------------------

namespace {

struct DtypeName {
  at::ScalarType type;
  const char* name;
  int64_t bytes;
};

constexpr DtypeName kDtypes[] = {
    {at::kDouble, "F64", 8}, {at::kFloat, "F32", 4}, {at::kHalf, "F16", 2},
    {at::kBFloat16, "BF16", 2}, {at::kLong, "I64", 8}, {at::kInt, "I32", 4},
    {at::kShort, "I16", 2},  {at::kChar, "I8", 1},   {at::kByte, "U8", 1},
    {at::kBool, "BOOL", 1},
};

}  // namespace

std::string dtype_name(at::ScalarType type) {
  for (const auto& d : kDtypes) {
    if (d.type == type) return d.name;
  }
  ST_CHECK(false, CheckpointError, "cannot store a tensor of dtype ", c10::toString(type),
           "; supported: float64, float32, float16, bfloat16, int64, int32, int16, int8, "
           "uint8, bool");
  return {};
}

at::ScalarType dtype_from_name(const std::string& name, const std::string& what) {
  for (const auto& d : kDtypes) {
    if (name == d.name) return d.type;
  }
  ST_CHECK(false, CheckpointError, what, " has unknown dtype '", name,
           "'; known: F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL");
  return at::kFloat;
}

int64_t dtype_bytes(const std::string& name) {
  for (const auto& d : kDtypes) {
    if (name == d.name) return d.bytes;
  }
  return 0;
}

}  // namespace shardtrain::checkpoint::detail
