# Runs one program and checks both its exit code and its output, which
# ctest's PASS_REGULAR_EXPRESSION alone cannot (it ignores the exit code).
#   cmake -DEXPECT_EXIT=<code> -DEXPECT_OUTPUT=<regex> -P expect_run.cmake -- <program> <args...>
# Fails when the exit code differs or the output (stdout and stderr) does
# not match; prints the output either way.
set(command "")
set(seen_separator FALSE)
foreach(i RANGE ${CMAKE_ARGC})
  if(seen_separator AND DEFINED CMAKE_ARGV${i})
    list(APPEND command "${CMAKE_ARGV${i}}")
  elseif("${CMAKE_ARGV${i}}" STREQUAL "--")
    set(seen_separator TRUE)
  endif()
endforeach()
if(NOT command)
  message(FATAL_ERROR "expect_run.cmake: no program after --")
endif()
execute_process(COMMAND ${command} RESULT_VARIABLE code OUTPUT_VARIABLE out ERROR_VARIABLE err)
message("${out}${err}")
if(NOT "${code}" STREQUAL "${EXPECT_EXIT}")
  message(FATAL_ERROR "exit code ${code}; want ${EXPECT_EXIT}")
endif()
if(DEFINED EXPECT_OUTPUT AND NOT "${out}${err}" MATCHES "${EXPECT_OUTPUT}")
  message(FATAL_ERROR "the output does not match '${EXPECT_OUTPUT}'")
endif()
