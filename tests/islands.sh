#!/usr/bin/env bash
# ctest: islands (--island-nodes). 2 islands x 2 nodes x 1 rank with shard groups spanning each
# island's two nodes (--shard-size 2) make the same groups of the same ranks as 2 nodes x 2 ranks
# with --shard-size 2: the same arithmetic on another layout, so every step's loss and the bytes
# between replicas must be equal, bit for bit; the first line says the layout and the progress
# names what the replicas exchange across (islands).
#   tests/islands.sh BUILD_DIR
set -euo pipefail
source "$(dirname "$0")/lib.sh"
build=$1
work=$(mktemp -d)
trap 'rc=$?; [ $rc -eq 0 ] || { echo "--- last log:"; tail -20 "$work/last.log" 2>/dev/null; }
      rm -rf "$work"' EXIT
tiny_corpus "$work/corpus" 'document %d: text for the islands test.'
train() {  # OUT [options...]
  local out=$1
  shift
  mpirun --allow-run-as-root --oversubscribe -np 4 -x OMP_NUM_THREADS=1 \
    -x FLEXDEMO_TOKENIZE="$build/flexdemo-tokenize" \
    "$build/flexdemo" train --model gpt-nano --width 32 --layers 2 --heads 2 --context 32 \
    --seq 32 --batch 8 --chunk 8 --tokenizer bytes --data "$work/corpus" --steps 12 \
    --shard-size 2 --eval-seqs 4 --eval-every 6 --progress lines --log-every 1 \
    --checkpoint-every 1000 --out "$out" "$@" > "$work/last.log" 2>&1
  cp "$work/last.log" "$out.log"
}
per_step() { grep -o '"loss":[^,]*\|"inter_bytes_sent":[^,]*' "$1/metrics.jsonl"; }

train "$work/nodes" --ranks-per-node 2 || { echo "FAIL: 2 nodes x 2 ranks failed"; exit 1; }
train "$work/islands" --ranks-per-node 1 --island-nodes 2 ||
  { echo "FAIL: 2 islands x 2 nodes x 1 rank failed"; exit 1; }
grep -q "flexdemo train: 2 islands x 2 nodes x 1 rank, shard size 2, 2 replicas" \
  "$work/islands.log" || { echo "FAIL: the first line does not say the islands' layout"; exit 1; }
grep -q "between islands/step" "$work/islands.log" ||
  { echo "FAIL: the progress does not name the islands"; exit 1; }
[ "$(per_step "$work/nodes" | wc -l)" -ge 24 ] || { echo "FAIL: too few metrics lines"; exit 1; }
diff <(per_step "$work/nodes") <(per_step "$work/islands") > "$work/diff" ||
  { echo "FAIL: the layouts' losses or bytes differ:"; head "$work/diff"; exit 1; }
echo "2 islands x 2 nodes x 1 rank equal 2 nodes x 2 ranks (shard size 2): every loss and the" \
  "bytes between replicas, 12 steps"
