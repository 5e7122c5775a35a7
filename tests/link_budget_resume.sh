#!/usr/bin/env bash
# ctest: --link-budget auto under --overlap-step on 2 nodes x 2 ranks, its measurements replaced
# by FLEXDEMO_INJECT_LINK so that its choices are known: an endless probe (nothing fits: the
# ladder's last schedule, top-k 4 at 2bit every 2 steps) and an instant one (the first, top-k 32
# at bf16 every step) in turn, choices before steps 4, 9, 14, ... (--link-probe-every 5). Checks
# that metrics.jsonl logs each choice and every step's schedule, that the replicas stay identical
# (--check-replicas 1), and that a run stopped after step 14 (the first step of an every-2
# interval, a top-k change pending behind the exchange in flight) and resumed equals the
# uninterrupted run: every loss and the final weights, bit for bit.
#   tests/link_budget_resume.sh BUILD_DIR
set -euo pipefail
source "$(dirname "$0")/lib.sh"
build=$1
work=$(mktemp -d)
trap 'rc=$?; [ $rc -eq 0 ] || { echo "--- last log:"; tail -20 "$work/last.log" 2>/dev/null; }
      rm -rf "$work"' EXIT
tiny_corpus "$work/corpus" 'document %d: text for the link budget test.'
export FLEXDEMO_INJECT_SIGNAL=  # set for the stopped leg
export FLEXDEMO_INJECT_LINK=1e9,0,1e9,0,1e9,0
steps=30
train() {  # OUT [options...]
  local out=$1
  shift
  mpirun --allow-run-as-root --oversubscribe -np 4 -x OMP_NUM_THREADS=1 \
    -x FLEXDEMO_TOKENIZE="$build/flexdemo-tokenize" -x FLEXDEMO_INJECT_SIGNAL \
    -x FLEXDEMO_INJECT_LINK \
    "$build/flexdemo" train --model gpt-nano --width 32 --layers 2 --heads 2 --context 32 \
    --seq 32 --batch 8 --chunk 8 --tokenizer bytes --data "$work/corpus" --steps "$steps" \
    --ranks-per-node 2 --optimizer flexdemo --topk 32 --values bf16 --overlap-step \
    --link-budget auto --link-min-topk 4 --link-max-topk 32 --link-max-every 2 \
    --link-probe-every 5 --check-replicas 1 --checkpoint-every 1000 --eval-seqs 4 \
    --eval-every 1000 \
    --progress lines --log-every 1000 --out "$out" "$@" > "$work/last.log" 2>&1
}

train "$work/whole" || { echo "FAIL: the uninterrupted run failed"; exit 1; }
# The choices: step, top-k, values, interval.
choices=$(grep -o '"link_budget":{"step":[0-9]*,"topk":[0-9]*,"values":"[a-z0-9]*","every":[0-9]*' \
  "$work/whole/metrics.jsonl" | sed 's/"link_budget":{//; s/"[a-z_]*"://g; s/"//g')
expected="4,4,2bit,2
9,32,bf16,1
14,4,2bit,2
19,32,bf16,1
24,4,2bit,2
29,32,bf16,1"
[ "$choices" = "$expected" ] ||
  { echo "FAIL: the choices logged are"; echo "$choices"; echo "expected"; echo "$expected"; exit 1; }
# Every step logs the schedule its exchange followed: the interval at once, top-k and values from
# the next exchange on (under --overlap-step the one in flight is decoded as it was sent).
schedule_of() {
  grep "\"step\":$2," "$1/metrics.jsonl" | grep -o '"topk":[0-9]*,"values":"[a-z0-9]*","every":[0-9]*' |
    head -1 | sed 's/"[a-z_]*"://g; s/"//g'
}
[ "$(schedule_of "$work/whole" 3)" = "32,bf16,1" ] || { echo "FAIL: step 3 did not start from --topk 32"; exit 1; }
[ "$(schedule_of "$work/whole" 4)" = "32,bf16,2" ] || { echo "FAIL: step 4: $(schedule_of "$work/whole" 4)"; exit 1; }
[ "$(schedule_of "$work/whole" 5)" = "4,2bit,2" ] || { echo "FAIL: step 5: $(schedule_of "$work/whole" 5)"; exit 1; }
[ "$(schedule_of "$work/whole" 9)" = "32,bf16,1" ] || { echo "FAIL: step 9: $(schedule_of "$work/whole" 9)"; exit 1; }
expect_exact_resume "$work" "$steps" 14
echo "choices as injected; stopped after step 14 and resumed to $steps: every loss and the final" \
  "weights equal the uninterrupted run's"
