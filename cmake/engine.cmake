# The DeMo engine's sources: the step (src/demo/: dct, top-k, wire format, the plain, cpu and cuda
# backends, the CPU kernels per instruction set, the CUDA kernels) and the optimizer's whole
# control over it (src/optim/: options, step rules, replicators, the modes; the sum in rank order
# its shared second moment takes, src/comm/rank_order_sum.cpp), added to a target
# that links LibTorch. Shared by the library (CMakeLists.txt) and the Python package (python/), so
# both doors run one engine, compiled the same way. Needs only a compiler, LibTorch (and nvcc for
# CUDA): no MPI (the engine talks to a comm::Communicator), no zlib (the wire checksum is
# LibTorch's CRC-32).
#   flexdemo_add_engine(TARGET <target> CUDA <ON|OFF> [CUDA_ARCHITECTURES <list>])
set(FLEXDEMO_SOURCE_DIR "${CMAKE_CURRENT_LIST_DIR}/.." CACHE INTERNAL "flexdemo's sources")

function(flexdemo_add_engine)
  cmake_parse_arguments(ARG "" "TARGET;CUDA;CUDA_ARCHITECTURES" "" ${ARGN})
  set(root "${FLEXDEMO_SOURCE_DIR}")
  set(src "${root}/src")
  target_sources(${ARG_TARGET} PRIVATE
    ${src}/comm/rank_order_sum.cpp
    ${src}/demo/dct.cpp
    ${src}/demo/topk.cpp
    ${src}/demo/wire.cpp
    ${src}/demo/host_backend.cpp
    ${src}/demo/cuda_backend.cpp
    ${src}/demo/cpu/kernels.cpp
    ${src}/demo/cpu/dct_plans.cpp
    ${src}/demo/cpu/portable_kernels.cpp
    ${src}/demo/cuda/gpu_step.cpp
    ${src}/optim/options.cpp
    ${src}/optim/link_budget.cpp
    ${src}/optim/optimizer.cpp
    ${src}/optim/every_step.cpp
    ${src}/optim/second_moment.cpp
    ${src}/optim/local_steps.cpp
    ${src}/optim/demo_replicator.cpp
    ${src}/optim/owner_replicator.cpp
    ${src}/optim/dense_replicators.cpp
    ${src}/optim/replicator.cpp
    ${src}/optim/gradients.cpp
    ${src}/optim/step_rule.cpp
    ${src}/runtime/threads.cpp)
  target_include_directories(${ARG_TARGET} PRIVATE ${src} ${root}/include)
  # The GPU's arithmetic on the CPU: explicit fmaf only, never a contraction the GPU would not make.
  set_source_files_properties(${src}/demo/cpu/portable_kernels.cpp
    TARGET_DIRECTORY ${ARG_TARGET} PROPERTIES COMPILE_OPTIONS -ffp-contract=off)
  # The chunk kernels, compiled once per instruction set (Debian builds for baseline x86-64; the
  # AVX-512 or else the AVX2 + FMA copy is chosen at run time where the CPU has it). No LibTorch
  # in them: they build fast.
  foreach(isa baseline avx2 avx512)
    set(objects ${ARG_TARGET}_kernels_${isa})
    add_library(${objects} OBJECT ${src}/demo/cpu/chunk_kernels.cpp)
    target_include_directories(${objects} PRIVATE ${src})
    set_target_properties(${objects} PROPERTIES POSITION_INDEPENDENT_CODE ON)
    target_compile_definitions(${objects} PRIVATE FLEXDEMO_KERNEL_ISA=${isa})
    target_compile_options(${objects} PRIVATE -Wall -Wextra -Wno-psabi -ffp-contract=fast
                           -fno-math-errno)
    target_sources(${ARG_TARGET} PRIVATE $<TARGET_OBJECTS:${objects}>)
  endforeach()
  target_compile_options(${ARG_TARGET}_kernels_avx2 PRIVATE -mavx2 -mfma)
  target_compile_options(${ARG_TARGET}_kernels_avx512 PRIVATE -mavx2 -mfma -mavx512f -mavx512vl)
  # at::parallel_for is a header template: compiled without OpenMP, our own loops (top-k, decode,
  # the DCT bands) would run serially whatever the thread count. GCC's runtime (libgomp) is the
  # one LibTorch uses; other compilers (the clang sanitizer build) keep those loops serial.
  if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
    find_package(OpenMP REQUIRED)
    target_link_libraries(${ARG_TARGET} PRIVATE OpenMP::OpenMP_CXX)
  endif()
  if(ARG_CUDA)
    set(objects ${ARG_TARGET}_cuda_kernels)
    add_library(${objects} OBJECT ${src}/demo/cuda/cuda_kernels.cu)
    set_target_properties(${objects} PROPERTIES CUDA_STANDARD 17 POSITION_INDEPENDENT_CODE ON
                          CUDA_ARCHITECTURES "${ARG_CUDA_ARCHITECTURES}")
    # No contraction nvcc would choose and the CPU's portable kernels would not (chunk_math.h).
    # --resource-usage: ptxas prints each kernel's registers, shared memory and spills (none) in the
    # build log.
    target_compile_options(${objects} PRIVATE --fmad=false --resource-usage)
    target_include_directories(${objects} PRIVATE ${src} ${root}/include)
    target_sources(${ARG_TARGET} PRIVATE $<TARGET_OBJECTS:${objects}>)
    target_compile_definitions(${ARG_TARGET} PRIVATE FLEXDEMO_CUDA)
  endif()
endfunction()
