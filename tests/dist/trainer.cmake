# The trainer under the launcher: DDP parity with the single-process run, and
# the CLI's default job end to end.
add_executable(test_trainer_parity ${CMAKE_CURRENT_LIST_DIR}/test_trainer_parity.cpp ${CMAKE_CURRENT_LIST_DIR}/world_main.cpp)
target_link_libraries(test_trainer_parity PRIVATE shardtrain GTest::gtest)
shardtrain_use_pch(test_trainer_parity)
foreach(n 1 2 3)
  add_test(NAME dist.trainer.parity.world${n}
           COMMAND ${SHARDTRAIN_CLI} launch --nproc-per-node ${n} -- $<TARGET_FILE:test_trainer_parity>)
  set_tests_properties(dist.trainer.parity.world${n} PROPERTIES TIMEOUT 600
                       ENVIRONMENT "SHARDTRAIN_TIMEOUT_S=120")
  if(n GREATER 1)
    shardtrain_mpi_twin(dist.trainer.parity.world${n} ${n} $<TARGET_FILE:test_trainer_parity>)
  endif()
endforeach()

add_test(NAME cli.train_default_job
         COMMAND ${CMAKE_CURRENT_LIST_DIR}/train_default_job.sh ${SHARDTRAIN_CLI} ${PROJECT_SOURCE_DIR})
set_tests_properties(cli.train_default_job PROPERTIES TIMEOUT 600 ENVIRONMENT "SHARDTRAIN_TIMEOUT_S=120")

# In a real terminal (tmux) the launcher draws one progress bar in place;
# through a pipe, plain lines.
add_test(NAME cli.train_progress_terminal
         COMMAND ${CMAKE_CURRENT_LIST_DIR}/progress_terminal.sh ${SHARDTRAIN_CLI} ${PROJECT_SOURCE_DIR})
set_tests_properties(cli.train_progress_terminal PROPERTIES TIMEOUT 600 ENVIRONMENT "SHARDTRAIN_TIMEOUT_S=120")

# SIGTERM saves a checkpoint and exits 143, SIGHUP likewise with 129; resume
# auto continues from each.
add_test(NAME cli.train_sigterm_resume
         COMMAND ${CMAKE_CURRENT_LIST_DIR}/train_signal.sh ${SHARDTRAIN_CLI} ${PROJECT_SOURCE_DIR})
set_tests_properties(cli.train_sigterm_resume PROPERTIES TIMEOUT 300 ENVIRONMENT "SHARDTRAIN_TIMEOUT_S=60")

# Every precision mode through the end of `shardtrain train` (final save,
# export, sample) and back through `shardtrain generate`.
add_test(NAME cli.train_every_precision
         COMMAND ${CMAKE_CURRENT_LIST_DIR}/train_precisions.sh ${SHARDTRAIN_CLI} ${PROJECT_SOURCE_DIR})
set_tests_properties(cli.train_every_precision PROPERTIES TIMEOUT 600 ENVIRONMENT "SHARDTRAIN_TIMEOUT_S=120")

# The BLAS kernels and threads `shardtrain train` picks by itself, and the
# step profile of trainer.profile_step.
add_test(NAME cli.train_speed_settings
         COMMAND ${CMAKE_CURRENT_LIST_DIR}/train_speed_settings.sh ${SHARDTRAIN_CLI} ${PROJECT_SOURCE_DIR})
set_tests_properties(cli.train_speed_settings PROPERTIES TIMEOUT 300 ENVIRONMENT "SHARDTRAIN_TIMEOUT_S=60")

# Two network-namespace hosts x 2 ranks, no interface variable: ddp and
# hybrid_shard match the single process (needs root, as CI runs).
add_test(NAME cli.train_two_hosts
         COMMAND ${CMAKE_CURRENT_LIST_DIR}/two_hosts.sh ${SHARDTRAIN_CLI} ${PROJECT_SOURCE_DIR})
set_tests_properties(cli.train_two_hosts PROPERTIES TIMEOUT 600 SKIP_RETURN_CODE 77 RUN_SERIAL TRUE)
# Restarts across two namespace hosts: kills, a lost host that comes back,
# and a stranger refused by the store.
add_test(NAME cli.train_two_hosts_chaos
         COMMAND ${CMAKE_CURRENT_LIST_DIR}/two_hosts_chaos.sh ${SHARDTRAIN_CLI} ${PROJECT_SOURCE_DIR})
set_tests_properties(cli.train_two_hosts_chaos PROPERTIES TIMEOUT 600 SKIP_RETURN_CODE 77 RUN_SERIAL TRUE)
# Two stages split across the two hosts: only activations cross the link.
add_test(NAME cli.train_two_hosts_chaos.pipeline
         COMMAND ${CMAKE_CURRENT_LIST_DIR}/two_hosts_chaos.sh ${SHARDTRAIN_CLI} ${PROJECT_SOURCE_DIR}
                 --set distributed.pipeline_parallel=2)
set_tests_properties(cli.train_two_hosts_chaos.pipeline PROPERTIES TIMEOUT 600 SKIP_RETURN_CODE 77 RUN_SERIAL TRUE)
# Four namespace hosts on one bridge x 2 ranks (the slim `make bench-scale`):
# hybrid_shard matches the single process, and a lost host comes back.
add_test(NAME cli.train_many_hosts
         COMMAND ${CMAKE_CURRENT_LIST_DIR}/many_hosts.sh ${SHARDTRAIN_CLI} ${PROJECT_SOURCE_DIR})
set_tests_properties(cli.train_many_hosts PROPERTIES TIMEOUT 300 SKIP_RETURN_CODE 77 RUN_SERIAL TRUE)

# A rank SIGKILLed three times under --max-restarts 3: the run resumes each
# time and ends bit-identical to an uninterrupted one.
add_test(NAME cli.train_chaos_restarts
         COMMAND ${CMAKE_CURRENT_LIST_DIR}/train_chaos.sh ${SHARDTRAIN_CLI} ${PROJECT_SOURCE_DIR})
set_tests_properties(cli.train_chaos_restarts PROPERTIES TIMEOUT 600 ENVIRONMENT "SHARDTRAIN_TIMEOUT_S=60")
# The same under a pipeline (two stages, one per rank; zero_bubble): a stage
# killed mid-step ends the step for both, and the restart resumes exactly.
add_test(NAME cli.train_chaos_restarts.pipeline
         COMMAND ${CMAKE_CURRENT_LIST_DIR}/train_chaos.sh ${SHARDTRAIN_CLI} ${PROJECT_SOURCE_DIR}
                 --set distributed.pipeline_parallel=2 --set distributed.pipeline_schedule=zero_bubble)
set_tests_properties(cli.train_chaos_restarts.pipeline PROPERTIES TIMEOUT 600 ENVIRONMENT "SHARDTRAIN_TIMEOUT_S=60")

add_test(NAME cli.silent_waits
         COMMAND ${CMAKE_CURRENT_LIST_DIR}/silent_waits.sh ${SHARDTRAIN_CLI} ${PROJECT_SOURCE_DIR})
set_tests_properties(cli.silent_waits PROPERTIES TIMEOUT 300)

# `shardtrain train` under mpirun (the mpi backend): ddp, resumed as
# full_shard at another world size, and two namespace hosts under one mpirun.
add_test(NAME cli.train_mpirun
         COMMAND ${CMAKE_CURRENT_LIST_DIR}/mpirun_train.sh ${SHARDTRAIN_CLI} ${PROJECT_SOURCE_DIR})
set_tests_properties(cli.train_mpirun PROPERTIES TIMEOUT 600)
