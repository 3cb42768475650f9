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

# More ranks on one host than the shared mapping's header once had room for
# (64): a few checked shared-memory collectives at 65 and 130 ranks,
# oversubscribed, with small staging areas (one launched process forks the
# ranks: see shm_many_ranks.cpp).
add_executable(shm_many_ranks ${CMAKE_CURRENT_LIST_DIR}/shm_many_ranks.cpp)
target_link_libraries(shm_many_ranks PRIVATE shardtrain)
shardtrain_use_pch(shm_many_ranks)
foreach(n 65 130)
  add_test(NAME dist.shm_many_ranks.world${n}
           COMMAND ${SHARDTRAIN_CLI} launch --nproc-per-node 1 -- $<TARGET_FILE:shm_many_ranks> ${n})
  set_tests_properties(dist.shm_many_ranks.world${n} PROPERTIES TIMEOUT 300 RUN_SERIAL TRUE
                       ENVIRONMENT "SHARDTRAIN_TIMEOUT_S=60;SHARDTRAIN_SHM_STAGE_BYTES=33280")
endforeach()

# The run directory stays locked between restart rounds: a second process
# tries flock(2) on its lock file every millisecond while a rank is killed
# and relaunched (--max-restarts 1), and never gets it until the job ends.
add_test(NAME cli.run_lock_restart
         COMMAND ${CMAKE_CURRENT_LIST_DIR}/run_lock_restart.sh ${SHARDTRAIN_CLI} ${PROJECT_SOURCE_DIR})
set_tests_properties(cli.run_lock_restart PROPERTIES TIMEOUT 120 ENVIRONMENT "SHARDTRAIN_TIMEOUT_S=60")
