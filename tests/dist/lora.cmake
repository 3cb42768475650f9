# LoRA and QLoRA through the Trainer under every strategy against the
# single-process LoRA run, at world sizes 1 to 3 through the launcher.
add_executable(test_lora_parity ${CMAKE_CURRENT_LIST_DIR}/test_lora_parity.cpp ${CMAKE_CURRENT_LIST_DIR}/world_main.cpp)
target_link_libraries(test_lora_parity PRIVATE shardtrain GTest::gtest)
shardtrain_use_pch(test_lora_parity)
foreach(n 1 2 3)
  add_test(NAME dist.lora.parity.world${n}
           COMMAND ${SHARDTRAIN_CLI} launch --nproc-per-node ${n} -- $<TARGET_FILE:test_lora_parity>
                   --gtest_filter=-LoraTensorParallel.*)
  set_tests_properties(dist.lora.parity.world${n} PROPERTIES TIMEOUT 600
                       ENVIRONMENT "SHARDTRAIN_TIMEOUT_S=120;OMP_NUM_THREADS=1")
  if(n GREATER 1)
    shardtrain_mpi_twin(dist.lora.parity.world${n} ${n} $<TARGET_FILE:test_lora_parity> --gtest_filter=-LoraTensorParallel.*)
  endif()
endforeach()
# QLoRA under tensor parallelism: each tp rank quantizes its own blocks.
add_test(NAME dist.lora.tensor_parallel
         COMMAND ${SHARDTRAIN_CLI} launch --nproc-per-node 2 -- $<TARGET_FILE:test_lora_parity>
                 --gtest_filter=LoraTensorParallel.*)
set_tests_properties(dist.lora.tensor_parallel PROPERTIES TIMEOUT 600
                     ENVIRONMENT "SHARDTRAIN_TIMEOUT_S=120;OMP_NUM_THREADS=1")
