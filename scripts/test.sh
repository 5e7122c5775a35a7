#!/usr/bin/env bash
# Installs what is missing, builds (Release, reusing build/) and runs every test through ctest:
# unit tests, MPI tests on 2 and 4 real ranks, the command, and the installed CMake package.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/build.sh
export OMP_NUM_THREADS=1
ctest --test-dir build --output-on-failure "$@"
