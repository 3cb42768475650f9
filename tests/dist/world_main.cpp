#include <gtest/gtest.h>
#include <ATen/ATen.h>
#include <malloc.h>
#include <unistd.h>

#include <cstdio>

#include "shardtrain/launch/launcher.h"
#include "world.h"

namespace shardtrain::testing {

std::shared_ptr<comm::Communicator>& world_ptr() {
  static std::shared_ptr<comm::Communicator> world;
  return world;
}

namespace {
std::string g_job_id;
}  // namespace

const std::string& job_id() { return g_job_id; }

}  // namespace shardtrain::testing

// The exit code of one rank: 1 when a test failed, kSkippedExitCode (77)
// when one skipped, else 0. RUN_ALL_TESTS() returns 0 for a skip, which
// ctest would show as Passed for a test that never ran; the launcher passes
// 77 on (a failure on any rank wins), and the ctest registrations map it to
// "skipped" with SKIP_RETURN_CODE.
int main(int argc, char** argv) {
  // The tests allocate and free buffers of up to 32 MB over and over. glibc
  // would map each one and unmap it on free, so every use faults its pages
  // in again (most of the collectives tests' time in a VM); serve them from
  // the heap and keep freed memory there instead.
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  ::testing::InitGoogleTest(&argc, argv);
  auto& world = shardtrain::testing::world_ptr();
  world = shardtrain::comm::Communicator::create(shardtrain::comm::CommOptions::from_env());
  auto pid = at::full({1}, static_cast<int64_t>(getpid()), at::kLong);
  world->broadcast(pid);
  shardtrain::testing::g_job_id = std::to_string(pid.item<int64_t>());
  int rc = RUN_ALL_TESTS();
  const auto& run = *::testing::UnitTest::GetInstance();
  if (run.test_to_run_count() == 0) {
    // A --gtest_filter that matches nothing (a renamed test) would pass.
    std::fprintf(stderr, "no test matches the filter; check the test's registration\n");
    rc = 1;
  }
  world->barrier();  // nobody tears down connections a peer still uses
  world.reset();
  if (rc == 0 && run.skipped_test_count() > 0) return shardtrain::dist::kSkippedExitCode;
  return rc;
}
