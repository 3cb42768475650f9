# `shardtrain estimate` against the formulas, recomputed in plain Python from
# the printed configs (MLP and GPT, non-divisible world size, two nodes, a
# budget nothing fits).
add_test(NAME cli.estimate
         COMMAND python3 ${CMAKE_CURRENT_LIST_DIR}/estimate_cli.py ${SHARDTRAIN_CLI} ${PROJECT_SOURCE_DIR})
set_tests_properties(cli.estimate PROPERTIES TIMEOUT 120)
