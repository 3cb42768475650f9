# The communication benchmark's own command, at tiny sizes: it runs every
# collective, prints and appends its figures, and checks its results.
add_test(NAME cli.bench_comm COMMAND ${CMAKE_CURRENT_LIST_DIR}/bench_comm.sh ${SHARDTRAIN_CLI})
set_tests_properties(cli.bench_comm PROPERTIES TIMEOUT 300 ENVIRONMENT "SHARDTRAIN_TIMEOUT_S=60")
