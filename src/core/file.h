// Opening files whose path the user gave, without ever blocking: a FIFO
// (named pipe) or a device named as a data file, a model or a checkpoint
// file would make a plain open() or read() wait forever for a writer.
//
// Internal to the library (src/ and tools/); the callers turn a failure into
// their own typed error (ConfigError for data and config files,
// CheckpointError for checkpoints and models).
//
// The readers' contract: every file the project reads (configs, datasets,
// caches, tokenizers, model directories, checkpoints, /proc) is opened here
// and nowhere else (tests/static/no_raw_reads.sh holds the rest of the tree
// to it). A FIFO, a device, a socket or a directory is refused at once,
// saying what it is; each read has a cap on what it holds in memory (a whole
// file, or one line of a streamed one). /proc files, regular files whose
// st_size is 0, are read to their end.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace shardtrain::detail {

/// Opens `path` read-only (O_CLOEXEC) without blocking and checks that it is
/// a regular file. Returns the descriptor (blocking again), or -1 with
/// `*why` saying what is wrong ("No such file or directory", "it is a FIFO
/// (named pipe), not a regular file") and errno set (EINVAL for a file that
/// is not regular).
int open_regular_for_reading(const std::string& path, std::string* why);

/// The same for appending (O_WRONLY | O_APPEND | O_CREAT, mode 0644): a
/// FIFO or device named as a log is refused instead of waited on.
int open_regular_for_append(const std::string& path, std::string* why);

/// Appends all of `data` to `fd` (opened O_APPEND, the file at `path`) or
/// nothing: should a write come short (a full disk), the file is cut back to
/// its old size and an IoError names `path` and says whether the partial
/// `unit` ("line", "record") was removed. The run logs' one way to append.
void append_whole(int fd, const std::string& data, const std::string& path, const char* unit);

/// The whole of a regular file of at most `max_bytes` bytes; false with
/// `*why` set when it cannot be read.
bool read_regular_file(const std::string& path, long long max_bytes, std::string* out,
                       std::string* why);

/// What `path` is, following links, for a message: "a regular file",
/// "a FIFO (named pipe)", "a character device", "a directory", ...,
/// "a dangling symbolic link", or "absent" when nothing is there.
std::string file_kind(const std::string& path);

/// At most `n` bytes from the start of a regular file (fewer when it is
/// shorter); false with `*why` set when it cannot be opened or read.
bool read_regular_prefix(const std::string& path, size_t n, std::string* out, std::string* why);

/// A regular file read one line at a time through a fixed buffer: a
/// dataset of many GB is never held whole, and no line longer than the
/// reader's cap is. Lines are returned without their '\n'; a last line
/// without one is returned too.
class LineReader {
 public:
  enum class Status { Line, End, TooLong, Error };
  /// `max_line_bytes`: the longest line next() returns (TooLong past it).
  explicit LineReader(long long max_line_bytes) : max_line_(max_line_bytes) {}
  ~LineReader();
  LineReader(const LineReader&) = delete;
  LineReader& operator=(const LineReader&) = delete;

  /// Opens `path` through open_regular_for_reading; false with `*why` set.
  bool open(const std::string& path, std::string* why);
  /// The next line into `*line`; End after the last, TooLong or Error with
  /// `*why` set (the reader is then at its end).
  Status next(std::string* line, std::string* why);
  /// Lines returned so far (the number of the last one).
  long long line_number() const { return lines_; }

 private:
  int fd_ = -1;
  long long max_line_;
  long long lines_ = 0;
  std::string buf_;
  size_t at_ = 0;
  bool eof_ = false;
};

/// The SHA-256 of `n` bytes at `data` as 64 lowercase hex digits.
std::string sha256_hex(const void* data, size_t n);

/// The SHA-256 of a regular file as 64 lowercase hex digits, and its size;
/// false with `*why` set when it cannot be read.
bool sha256_of_file(const std::string& path, std::string* hex, long long* bytes, std::string* why);
/// The same over the files' contents one after another, in the given order.
bool sha256_of_files(const std::vector<std::string>& paths, std::string* hex, long long* bytes,
                     std::string* why);

}  // namespace shardtrain::detail
