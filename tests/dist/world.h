// The world communicator of a multi-rank test binary. world_main.cpp creates
// it from the launcher's variables before any test runs, and after the last
// test waits for every rank before tearing the connections down.
#pragma once

#include <memory>
#include <string>

#include "shardtrain/comm/communicator.h"

namespace shardtrain::testing {

std::shared_ptr<comm::Communicator>& world_ptr();

/// One name for this job, the same on every rank whatever started them (rank
/// 0's process id): for paths that all ranks share.
const std::string& job_id();

}  // namespace shardtrain::testing
