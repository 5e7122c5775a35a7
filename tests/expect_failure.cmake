# ctest script: run COMMAND (a ;-list), require a non-zero exit and a one-line stderr matching
# EXPECT -- how every bad input to the command must fail.
execute_process(COMMAND ${COMMAND} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc EQUAL 0)
  message(FATAL_ERROR "expected failure, but exited 0: ${COMMAND}")
endif()
if(NOT err MATCHES "${EXPECT}")
  message(FATAL_ERROR "stderr does not match '${EXPECT}':\n${err}")
endif()
string(STRIP "${err}" stripped)
if(stripped MATCHES "\n")
  message(FATAL_ERROR "stderr is more than one line:\n${err}")
endif()
