#!/usr/bin/env bash
# Installs what is missing, builds, and runs the main job on built-in defaults: DeMo between
# 2 MPI replicas of a GPT-2-shaped parameter set (3.8M parameters), counting the bytes each
# rank sends against the dense all-reduce plain data parallelism would send for the same steps.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/build.sh
export OMP_NUM_THREADS=1
root_flag=""
if [ "$(id -u)" -eq 0 ]; then root_flag="--allow-run-as-root"; fi
exec mpirun $root_flag --oversubscribe -np 2 build/flexdemo bench exchange "$@"
