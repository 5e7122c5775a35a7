#!/usr/bin/env bash
# The soak (bench/soak.py has the details): the demo's job, gpt-micro with FlexDeMo on 2 nodes x
# 2 ranks of the emulated cluster, supervised by `flexdemo supervise`, with a fault from a seeded
# schedule every 2-3 minutes (kill -9 of a rank, a corrupted payload, a node lost and back, a NaN
# gradient, SIGTERM to the job, a node sending 1000x values, a link down for 20 s), against the
# same job undisturbed. Needs root (network namespaces). About 80 minutes at the defaults:
#   bash bench/soak.sh [--steps 5400] [--seed 1] [--gap 120-180] [--checkpoint-every 50]
#                      [--min-minutes 30]
# Writes runs/studies/soak/ (table.md, events.csv, summary.json, soak.log, both runs); exits
# non-zero unless the soak ends with every step logged once, its final validation loss within
# 0.5% of the undisturbed run's, no more steps redone per fault than the checkpoint interval,
# and a soak of at least --min-minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh >/dev/null
bash scripts/build.sh flexdemo_cli flexdemo_tokenize >/dev/null
mkdir -p runs/studies/soak
python3 bench/soak.py "$@" 2>&1 | tee runs/studies/soak/events.log
