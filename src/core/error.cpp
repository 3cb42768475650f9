#include "shardtrain/core/error.h"

namespace shardtrain::detail {

void throw_internal(const char* file, int line, const char* cond, const std::string& msg) {
  throw InternalError(str_cat("internal error at ", file, ":", line, ": ", cond,
                              " failed", msg.empty() ? "" : ": ", msg,
                              " (this is a bug in shardtrain; please report it)"));
}

}  // namespace shardtrain::detail
