# Tensor-parallel layers with the whole world as one tensor-parallel group:
# the vocabulary-parallel loss against its fp64 definition, one decoder
# layer's collectives counted, the mesh's groups (test_tensor_parallel.cpp).
# Whole-model training parity against the independent reference is in
# tests/models/llama.cmake (models.llama.train.tp*).
add_executable(dist_tensor_parallel_tests ${CMAKE_CURRENT_LIST_DIR}/test_tensor_parallel.cpp
               ${CMAKE_CURRENT_LIST_DIR}/world_main.cpp)
target_link_libraries(dist_tensor_parallel_tests PRIVATE shardtrain GTest::gtest)
target_include_directories(dist_tensor_parallel_tests PRIVATE ${PROJECT_SOURCE_DIR}/src)
shardtrain_use_pch(dist_tensor_parallel_tests)
foreach(n 2 4)
  add_test(NAME dist.tensor_parallel.world${n}
           COMMAND ${SHARDTRAIN_CLI} launch --nproc-per-node ${n} -- $<TARGET_FILE:dist_tensor_parallel_tests>)
  set_tests_properties(dist.tensor_parallel.world${n} PROPERTIES TIMEOUT 300 ENVIRONMENT "SHARDTRAIN_TIMEOUT_S=120"
                       SKIP_RETURN_CODE 77)
endforeach()
