# Every command's flags through the one parser: bad values, missing values
# and unknown flags exit 2 with one line (tools/shardtrain/flags.h).
add_test(NAME cli.flags COMMAND ${CMAKE_CURRENT_LIST_DIR}/cli_flags.sh ${SHARDTRAIN_CLI})
set_tests_properties(cli.flags PROPERTIES TIMEOUT 60)
