# ctest script: install flexdemo into a scratch prefix, build examples/ against the installed
# CMake package, and run the example on 2 MPI ranks. Fails on any step's non-zero exit.
set(prefix ${BUILD_DIR}/example-test/prefix)
set(example_build ${BUILD_DIR}/example-test/build)
function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGN}")
  endif()
endfunction()
run(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix})
run(${CMAKE_COMMAND} -S ${SOURCE_DIR}/examples -B ${example_build}
    -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH=${prefix})
run(${CMAKE_COMMAND} --build ${example_build} -j2)
run(${MPIRUN} --allow-run-as-root --oversubscribe -x OMP_NUM_THREADS=1 -np 2
    ${example_build}/demo_regression)
