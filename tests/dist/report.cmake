# The run report rendered by headless Chromium from two real runs (skipped,
# exit 77, where Chromium is missing).
add_test(NAME cli.report_browser
         COMMAND ${CMAKE_CURRENT_LIST_DIR}/report_browser.sh ${SHARDTRAIN_CLI} ${PROJECT_SOURCE_DIR})
set_tests_properties(cli.report_browser PROPERTIES TIMEOUT 600 SKIP_RETURN_CODE 77
                     ENVIRONMENT "SHARDTRAIN_TIMEOUT_S=120")
