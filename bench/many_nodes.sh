#!/usr/bin/env bash
# More nodes, measured (issue 34): the emulated cluster (scripts/cluster.sh; needs root) at each
# node count of NODES with 1 rank a node, each link rate of RATES; per run STEPS steps of MODEL,
# and per step the bytes each node sends and receives between nodes and the step's wall time, for
# each exchange: FlexDeMo (DeMo's all-gather), FlexDeMo with the owners' exchange
# (--demo-exchange owners), AdamW-HSDP (the dense all-reduce) and AdamW's
# local steps with their change through DeMo every 10 steps (SparseLoCo's recipe). Then the
# projection (python -m flexdemo.project) of each measured point from its own measured compute
# time, and its error: once with the links' nominal rate, once with the latency and rate each
# way that `flexdemo bench link` measures on the same cluster (link.json beside the runs).
#   bash bench/many_nodes.sh   NODES (default "2 4 8"), RATES (default "1gbit 100mbit"),
#                              STEPS (default 40: the mean of the steps after the first 10),
#                              MODEL (default gpt-nano), LATENCY_MS (the projection's message
#                              latency, default 0.1)
# Writes runs/studies/many-nodes/<model>/<rate>/<nodes>/<exchange>/ (one `flexdemo train` each;
# a finished run is kept and not trained again) and table.md there (also printed).
set -euo pipefail
cd "$(dirname "$0")/.."
nodes="${NODES:-2 4 8}"
rates="${RATES:-1gbit 100mbit}"
steps="${STEPS:-40}"
model="${MODEL:-gpt-nano}"
out="runs/studies/many-nodes/$model"
bash scripts/install-deps.sh --cuda >/dev/null  # the projection runs in .venv-cuda's Python
bash scripts/build.sh flexdemo_cli flexdemo_tokenize >/dev/null
export FLEXDEMO_TOKENIZE="$PWD/build/flexdemo-tokenize"
export OMP_NUM_THREADS=1
cluster=scripts/cluster.sh
trap 'bash "$cluster" down >/dev/null 2>&1 || true' EXIT
# name|options: the name is what the table calls the exchange
exchanges=(
  "allgather|--optimizer flexdemo"
  "owners|--optimizer flexdemo --demo-exchange owners"
  "allreduce|--optimizer adamw"
  "local-10|--optimizer adamw --replicator demo --inner-steps 10 --topk 320 --values 2bit"
)
mkdir -p "$out"
for rate in $rates; do
  for n in $nodes; do
    up=0
    probe="$out/$rate/$n/link.json"  # the network as the ranks see it (flexdemo bench link)
    if [ ! -f "$probe" ]; then
      echo "== $rate, $n nodes, the link's latency and rate =="
      bash "$cluster" up "$n" 1 "$rate" >/dev/null
      up=1
      mkdir -p "$(dirname "$probe")"
      bash "$cluster" run -- "$PWD/build/flexdemo" bench link --json >"$probe.tmp"
      mv "$probe.tmp" "$probe"
    fi
    for e in "${exchanges[@]}"; do
      name=${e%%|*}
      d="$out/$rate/$n/$name"
      if [ -f "$d/summary.json" ]; then echo "== $rate, $n nodes, $name (kept) =="; continue; fi
      echo "== $rate, $n nodes, $name =="
      [ "$up" -eq 1 ] || { bash "$cluster" up "$n" 1 "$rate" >/dev/null; up=1; }
      rm -rf "$d"
      # shellcheck disable=SC2086  # the options split into words on purpose
      bash "$cluster" run -- "$PWD/build/flexdemo" train --model "$model" --steps "$steps" \
        --eval-every 0 --eval-seqs 8 --log-every 10 --progress lines ${e#*|} --out "$PWD/$d" \
        >"$out/$rate-$n-$name.log" 2>&1
    done
    [ "$up" -eq 0 ] || bash "$cluster" down >/dev/null
  done
done
.venv-cuda/bin/python bench/many_nodes_table.py "$out" "${LATENCY_MS:-0.1}" | tee "$out/table.md"
