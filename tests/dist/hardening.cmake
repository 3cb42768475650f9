# Faults at the edges of a run: a disk that fills during the end-of-training
# save and export (a tmpfs the test mounts: root only, as CI runs; skipped
# otherwise).
add_test(NAME cli.train_full_disk
         COMMAND ${CMAKE_CURRENT_LIST_DIR}/train_full_disk.sh ${SHARDTRAIN_CLI} ${PROJECT_SOURCE_DIR})
set_tests_properties(cli.train_full_disk PROPERTIES TIMEOUT 300 SKIP_RETURN_CODE 77
                     ENVIRONMENT "SHARDTRAIN_TIMEOUT_S=60")

# Strangers at the job's store from another host (network namespaces: root
# only, as CI runs; skipped otherwise): a flood and an idle horde of 1,100
# connections while a 2-rank job trains, loses a rank and restarts.
add_test(NAME cli.store_flood
         COMMAND ${CMAKE_CURRENT_LIST_DIR}/store_flood.sh ${SHARDTRAIN_CLI} ${PROJECT_SOURCE_DIR})
set_tests_properties(cli.store_flood PROPERTIES TIMEOUT 300 SKIP_RETURN_CODE 77 RUN_SERIAL TRUE)
