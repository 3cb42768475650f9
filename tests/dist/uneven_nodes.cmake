# Nodes that start different numbers of ranks (uneven_nodes.sh): two launchers
# on this host with 2 and 1 ranks train ddp, zero1, fsdp and auto to the
# losses of one launcher of 3 ranks; hybrid_shard and tensor_parallel=2 are
# refused with one line.
add_test(NAME dist.launch.uneven_nodes
         COMMAND ${CMAKE_CURRENT_LIST_DIR}/uneven_nodes.sh ${SHARDTRAIN_CLI} ${PROJECT_SOURCE_DIR})
set_tests_properties(dist.launch.uneven_nodes PROPERTIES TIMEOUT 600 RUN_SERIAL TRUE
                     ENVIRONMENT "SHARDTRAIN_TIMEOUT_S=120;OMP_NUM_THREADS=1")
