# DDP against the single-process reference, run by every rank under the
# launcher at world sizes 1, 2 and 3 (3 does not divide the test models'
# parameter counts, and the bucket caps are small so there are several buckets).
add_executable(dist_ddp_tests ${CMAKE_CURRENT_LIST_DIR}/test_ddp.cpp ${CMAKE_CURRENT_LIST_DIR}/world_main.cpp)
target_link_libraries(dist_ddp_tests PRIVATE shardtrain GTest::gtest)
target_include_directories(dist_ddp_tests PRIVATE ${PROJECT_SOURCE_DIR}/src)
shardtrain_use_pch(dist_ddp_tests)
foreach(n 1 2 3)
  add_test(NAME dist.ddp.world${n}
           COMMAND ${SHARDTRAIN_CLI} launch --nproc-per-node ${n} -- $<TARGET_FILE:dist_ddp_tests>)
  set_tests_properties(dist.ddp.world${n} PROPERTIES TIMEOUT 600 ENVIRONMENT "SHARDTRAIN_TIMEOUT_S=120")
  if(n GREATER 1)
    shardtrain_mpi_twin(dist.ddp.world${n} ${n} $<TARGET_FILE:dist_ddp_tests>)
  endif()
endforeach()
