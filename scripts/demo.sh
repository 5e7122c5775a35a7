#!/usr/bin/env bash
# Installs what is missing, builds, and runs the main job on built-in defaults: FlexDeMo on a
# GPT-2-shaped parameter set (3.8M parameters) over 4 MPI ranks emulating 2 nodes x 2 ranks,
# sharded inside each node, DeMo between them. It prints the bytes between nodes against plain
# HSDP (a dense all-reduce), the bytes inside nodes, the state per rank, and checks that the
# replicas stay bit-identical. Extra arguments go to `flexdemo bench exchange`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/build.sh
export OMP_NUM_THREADS=1
root_flag=""
if [ "$(id -u)" -eq 0 ]; then root_flag="--allow-run-as-root"; fi
exec mpirun $root_flag --oversubscribe -np 4 build/flexdemo bench exchange --ranks-per-node 2 "$@"
