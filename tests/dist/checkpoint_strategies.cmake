# Resharding with the real strategies (issue 6): a model trained 3 steps under
# strategy A on WA ranks is saved (dist.checkpoint.matrix.save.<A>, a
# fixture), then loaded under strategy B on WB ranks
# (dist.checkpoint.matrix.<A>_to_<B>), which must hold the saved weights
# bitwise and continue training as the saving job did. See
# test_checkpoint_strategies.cpp.
add_executable(dist_checkpoint_strategies_tests ${CMAKE_CURRENT_LIST_DIR}/test_checkpoint_strategies.cpp
                                                ${CMAKE_CURRENT_LIST_DIR}/world_main.cpp)
target_link_libraries(dist_checkpoint_strategies_tests PRIVATE shardtrain GTest::gtest)
target_include_directories(dist_checkpoint_strategies_tests PRIVATE ${PROJECT_SOURCE_DIR}/src)
shardtrain_use_pch(dist_checkpoint_strategies_tests)

set(CKPT_MATRIX_DIR ${CMAKE_CURRENT_BINARY_DIR}/ckpt_matrix)
set(CKPT_MATRIX_ENV "SHARDTRAIN_TIMEOUT_S=60;OMP_NUM_THREADS=1;OMP_WAIT_POLICY=PASSIVE")

# A configuration: NAME, then strategy ("single", "ddp", "zero1",
# "fsdp/<sharding>"), world size, and for hybrid_shard the ranks per node.
function(ckpt_matrix_config name strategy world)
  set(ckpt_matrix_${name}_strategy ${strategy} PARENT_SCOPE)
  set(ckpt_matrix_${name}_world ${world} PARENT_SCOPE)
  set(ckpt_matrix_${name}_node "${ARGN}" PARENT_SCOPE)
endfunction()
ckpt_matrix_config(single_x1 single 1)
ckpt_matrix_config(ddp_x2 ddp 2)
ckpt_matrix_config(zero1_x3 zero1 3)
ckpt_matrix_config(full_shard_x4 fsdp/full_shard 4)
ckpt_matrix_config(shard_grad_op_x2 fsdp/shard_grad_op 2)
ckpt_matrix_config(no_shard_x3 fsdp/no_shard 3)
ckpt_matrix_config(hybrid_shard_2x2 fsdp/hybrid_shard 4 2)

# The environment a job of configuration NAME runs with, reading or writing
# the checkpoint of configuration SAVED.
function(ckpt_matrix_env out name saved)
  set(e "${CKPT_MATRIX_ENV};SHARDTRAIN_MATRIX_DIR=${CKPT_MATRIX_DIR}/${saved}")
  list(APPEND e "SHARDTRAIN_MATRIX_STRATEGY=${ckpt_matrix_${name}_strategy}")
  if(ckpt_matrix_${name}_node)
    list(APPEND e "SHARDTRAIN_MATRIX_NODE_SIZE=${ckpt_matrix_${name}_node}")
  endif()
  set(${out} "${e}" PARENT_SCOPE)
endfunction()

foreach(a single_x1 ddp_x2 zero1_x3 full_shard_x4 shard_grad_op_x2 hybrid_shard_2x2)
  ckpt_matrix_env(env ${a} ${a})
  add_test(NAME dist.checkpoint.matrix.save.${a}
           COMMAND ${SHARDTRAIN_CLI} launch --nproc-per-node ${ckpt_matrix_${a}_world} --
                   $<TARGET_FILE:dist_checkpoint_strategies_tests> --gtest_filter=Matrix.Save)
  set_tests_properties(dist.checkpoint.matrix.save.${a} PROPERTIES TIMEOUT 120
                       FIXTURES_SETUP ckpt_matrix_${a} ENVIRONMENT "${env}")
endforeach()

# Under mpirun (the mpi backend): saved into a directory of its own, then
# loaded under mpirun too, by another strategy at another world size.
foreach(a zero1_x3 full_shard_x4 hybrid_shard_2x2)
  shardtrain_mpi_twin(dist.checkpoint.matrix.save.${a} ${ckpt_matrix_${a}_world}
                      $<TARGET_FILE:dist_checkpoint_strategies_tests> --gtest_filter=Matrix.Save
                      EXTRA_ENV SHARDTRAIN_MATRIX_DIR=${CKPT_MATRIX_DIR}/mpi/${a})
  set_tests_properties(dist.checkpoint.matrix.save.${a}.mpi PROPERTIES FIXTURES_SETUP ckpt_matrix_mpi_${a})
endforeach()

# Saved by A, loaded by B. full_shard_x4 -> full_shard_x4 must continue bitwise.
foreach(pair full_shard_x4:ddp_x2 ddp_x2:single_x1 single_x1:full_shard_x4
             shard_grad_op_x2:zero1_x3 zero1_x3:shard_grad_op_x2 full_shard_x4:full_shard_x4
             hybrid_shard_2x2:no_shard_x3)
  string(REPLACE ":" ";" ab ${pair})
  list(GET ab 0 a)
  list(GET ab 1 b)
  ckpt_matrix_env(env ${b} ${a})
  add_test(NAME dist.checkpoint.matrix.${a}_to_${b}
           COMMAND ${SHARDTRAIN_CLI} launch --nproc-per-node ${ckpt_matrix_${b}_world} --
                   $<TARGET_FILE:dist_checkpoint_strategies_tests> --gtest_filter=Matrix.Load)
  set_tests_properties(dist.checkpoint.matrix.${a}_to_${b} PROPERTIES TIMEOUT 120
                       FIXTURES_REQUIRED ckpt_matrix_${a} ENVIRONMENT "${env}")
endforeach()
foreach(pair full_shard_x4:ddp_x2 zero1_x3:shard_grad_op_x2 hybrid_shard_2x2:no_shard_x3)
  string(REPLACE ":" ";" ab ${pair})
  list(GET ab 0 a)
  list(GET ab 1 b)
  shardtrain_mpi_twin(dist.checkpoint.matrix.${a}_to_${b} ${ckpt_matrix_${b}_world}
                      $<TARGET_FILE:dist_checkpoint_strategies_tests> --gtest_filter=Matrix.Load
                      EXTRA_ENV SHARDTRAIN_MATRIX_DIR=${CKPT_MATRIX_DIR}/mpi/${a})
  set_tests_properties(dist.checkpoint.matrix.${a}_to_${b}.mpi PROPERTIES FIXTURES_REQUIRED ckpt_matrix_mpi_${a})
endforeach()
