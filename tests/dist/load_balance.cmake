# Measured load balancing (distributed.load_balance) through the CLI and the
# launcher: exact against the even run under every data-parallel strategy
# and after a resume; the edge batches against one process; nodes of 2
# and 1 ranks starting from their threads' shares; a rank
# throttled to half a core by a cgroup loses share and gets it back.
set(LOAD_BALANCE /usr/bin/python3 ${CMAKE_CURRENT_LIST_DIR}/load_balance.py)
foreach(mode exact edges nodes throttled)
  add_test(NAME cli.load_balance.${mode} COMMAND ${LOAD_BALANCE} ${mode} ${SHARDTRAIN_CLI} ${PROJECT_SOURCE_DIR})
  set_tests_properties(cli.load_balance.${mode} PROPERTIES TIMEOUT 600)
endforeach()
# Timing decides its shares: alone on the machine.
set_tests_properties(cli.load_balance.throttled PROPERTIES RUN_SERIAL TRUE)
