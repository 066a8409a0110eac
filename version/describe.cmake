# Run at build time (cmake -P) by the tqkv_version_source target: writes
# OUTPUT from version.cc.in with the project version and `git describe` of
# SOURCE_DIR. configure_file leaves OUTPUT untouched when nothing changed, so
# an unchanged revision recompiles nothing.
#   -DSOURCE_DIR=... -DPROJECT_VERSION=... -DINPUT=... -DOUTPUT=...
set(TQKV_PROJECT_VERSION "${PROJECT_VERSION}")
set(TQKV_GIT_REVISION "unknown")
find_program(GIT_EXECUTABLE git)
if(GIT_EXECUTABLE)
  execute_process(
    COMMAND "${GIT_EXECUTABLE}" -C "${SOURCE_DIR}" describe --tags --always --dirty
    OUTPUT_VARIABLE described
    ERROR_QUIET
    RESULT_VARIABLE failed
    OUTPUT_STRIP_TRAILING_WHITESPACE)
  # Only characters that are safe in a C string and a Prometheus label.
  if(NOT failed AND described MATCHES "^[A-Za-z0-9._+-]+$")
    set(TQKV_GIT_REVISION "${described}")
  endif()
endif()
configure_file("${INPUT}" "${OUTPUT}" @ONLY)
