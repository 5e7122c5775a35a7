#!/usr/bin/env bash
# ctest: a rank of a 4-rank job dies (MODE kill: kill -9) or hangs (MODE stop: SIGSTOP) after a
# checkpoint. The job must end with a non-zero exit within 60 s (a hang is caught by the
# collective timeout, --comm-timeout 10), the newest checkpoint must be valid, and --resume must
# train to the end, each step in metrics.jsonl exactly once. Prints the seconds to detection.
#   tests/dead_rank.sh BUILD_DIR kill|stop
set -euo pipefail
build=$1
mode=$2
source "$(dirname "$0")/lib.sh"
work=$(mktemp -d)
victim="" job=""
# On any failure the job's log is printed, so that a rare one can be diagnosed from CI.
trap 'rc=$?; [ -z "$victim" ] || kill -9 "$victim" 2>/dev/null || true
      [ -z "$job" ] || kill -9 "$job" 2>/dev/null || true
      [ $rc -eq 0 ] || { echo "--- job log:"; tail -30 "$work/log" 2>/dev/null; }
      rm -rf "$work"' EXIT
tiny_corpus "$work/corpus" 'document %d: text for the dead-rank test.'
job_command() {  # sets cmd: the job with these extra options
  cmd=(mpirun --allow-run-as-root --oversubscribe -np 4 -x OMP_NUM_THREADS=1
    -x FLEXDEMO_TOKENIZE="$build/flexdemo-tokenize" "$build/flexdemo" train --model gpt-nano
    --width 32 --layers 2 --heads 2 --context 32 --seq 32 --batch 8 --chunk 8 --tokenizer bytes
    --data "$work/corpus" --ranks-per-node 2 --checkpoint-every 10 --comm-timeout 10
    --eval-seqs 4 --progress lines --log-every 1000 --out "$work/run" "$@")
}

job_command --steps 100000
"${cmd[@]}" > "$work/log" 2>&1 &
job=$!  # mpirun
# Wait for a second checkpoint (step 20 or later: the job trains on while this polls, and
# --keep-checkpoints 2 deletes older ones, so step-20 itself may already be gone).
second_checkpoint() {
  ls "$work/run/checkpoints" 2>/dev/null | grep -E '^step-[0-9]+$' | sed 's/step-//' |
    awk '$1 >= 20 { found = 1 } END { exit !found }'
}
for _ in $(seq 1 600); do
  second_checkpoint && break
  kill -0 "$job" 2>/dev/null || { cat "$work/log"; echo "FAIL: the job ended early"; exit 1; }
  sleep 0.2
done
second_checkpoint || { echo "FAIL: no second checkpoint after 120 s"; exit 1; }
victim=$(rank_pid "$job" 3) || { echo "FAIL: rank 3 not found"; exit 1; }
start=$(date +%s.%N)
if [ "$mode" = kill ]; then
  kill -9 "$victim"
  what="killed (kill -9)"
else
  kill -STOP "$victim"
  what="stopped (SIGSTOP)"
fi
wait_for_exit "$job" 90 || { echo "FAIL: the job still runs 90 s after rank 3 was $what"; exit 1; }
job=""
seconds=$(seconds_since "$start")
echo "rank 3 $what: the job ended ${seconds} s later with exit code $rc"
grep -E 'flexdemo: error|exited on signal|has not completed' "$work/log" | head -3 || true
fail=0
[ "$rc" -ne 0 ] || { echo "FAIL: exit code 0"; fail=1; }
awk -v s="$seconds" 'BEGIN { exit !(s < 60) }' || { echo "FAIL: more than 60 s"; fail=1; }
if [ "$mode" = stop ]; then
  grep -q 'has not completed in 10 s' "$work/log" || { echo "FAIL: no timeout message"; fail=1; }
fi

# The newest checkpoint is valid (--resume takes it without skipping a damaged one), and
# training continues to 10 steps past it.
newest=$(newest_checkpoint "$work/run")
end=$((newest + 10))
job_command --steps "$end" --resume "$work/run"
"${cmd[@]}" > "$work/resume.log" 2>&1 || {
  cat "$work/resume.log"; echo "FAIL: --resume failed"; exit 1; }
if grep -q 'skipping damaged' "$work/resume.log"; then echo "FAIL: newest checkpoint damaged"; fail=1; fi
steps=$(grep -o '"step":[0-9]*' "$work/run/metrics.jsonl" | cut -d: -f2)
[ "$steps" = "$(seq 1 "$end")" ] || { echo "FAIL: metrics.jsonl does not hold steps 1..$end once each"; fail=1; }
echo "resumed from step $newest to step $end"
exit "$fail"
