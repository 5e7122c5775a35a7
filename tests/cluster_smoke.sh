#!/usr/bin/env bash
# ctest smoke test of the emulated cluster: 2 namespaces, 1 rank each, 20 steps of a tiny model
# with AdamW-HSDP. The bytes between nodes in the metrics must equal the closed form (a dense
# all-reduce: 2 (P-1)/P * 4 bytes * parameters per rank, summed over the 2 ranks), and at 10mbit
# the steps must be measurably slower than with unlimited links. Exits 77 (skipped, with the
# reason printed) only where network namespaces cannot be created.
set -euo pipefail
build=$1
src=$2
source "$(dirname "$0")/lib.sh"
require_netns
cluster="$src/scripts/cluster.sh"
work=$(mktemp -d)
trap 'bash "$cluster" down >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
tiny_corpus "$work/corpus" 'fortune %d: a short text for the smoke test.'
export FLEXDEMO_TOKENIZE="$build/flexdemo-tokenize"

median_step_ms() {  # of a run's metrics.jsonl
  grep -o '"step_ms":[0-9.e+-]*' "$1/metrics.jsonl" | cut -d: -f2 | sort -g |
    awk '{v[NR] = $1} END {print v[int((NR + 1) / 2)]}'
}

for rate in none 10mbit; do
  bash "$cluster" up 2 1 "$rate"
  bash "$cluster" run -- "$build/flexdemo" train --model gpt-nano --width 64 --layers 1 \
    --heads 2 --context 32 --seq 32 --batch 4 --tokenizer bytes --data "$work/corpus" \
    --steps 20 --optimizer adamw --progress lines --log-every 100 --eval-seqs 2 \
    --out "$work/$rate"
  bash "$cluster" down
done

params=$(grep -o '"num_params": [0-9]*' "$work/none/config.json" | grep -o '[0-9]*$')
expected=$((2 * 4 * params))
for rate in none 10mbit; do
  while read -r sent; do
    if [ "$sent" -ne "$expected" ]; then
      echo "FAIL ($rate): $sent bytes between nodes in a step, the closed form is $expected"
      exit 1
    fi
  done < <(grep -o '"inter_bytes_sent":[0-9]*' "$work/$rate/metrics.jsonl" | cut -d: -f2)
done
fast=$(median_step_ms "$work/none")
slow=$(median_step_ms "$work/10mbit")
echo "bytes between nodes per step: $expected (closed form) in all 40 steps"
echo "median step: ${fast} ms unlimited, ${slow} ms at 10mbit"
awk -v f="$fast" -v s="$slow" 'BEGIN { exit !(s > 2 * f) }' ||
  { echo "FAIL: the 10mbit limit is not in force"; exit 1; }
