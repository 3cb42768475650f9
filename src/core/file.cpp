#include "core/file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <openssl/evp.h>

#include <cerrno>
#include <cstring>
#include <memory>

#include "shardtrain/core/error.h"

namespace shardtrain::detail {

namespace {

const char* kind_of(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a plain file";
}

// O_NONBLOCK makes open() return at once for a FIFO without a peer (and a
// device); the type is checked on the descriptor itself, so a file swapped
// in between cannot slip through, and blocking is restored for reads.
int open_checked(const std::string& path, int flags, std::string* why) {
  const int fd = ::open(path.c_str(), flags | O_NONBLOCK | O_CLOEXEC, 0644);
  if (fd < 0) {
    const int err = errno;
    struct stat st {};
    // A FIFO opened for writing without a reader fails with ENXIO: say what it is.
    if (err == ENXIO && ::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) {
      *why = std::string("it is ") + kind_of(st.st_mode) + ", not a regular file";
      errno = EINVAL;
    } else {
      *why = std::strerror(err);
      errno = err;
    }
    return -1;
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    *why = std::strerror(err);
    ::close(fd);
    errno = err;
    return -1;
  }
  if (!S_ISREG(st.st_mode)) {
    *why = std::string("it is ") + kind_of(st.st_mode) + ", not a regular file";
    ::close(fd);
    errno = EINVAL;
    return -1;
  }
  const int fl = ::fcntl(fd, F_GETFL);
  if (fl >= 0) ::fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
  return fd;
}

}  // namespace

int open_regular_for_reading(const std::string& path, std::string* why) {
  return open_checked(path, O_RDONLY, why);
}

int open_regular_for_append(const std::string& path, std::string* why) {
  return open_checked(path, O_WRONLY | O_APPEND | O_CREAT, why);
}

void append_whole(int fd, const std::string& data, const std::string& path, const char* unit) {
  struct stat st {};
  const off_t before = ::fstat(fd, &st) == 0 ? st.st_size : -1;
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t w = ::write(fd, data.data() + done, data.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      const std::string why = w < 0 ? std::strerror(errno) : "nothing was written";
      const bool restored = before >= 0 && ::ftruncate(fd, before) == 0;
      ST_CHECK(false, IoError, "cannot append to ", path, ": ", why,
               restored ? str_cat("; the partial ", unit, " was removed") : std::string(),
               ". Hint: free disk space under run.dir; checkpoints already written are intact");
    }
    done += static_cast<size_t>(w);
  }
}

bool read_regular_file(const std::string& path, long long max_bytes, std::string* out,
                       std::string* why) {
  const int fd = open_regular_for_reading(path, why);
  if (fd < 0) return false;
  struct stat st {};
  if (::fstat(fd, &st) != 0 || st.st_size > max_bytes) {
    *why = st.st_size > max_bytes ? "it is larger than " + std::to_string(max_bytes) + " bytes"
                                  : std::string(std::strerror(errno));
    ::close(fd);
    return false;
  }
  out->clear();
  char buf[1 << 16];
  while (true) {
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      *why = std::strerror(errno);
      ::close(fd);
      return false;
    }
    if (n == 0) break;
    out->append(buf, static_cast<size_t>(n));
    if (static_cast<long long>(out->size()) > max_bytes) {
      *why = "it is larger than " + std::to_string(max_bytes) + " bytes";
      ::close(fd);
      return false;
    }
  }
  ::close(fd);
  return true;
}

std::string file_kind(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) return S_ISREG(st.st_mode) ? "a regular file" : kind_of(st.st_mode);
  const int err = errno;
  if (::lstat(path.c_str(), &st) == 0 && S_ISLNK(st.st_mode)) return "a dangling symbolic link";
  return err == ENOENT ? "absent" : std::string(std::strerror(err));
}

bool read_regular_prefix(const std::string& path, size_t n, std::string* out, std::string* why) {
  const int fd = open_regular_for_reading(path, why);
  if (fd < 0) return false;
  out->assign(n, '\0');
  size_t got = 0;
  while (got < n) {
    const ssize_t r = ::read(fd, out->data() + got, n - got);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      *why = std::strerror(errno);
      ::close(fd);
      return false;
    }
    if (r == 0) break;
    got += static_cast<size_t>(r);
  }
  ::close(fd);
  out->resize(got);
  return true;
}

LineReader::~LineReader() {
  if (fd_ >= 0) ::close(fd_);
}

bool LineReader::open(const std::string& path, std::string* why) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = open_regular_for_reading(path, why);
  buf_.clear();
  at_ = 0;
  lines_ = 0;
  eof_ = fd_ < 0;
  return fd_ >= 0;
}

// The buffer holds what has been read and not yet returned, from at_; it
// grows only while one line is longer than a read, up to the cap.
LineReader::Status LineReader::next(std::string* line, std::string* why) {
  constexpr size_t kChunk = 1 << 16;
  size_t scanned = at_;
  while (true) {
    const size_t nl = buf_.find('\n', scanned);
    if (nl != std::string::npos) {
      if (static_cast<long long>(nl - at_) > max_line_) break;
      line->assign(buf_, at_, nl - at_);
      at_ = nl + 1;
      ++lines_;
      return Status::Line;
    }
    scanned = buf_.size();
    if (static_cast<long long>(buf_.size() - at_) > max_line_) break;
    if (eof_) {
      if (at_ == buf_.size()) return Status::End;
      line->assign(buf_, at_, std::string::npos);
      at_ = buf_.size();
      ++lines_;
      return Status::Line;
    }
    if (at_ > 0) {  // drop what was returned before reading more
      buf_.erase(0, at_);
      scanned -= at_;
      at_ = 0;
    }
    const size_t old = buf_.size();
    buf_.resize(old + kChunk);
    ssize_t r;
    do {
      r = ::read(fd_, buf_.data() + old, kChunk);
    } while (r < 0 && errno == EINTR);
    if (r < 0) {
      *why = std::strerror(errno);
      buf_.clear();
      at_ = 0;
      eof_ = true;
      return Status::Error;
    }
    buf_.resize(old + static_cast<size_t>(r));
    if (r == 0) eof_ = true;
  }
  *why = "line " + std::to_string(lines_ + 1) + " is longer than " + std::to_string(max_line_) + " bytes";
  buf_.clear();
  at_ = 0;
  eof_ = true;
  return Status::TooLong;
}

std::string sha256_hex(const void* data, size_t n) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  ST_CHECK(EVP_Digest(data, n, digest, &len, EVP_sha256(), nullptr) == 1, Error,
           "SHA-256 failed");
  static const char* kHex = "0123456789abcdef";
  std::string hex;
  for (unsigned int i = 0; i < len; ++i) {
    hex.push_back(kHex[digest[i] >> 4]);
    hex.push_back(kHex[digest[i] & 15]);
  }
  return hex;
}

bool sha256_of_file(const std::string& path, std::string* hex, long long* bytes, std::string* why) {
  return sha256_of_files({path}, hex, bytes, why);
}

bool sha256_of_files(const std::vector<std::string>& paths, std::string* hex, long long* bytes,
                     std::string* why) {
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> ctx(EVP_MD_CTX_new(), &EVP_MD_CTX_free);
  bool ok = ctx && EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr) == 1;
  *bytes = 0;
  std::unique_ptr<char[]> buf(new char[1 << 20]);
  for (const std::string& path : paths) {
    const int fd = open_regular_for_reading(path, why);
    if (fd < 0) return false;
    while (ok) {
      const ssize_t n = ::read(fd, buf.get(), 1 << 20);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        *why = std::strerror(errno);
        ::close(fd);
        return false;
      }
      if (n == 0) break;
      *bytes += n;
      ok = EVP_DigestUpdate(ctx.get(), buf.get(), static_cast<size_t>(n)) == 1;
    }
    ::close(fd);
  }
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (!ok || EVP_DigestFinal_ex(ctx.get(), digest, &len) != 1) {
    *why = "SHA-256 failed";
    return false;
  }
  static const char* kHex = "0123456789abcdef";
  hex->clear();
  for (unsigned int i = 0; i < len; ++i) {
    hex->push_back(kHex[digest[i] >> 4]);
    hex->push_back(kHex[digest[i] & 15]);
  }
  return true;
}

}  // namespace shardtrain::detail
