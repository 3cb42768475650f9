# The examples run for real under the launcher, and build against an
# installed shardtrain found with find_package.
foreach(example custom_module manual_loop)
  add_test(NAME examples.${example}.world2
           COMMAND ${SHARDTRAIN_CLI} launch --nproc-per-node 2 -- $<TARGET_FILE:${example}>)
  set_tests_properties(examples.${example}.world2 PROPERTIES TIMEOUT 300
                       ENVIRONMENT "SHARDTRAIN_TIMEOUT_S=60"
                       WORKING_DIRECTORY ${CMAKE_BINARY_DIR})
endforeach()

add_test(NAME install.find_package
         COMMAND ${CMAKE_CURRENT_LIST_DIR}/install_find_package.sh ${CMAKE_BINARY_DIR} ${PROJECT_SOURCE_DIR})
set_tests_properties(install.find_package PROPERTIES TIMEOUT 600)
