#!/usr/bin/env bash
# Installs what is missing, builds (Release, reusing build/) and runs every test through ctest:
# unit tests, MPI tests on 2 and 4 real ranks, bad input (docs/errors.md), dead ranks,
# preemption, elastic resume, the command, the installed CMake package and the emulated cluster
# (with a lost link).
#   scripts/test.sh --sanitize   instead: clang with AddressSanitizer + UndefinedBehaviorSanitizer
#                                (build-sanitize/): the unit tests, then each libFuzzer target
#                                for FLEXDEMO_FUZZ_SECONDS (default 60)
#   scripts/test.sh --cuda       instead: the same suite (less docs/errors.md's rows and the
#                                CUDA kernels' emulation, which the CPU build runs) built
#                                against the CUDA LibTorch of .venv-cuda/ (build-cuda/), run
#                                on the CPU; then the Python package (python/) installed into
#                                .venv-cuda and its tests (tests/python/: the ops, the
#                                optimizers, torchrun on 4 ranks)
# Other arguments go to ctest. Tests run FLEXDEMO_TEST_JOBS (default 2) at a time; those of 4 ranks
# reserve 4 (ctest's PROCESSORS), the emulated cluster's run alone.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
if [ "${1:-}" = "--cuda" ]; then
  shift
  bash scripts/install-deps.sh --cuda
  bash scripts/build.sh --cuda
  # docs/errors.md's rows (label bad_input: 127 of its 233 tests, about a third of their time)
  # check the command's argument handling, which no LibTorch reaches; the CUDA kernels'
  # emulation (label emulation, about 5 minutes) checks their logic, compiled for the host alike
  # in both builds, against the CPU kernels: both run once, in the CPU build.
  ctest --test-dir build-cuda --output-on-failure -j "${FLEXDEMO_TEST_JOBS:-2}" \
    -LE 'bad_input|emulation' "$@"
  bash scripts/python.sh install
  exec bash scripts/python.sh test
fi
bash scripts/install-deps.sh
if [ "${1:-}" = "--sanitize" ]; then
  shift
  if [ ! -f build-sanitize/CMakeCache.txt ]; then
    CC=clang CXX=clang++ cmake -S . -B build-sanitize -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -DFLEXDEMO_SANITIZE=ON -DFLEXDEMO_FUZZ_SECONDS="${FLEXDEMO_FUZZ_SECONDS:-60}"
  fi
  cmake --build build-sanitize -j "${FLEXDEMO_JOBS:-2}" \
    --target test_units test_text fuzz_wire fuzz_checkpoint
  export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1
  export LSAN_OPTIONS="suppressions=$PWD/tests/lsan.supp:print_suppressions=0"
  export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
  exec ctest --test-dir build-sanitize --output-on-failure -j "${FLEXDEMO_TEST_JOBS:-2}" \
    -L 'unit|fuzz' "$@"
fi
bash scripts/build.sh
ctest --test-dir build --output-on-failure -j "${FLEXDEMO_TEST_JOBS:-2}" "$@"
