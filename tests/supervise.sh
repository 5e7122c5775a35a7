#!/usr/bin/env bash
# ctest: `flexdemo supervise` restarts a 2 nodes x 2 ranks job (tiny GPT, FlexDeMo, --resume auto)
# after a preempted rank (SIGTERM, exit code 75) and a rank killed with kill -9, each from the
# newest checkpoint: the job finishes, every step logged once, the losses those of the run
# uninterrupted, summary.json counting 2 restarts. Faults a restart cannot fix end it at once
# with one line and exit code 2: a bad option, and a run whose only checkpoint is damaged.
#   tests/supervise.sh BUILD_DIR
set -euo pipefail
build=$1
source "$(dirname "$0")/lib.sh"
work=$(mktemp -d)
sup=""
trap 'rc=$?; [ -z "$sup" ] || kill -9 "$sup" 2>/dev/null || true
      [ $rc -eq 0 ] || { echo "--- log:"; grep -v "^step" "$work/log" 2>/dev/null | tail -30; }
      rm -rf "$work"' EXIT
tiny_corpus "$work/corpus" 'document %d: text for the supervise test.'
steps=120
job=(mpirun --allow-run-as-root --oversubscribe -np 4 -x OMP_NUM_THREADS=1
  -x FLEXDEMO_TOKENIZE="$build/flexdemo-tokenize" -x FLEXDEMO_INJECT_SIGNAL
  "$build/flexdemo" train --model gpt-nano --width 32 --layers 2 --heads 2 --context 32 --seq 32
  --batch 8 --chunk 8 --tokenizer bytes --data "$work/corpus" --ranks-per-node 2 --steps "$steps"
  --checkpoint-every 20 --comm-timeout 30 --eval-seqs 4 --progress lines --log-every 1000)
fail() { echo "FAIL: $*"; exit 1; }

FLEXDEMO_INJECT_SIGNAL="" "${job[@]}" --out "$work/whole" >/dev/null 2>&1 || fail "the whole run"

# rank 1 is preempted after step 30; later a rank is killed once 70 steps are logged
FLEXDEMO_INJECT_SIGNAL=30:1 "$build/flexdemo" supervise --backoff 0 --max-restarts 3 -- \
  "${job[@]}" --out "$work/run" --resume auto >"$work/log" 2>&1 &
sup=$!
for _ in $(seq 1 1200); do
  [ "$(steps_logged "$work/run")" -ge 70 ] && grep -q "restart 1 of 3" "$work/log" && break
  sleep 0.1
done
grep -q "restart 1 of 3" "$work/log" || fail "no restart after the preemption"
mpirun_pid=$(pgrep -P "$sup" mpirun) || fail "no mpirun under the supervisor"
kill -9 "$(rank_pid "$mpirun_pid" 2)"
wait_for_exit "$sup" 240 || fail "the supervised job did not end in 240 s"
sup=""
[ "$rc" -eq 0 ] || fail "supervise ended with $rc"
grep -q "exit code 75 .*restart 1 of 3" "$work/log" || fail "no line for the preemption's restart"
grep -q "restart 2 of 3" "$work/log" || fail "no line for the killed rank's restart"
grep -q "the job finished after 2 restarts" "$work/log" || fail "no final line"
[ "$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['restarts'])" \
  "$work/run/summary.json")" -eq 2 ] || fail "summary.json does not count 2 restarts"
[ "$(grep -o '"step":[0-9]*' "$work/run/metrics.jsonl" | cut -d: -f2)" = "$(seq 1 $steps)" ] ||
  fail "metrics.jsonl does not hold steps 1..$steps once each"
diff <(grep -o '"loss":[^,]*' "$work/whole/metrics.jsonl") \
  <(grep -o '"loss":[^,]*' "$work/run/metrics.jsonl") || fail "the losses differ from the whole run's"

# Not restarted: a bad option; a damaged only checkpoint; a command that would start over.
expect_refused() {  # WHY PATTERN COMMAND...
  local why=$1 pattern=$2 rc=0
  shift 2
  "$build/flexdemo" supervise --backoff 0 -- "$@" >"$work/refused" 2>&1 || rc=$?
  [ $rc -eq 2 ] || { cat "$work/refused"; fail "$why: exit code $rc, expected 2"; }
  grep -q -- "$pattern" "$work/refused" || { cat "$work/refused"; fail "$why: no line '$pattern'"; }
  ! grep -q "restart 1" "$work/refused" || fail "$why: restarted"
}
expect_refused "a bad option" "not restarted" "${job[@]}" --out "$work/bad" --topk 0 --resume auto
rm -rf "$work/run/checkpoints"/step-{20,40,60,80,100}
printf 'damaged' >"$work/run/checkpoints/step-$steps/model.safetensors"
expect_refused "a damaged only checkpoint" "no valid checkpoint" "${job[@]}" --out "$work/run" --resume auto
expect_refused "no --resume auto" "--resume auto" "${job[@]}" --out "$work/run"

# Asked to stop: SIGUSR1 to the supervisor reaches every rank through mpirun; exit 75, no restart.
FLEXDEMO_INJECT_SIGNAL="" "$build/flexdemo" supervise --backoff 0 -- "${job[@]}" \
  --out "$work/stopped" --resume auto >"$work/log" 2>&1 &
sup=$!
for _ in $(seq 1 600); do [ "$(steps_logged "$work/stopped")" -ge 10 ] && break; sleep 0.1; done
kill -USR1 "$sup"
wait_for_exit "$sup" 120 || fail "the supervisor did not stop in 120 s"
sup=""
[ "$rc" -eq 75 ] || fail "stopped: exit code $rc, expected 75"
grep -q "stopped by signal 10 (the job ended with exit code 75): not restarted" "$work/log" ||
  fail "no line for the stop"
! grep -q "restart 1" "$work/log" || fail "restarted after a stop signal"
echo "supervise: 2 faults restarted, the run equals the uninterrupted one; unfixable faults not restarted"
