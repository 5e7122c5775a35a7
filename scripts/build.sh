#!/usr/bin/env bash
# Configures (once) and builds flexdemo in Release, reusing the build folder between runs.
#   scripts/build.sh [TARGET...]          build/ against Debian's LibTorch; only these targets
#                                         (e.g. flexdemo_cli) when given, else everything
#   scripts/build.sh --cuda [TARGET...]   build-cuda/ against the CUDA LibTorch of .venv-cuda/
#                                         (scripts/install-deps.sh --cuda makes it); compiles and
#                                         links here without a GPU
set -euo pipefail
cd "$(dirname "$0")/.."
jobs="${FLEXDEMO_JOBS:-2}"
dir=build
configure=(-DCMAKE_BUILD_TYPE=Release)
if [ "${1:-}" = "--cuda" ]; then
  shift
  dir=build-cuda
  torch=$(.venv-cuda/bin/python -c 'import os, torch; print(os.path.dirname(torch.__file__))' 2>/dev/null) ||
    { echo "build: no torch in .venv-cuda (run scripts/install-deps.sh --cuda)" >&2; exit 1; }
  # Torch_DIR alone is not enough: TorchConfig looks for its libraries on the default paths
  # first, where Debian's LibTorch is; the prefix puts the wheel's first.
  configure+=(-DTorch_DIR="$torch/share/cmake/Torch" -DCMAKE_PREFIX_PATH="$torch")
  export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"  # Hopper (the H200)
fi
if [ ! -f "$dir/CMakeCache.txt" ]; then
  cmake -S . -B "$dir" "${configure[@]}"
fi
targets=()
for t in "$@"; do targets+=(--target "$t"); done
cmake --build "$dir" -j "$jobs" "${targets[@]}"
