// What the run report and the TensorBoard files derive from a metrics line
// beyond the numbers it holds, so the two always agree.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>

namespace shardtrain::train::detail {

/// The share of the gradient path's communication hidden behind compute:
/// 1 - exposed / busy, clipped to [0, 1]; NaN when nothing was communicated
/// (busy is 0, as under the single strategy) or a value is not finite.
inline double comm_hidden(double busy_s, double exposed_s) {
  if (!std::isfinite(busy_s) || !std::isfinite(exposed_s) || busy_s <= 0.0) {
    return std::numeric_limits<double>::quiet_NaN();
  }
  return std::clamp(1.0 - exposed_s / busy_s, 0.0, 1.0);
}

}  // namespace shardtrain::train::detail
