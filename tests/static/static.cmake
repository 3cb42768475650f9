# Checks of the source tree itself.

# Every file read goes through src/core/file.cpp: no std::ifstream, fopen or
# raw open() for reading anywhere else in src/, tools/ or include/.
add_test(NAME static.no_raw_reads
         COMMAND python3 ${CMAKE_CURRENT_LIST_DIR}/no_raw_reads.py ${PROJECT_SOURCE_DIR})
set_tests_properties(static.no_raw_reads PROPERTIES TIMEOUT 60)

# No function in src/ over 80 lines, none in src/train/trainer.cpp or
# step.cpp over 40 (issue 46); the key tables of config/schema.cpp exempt.
add_test(NAME static.function_length
         COMMAND python3 ${CMAKE_CURRENT_LIST_DIR}/function_length.py ${PROJECT_SOURCE_DIR})
set_tests_properties(static.function_length PROPERTIES TIMEOUT 60)
