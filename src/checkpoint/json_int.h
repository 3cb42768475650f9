// Whole numbers from JSON that came from a file: nlohmann's get<int64_t>()
// truncates 2.9 to 2, reads true as 1 and wraps numbers beyond the type, so
// every size, offset and count of a checkpoint or safetensors header is read
// through these instead.
#pragma once

#include <cstdint>
#include <limits>
#include <vector>

namespace shardtrain::checkpoint::detail {

/// `j` as an integer in [lo, hi]; false for a float, a bool, a string or a
/// number out of range.
template <class Json>
bool json_int(const Json& j, int64_t lo, int64_t hi, int64_t* out) {
  if (j.is_number_unsigned()) {
    const auto v = j.template get<uint64_t>();
    if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return false;
    *out = static_cast<int64_t>(v);
  } else if (j.is_number_integer()) {
    *out = j.template get<int64_t>();
  } else {
    return false;
  }
  return *out >= lo && *out <= hi;
}

/// A list of whole numbers (shapes, offsets); the caller checks their range.
template <class Json>
bool json_int_list(const Json& j, std::vector<int64_t>* out) {
  if (!j.is_array()) return false;
  out->clear();
  for (const auto& item : j) {
    int64_t v = 0;
    if (!json_int(item, std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max(), &v)) {
      return false;
    }
    out->push_back(v);
  }
  return true;
}

}  // namespace shardtrain::checkpoint::detail
