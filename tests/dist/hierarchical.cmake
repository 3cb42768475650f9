# Hierarchical collectives across two namespace hosts with 2 and 3 ranks on
# each (hierarchical.sh; root only): parity with the exact reduction and the
# flat rings, and the bytes that leave each host. Small segments make every
# ring step a multi-segment pipeline; 2x2-tcp runs the level inside a host
# over TCP rings instead of shared memory.
add_executable(dist_hier_tests ${CMAKE_CURRENT_LIST_DIR}/test_hierarchical.cpp
                               ${CMAKE_CURRENT_LIST_DIR}/world_main.cpp)
target_link_libraries(dist_hier_tests PRIVATE shardtrain GTest::gtest)
shardtrain_use_pch(dist_hier_tests)
foreach(k 2 3)
  add_test(NAME dist.collectives.hierarchical.2x${k}
           COMMAND ${CMAKE_CURRENT_LIST_DIR}/hierarchical.sh ${k} ${SHARDTRAIN_CLI}
                   $<TARGET_FILE:dist_hier_tests>)
  set_tests_properties(dist.collectives.hierarchical.2x${k} PROPERTIES TIMEOUT 300 RUN_SERIAL TRUE
                       ENVIRONMENT "SHARDTRAIN_TIMEOUT_S=60;SHARDTRAIN_SEGMENT_BYTES=16388")
endforeach()
add_test(NAME dist.collectives.hierarchical.2x2-tcp
         COMMAND ${CMAKE_CURRENT_LIST_DIR}/hierarchical.sh 2 ${SHARDTRAIN_CLI}
                 $<TARGET_FILE:dist_hier_tests>)
set_tests_properties(dist.collectives.hierarchical.2x2-tcp PROPERTIES TIMEOUT 300 RUN_SERIAL TRUE
                     ENVIRONMENT "SHARDTRAIN_TIMEOUT_S=60;SHARDTRAIN_SEGMENT_BYTES=16388;SHARDTRAIN_SHM=0")
