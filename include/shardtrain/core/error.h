// The typed errors shardtrain throws, and the check macros that throw them.
//
// Every user-facing failure is one of these types, so callers can catch what
// they can handle: ConfigError for bad options or environment, CommError (and
// its TimeoutError) for failed collectives and rendezvous, CheckpointError for
// unreadable checkpoints, IoError for files that cannot be written (a full
// disk). Messages say what went wrong and end with a hint of what to do. The
// library never calls exit().
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace shardtrain {

/// Base of every error shardtrain throws on purpose.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

/// Bad options, bad configuration files or contradictory environment variables.
class ConfigError : public Error {
 public:
  using Error::Error;
};

/// A call with arguments that can never work (wrong dtype, mismatched sizes).
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

/// A collective, a point-to-point transfer or the rendezvous failed.
class CommError : public Error {
 public:
  using Error::Error;
};

/// A CommError caused by a deadline passing (a peer that never came or hung).
class TimeoutError : public CommError {
 public:
  using CommError::CommError;
};

/// A checkpoint is missing, torn, corrupt or does not match the model.
class CheckpointError : public Error {
 public:
  using Error::Error;
};

/// A file other than a checkpoint could not be written or read: metrics,
/// logs, the exported model's companions (a full disk, permissions).
class IoError : public Error {
 public:
  using Error::Error;
};

/// A broken internal invariant: a bug in shardtrain, not in the caller's input.
class InternalError : public Error {
 public:
  using Error::Error;
};

namespace detail {

// Streams every argument into one string; used by the check macros.
template <typename... Args>
std::string str_cat(const Args&... args) {
  std::ostringstream os;
  (void)std::initializer_list<int>{((os << args), 0)...};
  return os.str();
}

// "src/comm/ring.cpp" -> "ring.cpp": keeps file:line suffixes short.
constexpr const char* base_name(const char* path) {
  const char* base = path;
  for (const char* p = path; *p != '\0'; ++p) {
    if (*p == '/') base = p + 1;
  }
  return base;
}

/// `e`'s message without a backtrace, on one line: LibTorch's c10::Error
/// carries a C++ backtrace in what() ("Exception raised from ... frame #0"),
/// also when an error's text was copied into one of ours; it is cut off, and
/// line breaks become "; ". The " [file.cpp:NN]" check sites ST_CHECK
/// appends are left out too, unless SHARDTRAIN_DEBUG=1.
std::string one_line_message(const std::exception& e);
/// The same for a message already taken from what().
std::string one_line_message(const std::string& what);

[[noreturn]] void throw_internal(const char* file, int line, const char* cond,
                                 const std::string& msg);

}  // namespace detail
}  // namespace shardtrain

/// Throws `ErrorType` with the streamed message when `cond` is false.
/// For user errors: the message must say what was wrong and what to do; the
/// file:line of the check is appended in brackets (one_line_message, which
/// prints errors for users, shows it only with SHARDTRAIN_DEBUG=1).
#define ST_CHECK(cond, ErrorType, ...)                                      \
  do {                                                                      \
    if (!(cond)) {                                                          \
      throw ErrorType(::shardtrain::detail::str_cat(                        \
          __VA_ARGS__, " [", ::shardtrain::detail::base_name(__FILE__), ":", \
          __LINE__, "]"));                                                  \
    }                                                                       \
  } while (0)

/// Asserts an internal invariant; on failure throws InternalError with file:line.
#define ST_ASSERT(cond, ...)                                                \
  do {                                                                      \
    if (!(cond)) {                                                          \
      ::shardtrain::detail::throw_internal(                                 \
          __FILE__, __LINE__, #cond, ::shardtrain::detail::str_cat(__VA_ARGS__)); \
    }                                                                       \
  } while (0)
