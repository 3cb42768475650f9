# Loading a Hugging Face directory under FULL_SHARD: no rank ever holds the
# whole model (peak RSS against the model's bytes and against training's
# peak), and the shards read are the files' bytes; 2 ranks through the
# launcher, full fine-tuning and QLoRA. bench/loading.sh runs the same
# program on a larger model.
add_executable(test_sharded_loading ${CMAKE_CURRENT_LIST_DIR}/test_sharded_loading.cpp ${CMAKE_CURRENT_LIST_DIR}/world_main.cpp)
target_link_libraries(test_sharded_loading PRIVATE shardtrain GTest::gtest)
shardtrain_use_pch(test_sharded_loading)
foreach(q none nf4)
  add_test(NAME dist.loading.full_shard_x2.${q}
           COMMAND ${SHARDTRAIN_CLI} launch --nproc-per-node 2 -- $<TARGET_FILE:test_sharded_loading>)
  set_tests_properties(dist.loading.full_shard_x2.${q} PROPERTIES TIMEOUT 600
                       ENVIRONMENT "SHARDTRAIN_TIMEOUT_S=120;OMP_NUM_THREADS=1;SHARDTRAIN_LOADING_QUANTIZE=${q};SHARDTRAIN_LLAMA_REF=${CMAKE_SOURCE_DIR}/tests/reference/llama_ref.py")
endforeach()
shardtrain_mpi_twin(dist.loading.full_shard_x2.nf4 2 $<TARGET_FILE:test_sharded_loading>)
# Tensor-parallel pair (tp 2 x full_shard 1): each rank reads only its
# blocks of every split tensor; the blocks assembled are the plain load.
add_test(NAME dist.loading.tp2.none
         COMMAND ${SHARDTRAIN_CLI} launch --nproc-per-node 2 -- $<TARGET_FILE:test_sharded_loading>)
set_tests_properties(dist.loading.tp2.none PROPERTIES TIMEOUT 600
                     ENVIRONMENT "SHARDTRAIN_TIMEOUT_S=120;OMP_NUM_THREADS=1;SHARDTRAIN_LOADING_QUANTIZE=none;SHARDTRAIN_LOADING_TP=2;SHARDTRAIN_LLAMA_REF=${CMAKE_SOURCE_DIR}/tests/reference/llama_ref.py")
