#include "train/profile.h"

#include <torch/csrc/autograd/profiler_legacy.h>

#include <malloc.h>

#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <string_view>
#include <utility>
#include <vector>

#include "checkpoint/detail.h"

namespace shardtrain::train::detail {

namespace prof = torch::autograd::profiler;

namespace {

constexpr std::string_view kPhasePrefix = "shardtrain::";

struct Open {
  const prof::LegacyEvent* push;
  double children_us = 0.0;
  std::string phase;  // the innermost phase this range is in (itself, for a phase)
};

struct OpTotal {
  double self_us = 0.0;
  int64_t calls = 0;
};

}  // namespace

StepProfiler::StepProfiler(int64_t prefault_bytes) {
  // Blocks below the trainer's 32 MB mmap threshold come from the heap; the
  // trim threshold keeps them there once freed.
  constexpr size_t kBlock = size_t{16} << 20;
  mallopt(M_TRIM_THRESHOLD, std::numeric_limits<int>::max());
  std::vector<void*> blocks;
  for (int64_t done = 0; done < prefault_bytes; done += static_cast<int64_t>(kBlock)) {
    void* b = std::malloc(kBlock);
    if (b == nullptr) break;
    std::memset(b, 1, kBlock);  // not 0: malloc + memset(0) may become a calloc that touches nothing
    blocks.push_back(b);
  }
  for (void* b : blocks) std::free(b);
  prof::enableProfilerLegacy(torch::profiler::impl::ProfilerConfig(torch::profiler::impl::ProfilerState::CPU));
  active_ = true;
}

StepProfiler::~StepProfiler() {
  if (active_) prof::disableProfilerLegacy();
}

void StepProfiler::write(const std::string& path, int64_t step, int rank, double step_us) {
  const prof::thread_event_lists lists = prof::disableProfilerLegacy();
  active_ = false;
  // Ranges nest on each thread: an op's own time is its elapsed time less its
  // children's; its phase is the innermost enclosing shardtrain:: range.
  std::map<std::pair<std::string, std::string>, OpTotal> ops;  // (name, phase)
  std::map<std::string, double> phases;
  for (const auto& events : lists) {
    std::vector<Open> stack;
    for (const prof::LegacyEvent& e : events) {
      if (e.kind() == prof::EventKind::PushRange) {
        const std::string_view name = e.name();
        std::string phase = stack.empty() ? "other" : stack.back().phase;
        if (name.substr(0, kPhasePrefix.size()) == kPhasePrefix) {
          phase = std::string(name.substr(kPhasePrefix.size()));
        }
        stack.push_back({&e, 0.0, std::move(phase)});
      } else if (e.kind() == prof::EventKind::PopRange && !stack.empty()) {
        Open open = std::move(stack.back());
        stack.pop_back();
        const double elapsed = open.push->cpuElapsedUs(e);
        if (!stack.empty()) stack.back().children_us += elapsed;
        const std::string_view name = open.push->name();
        if (name.substr(0, kPhasePrefix.size()) == kPhasePrefix) {
          phases[open.phase] += elapsed;
        } else {
          OpTotal& t = ops[{std::string(name), open.phase}];
          t.self_us += elapsed - open.children_us;
          ++t.calls;
        }
      }
    }
  }
  nlohmann::ordered_json doc;
  doc["impl"] = "shardtrain";
  doc["step"] = step;
  doc["rank"] = rank;
  doc["step_us"] = step_us;
  doc["scopes"] = nlohmann::json::array();
  for (const auto& [name, total] : phases) doc["scopes"].push_back({{"name", name}, {"total_us", total}});
  doc["ops"] = nlohmann::json::array();
  for (const auto& [key, t] : ops) {
    doc["ops"].push_back({{"name", key.first}, {"scope", key.second}, {"self_us", t.self_us}, {"calls", t.calls}});
  }
  checkpoint::detail::write_file_atomically(path, doc.dump(1) + "\n");
}

}  // namespace shardtrain::train::detail
