# Pipeline parallelism: what crosses a stage boundary, between real
# processes (test_pipeline.cpp; the schedules themselves are unit tests,
# tests/unit/test_pipeline_schedule.cpp).
add_executable(dist_pipeline_tests ${CMAKE_CURRENT_LIST_DIR}/test_pipeline.cpp ${CMAKE_CURRENT_LIST_DIR}/world_main.cpp)
target_link_libraries(dist_pipeline_tests PRIVATE shardtrain GTest::gtest)
shardtrain_use_pch(dist_pipeline_tests)
foreach(n 2 3)
  add_test(NAME dist.pipeline.transport.world${n}
           COMMAND ${SHARDTRAIN_CLI} launch --nproc-per-node ${n} -- $<TARGET_FILE:dist_pipeline_tests>)
  set_tests_properties(dist.pipeline.transport.world${n} PROPERTIES TIMEOUT 300
                       ENVIRONMENT "SHARDTRAIN_TIMEOUT_S=120;OMP_NUM_THREADS=1")
endforeach()
shardtrain_mpi_twin(dist.pipeline.transport.world2 2 $<TARGET_FILE:dist_pipeline_tests>)
