#!/usr/bin/env bash
# Configures (once) and builds flexdemo in Release into build/, reusing it between runs.
#   scripts/build.sh [TARGET...]   only these targets (e.g. flexdemo_cli); default: everything
set -euo pipefail
cd "$(dirname "$0")/.."
jobs="${FLEXDEMO_JOBS:-2}"
if [ ! -f build/CMakeCache.txt ]; then
  cmake -S . -B build -DCMAKE_BUILD_TYPE=Release
fi
targets=()
for t in "$@"; do targets+=(--target "$t"); done
cmake --build build -j "$jobs" "${targets[@]}"
