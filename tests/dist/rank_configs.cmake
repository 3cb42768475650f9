# Ranks started with different configurations (rank_configs.sh): two
# launchers with different optimizer.lr, and mpirun ranks with different
# model.n_embd or trainer.max_steps, exit 2 on every rank naming the key and
# the ranks; a per-host key (threads_per_rank) may differ.
add_test(NAME dist.launch.rank_configs
         COMMAND ${CMAKE_CURRENT_LIST_DIR}/rank_configs.sh ${SHARDTRAIN_CLI} ${PROJECT_SOURCE_DIR})
set_tests_properties(dist.launch.rank_configs PROPERTIES TIMEOUT 120 RUN_SERIAL TRUE
                     SKIP_RETURN_CODE 77)
