# Files that are not regular files where the CLI reads one (data.train,
# tokenize INPUT, a model directory's config.json and shards): refused at
# once, named, never waited on or read without end.
add_test(NAME cli.untrusted_files
         COMMAND ${CMAKE_CURRENT_LIST_DIR}/untrusted_files.sh ${SHARDTRAIN_CLI})
set_tests_properties(cli.untrusted_files PROPERTIES TIMEOUT 300)
