#!/usr/bin/env bash
# ctest: --inner-steps 4 (DiLoCo's outer loop through DeMo's 2bit exchange, AdamW local steps) on
# 2 nodes x 2 ranks, stopped mid-round by a preemption signal (FLEXDEMO_INJECT_SIGNAL, after step
# 14: two local steps into the fourth round) and resumed: every per-step loss and the final
# weights equal the uninterrupted run's, bit for bit (each replica's own parameters, the anchor,
# the outer momentum and the residuals are in the checkpoint); the replicas' anchors are checked
# identical every 4 steps (--check-replicas 4).
#   tests/inner_steps_resume.sh BUILD_DIR
set -euo pipefail
source "$(dirname "$0")/lib.sh"
build=$1
work=$(mktemp -d)
trap 'rc=$?; [ $rc -eq 0 ] || { echo "--- last log:"; tail -20 "$work/last.log" 2>/dev/null; }
      rm -rf "$work"' EXIT
tiny_corpus "$work/corpus" 'document %d: text for the inner steps test.'
export FLEXDEMO_INJECT_SIGNAL=  # set for the stopped leg
steps=30
train() {  # OUT [options...]
  local out=$1
  shift
  mpirun --allow-run-as-root --oversubscribe -np 4 -x OMP_NUM_THREADS=1 \
    -x FLEXDEMO_TOKENIZE="$build/flexdemo-tokenize" -x FLEXDEMO_INJECT_SIGNAL \
    "$build/flexdemo" train --model gpt-nano --width 32 --layers 2 --heads 2 --context 32 \
    --seq 32 --batch 8 --chunk 8 --tokenizer bytes --data "$work/corpus" --steps "$steps" \
    --ranks-per-node 2 --optimizer adamw --replicator demo --inner-steps 4 --topk 16 \
    --values 2bit --check-replicas 4 --checkpoint-every 1000 --eval-seqs 4 --eval-every 1000 \
    --progress lines --log-every 1000 --out "$out" "$@" > "$work/last.log" 2>&1
}
losses() { grep -o '"loss":[^,]*' "$1/metrics.jsonl"; }

train "$work/whole" || { echo "FAIL: the uninterrupted run failed"; exit 1; }
expect_exact_resume "$work" "$steps" 14
# The losses move: local steps train, and the outer steps do not undo them.
first=$(losses "$work/whole" | head -1 | cut -d: -f2)
last=$(losses "$work/whole" | tail -1 | cut -d: -f2)
awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a) }' ||
  { echo "FAIL: the loss did not fall ($first -> $last)"; exit 1; }
echo "stopped after step 14 (mid-round) and resumed to $steps: every loss and the final weights" \
  "equal the uninterrupted run's (loss $first -> $last)"
