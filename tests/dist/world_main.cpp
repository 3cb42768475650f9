#include <gtest/gtest.h>

#include "world.h"

namespace shardtrain::testing {

std::shared_ptr<comm::Communicator>& world_ptr() {
  static std::shared_ptr<comm::Communicator> world;
  return world;
}

}  // namespace shardtrain::testing

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  auto& world = shardtrain::testing::world_ptr();
  world = shardtrain::comm::Communicator::create(shardtrain::comm::CommOptions::from_env());
  const int rc = RUN_ALL_TESTS();
  world->barrier();  // nobody tears down connections a peer still uses
  world.reset();
  return rc;
}
