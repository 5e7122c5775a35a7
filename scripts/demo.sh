#!/usr/bin/env bash
# Installs what is missing, builds, and runs the main job on built-in defaults: gpt-micro (~4M
# parameters) trained on the fortunes corpus by 4 MPI ranks emulating 2 nodes x 2 ranks, once
# with FlexDeMo (sharded inside nodes, DeMo between them) and once with AdamW-HSDP (the same
# sharding, a dense all-reduce between nodes); then `flexdemo report` compares them: final
# validation loss, tokens/s, bytes between nodes per step, and plots in runs/demo/report.
# 300 steps: on a fresh 2-core machine, apt, build and both runs take about 7 minutes (README).
# STEPS=N overrides the 300 steps; extra arguments go to both `flexdemo train` runs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/build.sh flexdemo_cli flexdemo_tokenize  # what the job runs; the tests are test.sh's
export OMP_NUM_THREADS=1
root_flag=""
if [ "$(id -u)" -eq 0 ]; then root_flag="--allow-run-as-root"; fi
steps="${STEPS:-300}"
progress=lines
if [ -t 1 ]; then progress=bar; fi
train() {
  mpirun $root_flag --oversubscribe -np 4 build/flexdemo train --model gpt-micro \
    --ranks-per-node 2 --steps "$steps" --eval-every 50 --log-every 50 --progress "$progress" "$@"
}
train --optimizer flexdemo --out runs/demo/flexdemo "${@}"
train --optimizer adamw --out runs/demo/adamw-hsdp "${@}"
build/flexdemo report runs/demo/flexdemo runs/demo/adamw-hsdp --out runs/demo/report
