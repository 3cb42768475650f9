# Sharded checkpoints across processes: each world size saves once
# (dist.checkpoint.save.worldA, a fixture), then other world sizes load it
# with different slicing, and check that a missing or corrupt rank file
# makes every rank fail with an error naming it.
add_executable(dist_checkpoint_tests ${CMAKE_CURRENT_LIST_DIR}/test_checkpoint_dist.cpp
                                     ${CMAKE_CURRENT_LIST_DIR}/world_main.cpp)
target_link_libraries(dist_checkpoint_tests PRIVATE shardtrain GTest::gtest)
target_include_directories(dist_checkpoint_tests PRIVATE ${PROJECT_SOURCE_DIR}/src)
shardtrain_use_pch(dist_checkpoint_tests)

set(CHECKPOINT_DIST_DIR ${CMAKE_CURRENT_BINARY_DIR}/checkpoint_dist)
foreach(a 1 2 3 4)
  add_test(NAME dist.checkpoint.save.world${a}
           COMMAND ${SHARDTRAIN_CLI} launch --nproc-per-node ${a} -- $<TARGET_FILE:dist_checkpoint_tests>
                   --gtest_filter=DistCheckpoint.Save)
  set_tests_properties(dist.checkpoint.save.world${a} PROPERTIES TIMEOUT 300
                       FIXTURES_SETUP checkpoint_world${a}
                       ENVIRONMENT "SHARDTRAIN_TIMEOUT_S=120;SHARDTRAIN_CKPT_TEST_DIR=${CHECKPOINT_DIST_DIR}")
endforeach()
# Saved by A ranks, loaded by B: fewer, more, one, and from one.
foreach(pair 4:2 2:3 3:1 1:4)
  string(REPLACE ":" ";" ab ${pair})
  list(GET ab 0 a)
  list(GET ab 1 b)
  add_test(NAME dist.checkpoint.load.world${a}_to_world${b}
           COMMAND ${SHARDTRAIN_CLI} launch --nproc-per-node ${b} -- $<TARGET_FILE:dist_checkpoint_tests>
                   --gtest_filter=DistCheckpoint.Load:DistCheckpoint.FailsTogether)
  set_tests_properties(dist.checkpoint.load.world${a}_to_world${b} PROPERTIES TIMEOUT 300
                       FIXTURES_REQUIRED checkpoint_world${a}
                       ENVIRONMENT "SHARDTRAIN_TIMEOUT_S=120;SHARDTRAIN_CKPT_TEST_DIR=${CHECKPOINT_DIST_DIR};SHARDTRAIN_CKPT_FROM=${a}")
endforeach()
