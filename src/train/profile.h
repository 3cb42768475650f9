// One training step under LibTorch's (legacy, CPU) autograd profiler,
// reduced to each op's own time per phase of the step. The trainer marks the
// phases with ScopedPhase; outside a profiled step a phase costs one check
// of a flag.
#pragma once

#include <ATen/record_function.h>

#include <cstdint>
#include <string>

namespace shardtrain::train::detail {

/// Phase names as they appear in the profile (the op "scope" field).
#define ST_PROFILE_PHASE(name) RECORD_USER_SCOPE("shardtrain::" name)

/// Profiles the calling thread (and the work it hands to at::launch) from
/// construction to write(). Not copyable; one at a time per process.
///
/// LibTorch 1.13's profiler interleaves its own small allocations with the
/// step's tensors, so freed tensor memory is seldom reused while it runs and
/// the step's tensors land in fresh pages, each paying a page fault (a C++
/// loop measured 1.7x slower, a 25M GPT step 2.3x). The constructor first
/// faults in `prefault_bytes` of heap and leaves it free on the heap, which
/// takes that cost out of the measurement; the process keeps that memory.
class StepProfiler {
 public:
  explicit StepProfiler(int64_t prefault_bytes);
  ~StepProfiler();  // stops the profiler if write() was never called
  StepProfiler(const StepProfiler&) = delete;
  StepProfiler& operator=(const StepProfiler&) = delete;

  /// Stops profiling and writes the JSON document (docs: trainer.profile_step)
  /// to `path`, atomically.
  void write(const std::string& path, int64_t step, int rank, double step_us);

 private:
  bool active_ = false;
};

}  // namespace shardtrain::train::detail
