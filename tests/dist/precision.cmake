# fp16-mixed loss scaling across ranks (the test construction, so it runs on
# CPU with real float16 gradients): an overflow on one rank makes every rank
# skip the same step and keep the same scale. World 3 does not divide the
# gradient sizes.
add_executable(dist_precision_tests ${CMAKE_CURRENT_LIST_DIR}/test_precision_dist.cpp ${CMAKE_CURRENT_LIST_DIR}/world_main.cpp)
target_link_libraries(dist_precision_tests PRIVATE shardtrain GTest::gtest)
target_include_directories(dist_precision_tests PRIVATE ${PROJECT_SOURCE_DIR}/src)
shardtrain_use_pch(dist_precision_tests)
foreach(n 2 3)
  add_test(NAME dist.precision.world${n}
           COMMAND ${SHARDTRAIN_CLI} launch --nproc-per-node ${n} -- $<TARGET_FILE:dist_precision_tests>)
  set_tests_properties(dist.precision.world${n} PROPERTIES TIMEOUT 300 ENVIRONMENT "SHARDTRAIN_TIMEOUT_S=120")
  shardtrain_mpi_twin(dist.precision.world${n} ${n} $<TARGET_FILE:dist_precision_tests>)
endforeach()
