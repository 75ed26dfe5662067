# Writes one ctest test per GoogleTest suite of a test binary (run after each
# build of it): each suite runs in one process, which pays LibTorch's start-up
# (~0.45 s on a 2-core machine) once per suite instead of once per test.
# Ranks are forked from that process, so a suite's tests must leave the parent
# without threads (docs/testing.md, "Fork safety").
#   cmake -D TEST_BINARY=... -D OUT=... -D TIMEOUT=... -D WORKING_DIRECTORY=... -P discover_suites.cmake
execute_process(COMMAND "${TEST_BINARY}" --gtest_list_tests
  OUTPUT_VARIABLE listing ERROR_VARIABLE errors RESULT_VARIABLE rc TIMEOUT 60)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "listing the tests of ${TEST_BINARY} failed (${rc}): ${errors}")
endif()
string(REPLACE ";" "," listing "${listing}")
string(REPLACE "\n" ";" lines "${listing}")

set(content "# Written by discover_suites.cmake from ${TEST_BINARY}; do not edit.\n")
set(suite "")
set(enabled 0)
macro(flush_suite)
  # A suite whose tests are all DISABLED_ is run by its own ctest entry (with
  # --gtest_also_run_disabled_tests), not here. A filter that matches no test
  # fails; a suite whose every test skipped itself exits with 77 (test_main.cpp)
  # and shows as skipped. (Not SKIP_REGULAR_EXPRESSION on GoogleTest's
  # summary: ctest lets a skip expression override a failure, and "0 tests
  # passed" is also what a suite of one skipped and one failed test prints.)
  if(NOT suite STREQUAL "" AND enabled GREATER 0)
    # The fault-tolerance suites run ranks and a lighthouse against wall-clock
    # quorum deadlines: they take the torchrun lock, so that the multi-process
    # integration entries never run beside them and starve them of the cores.
    set(lock "")
    if(suite STREQUAL "FtManager" OR suite STREQUAL "FtLighthouse")  # not MATCHES: the caller reads CMAKE_MATCH_1
      set(lock " RESOURCE_LOCK torchrun")
    endif()
    string(APPEND content
      "add_test([=[${suite}]=] [=[${TEST_BINARY}]=] [=[--gtest_filter=${suite}.*]=] --gtest_brief=1)\n"
      "set_tests_properties([=[${suite}]=] PROPERTIES TIMEOUT ${TIMEOUT} COST ${enabled}"
      " WORKING_DIRECTORY [=[${WORKING_DIRECTORY}]=] LABELS gtest SKIP_RETURN_CODE 77"
      " FAIL_REGULAR_EXPRESSION [=[\\] 0 tests from]=]${lock})\n")
  endif()
endmacro()
foreach(line IN LISTS lines)
  if(line MATCHES "^([^ ][^ ]*)\\.( .*)?$")
    flush_suite()
    set(suite "${CMAKE_MATCH_1}")
    set(enabled 0)
  elseif(line MATCHES "^  ([^ ]+)")
    if(NOT CMAKE_MATCH_1 MATCHES "^DISABLED_" AND NOT suite MATCHES "(^|/)DISABLED_")
      math(EXPR enabled "${enabled} + 1")
    endif()
  endif()
endforeach()
flush_suite()
file(WRITE "${OUT}" "${content}")
