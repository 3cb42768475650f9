// Opening files whose path the user gave, without ever blocking: a FIFO
// (named pipe) or a device named as a data file, a model or a checkpoint
// file would make a plain open() or read() wait forever for a writer.
//
// Internal to the library (src/); the callers turn a failure into their own
// typed error (ConfigError for data and config files, CheckpointError for
// checkpoints and models).
#pragma once

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

/// The SHA-256 of a regular file as 64 lowercase hex digits, and its size;
/// false with `*why` set when it cannot be read.
bool sha256_of_file(const std::string& path, std::string* hex, long long* bytes, std::string* why);
/// The same over the files' contents one after another, in the given order.
bool sha256_of_files(const std::vector<std::string>& paths, std::string* hex, long long* bytes,
                     std::string* why);

}  // namespace shardtrain::detail
