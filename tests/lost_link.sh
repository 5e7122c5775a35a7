#!/usr/bin/env bash
# ctest: a link between nodes goes down in the middle of a run, on the emulated cluster
# (scripts/cluster.sh: 2 nodes x 1 rank, FlexDeMo, --comm-timeout 10).
#   short: down for 2 s, shorter than --comm-timeout: the run goes on and ends normally (exit 0,
#          stopped by --max-time so that it cannot end before the link went down however fast
#          the steps are), every step once in metrics.jsonl.
#   long:  down and left down: every rank ends with the documented timeout message within
#          --comm-timeout + 10 s of the link going down; once the link is back, mpirun (whose
#          own teardown needs the other node's daemon) ends non-zero; the newest checkpoint is
#          valid: --resume takes it and trains on.
# Prints the seconds each took. Exits 77 (skipped, with the reason printed) only where network
# namespaces cannot be created.
set -euo pipefail
build=$1
src=$2
source "$(dirname "$0")/lib.sh"
require_netns
cluster="$src/scripts/cluster.sh"
work=$(mktemp -d)
job=""
trap 'rc=$?; [ -z "$job" ] || kill -9 "$job" 2>/dev/null || true
      [ $rc -eq 0 ] || { echo "--- job log:"; grep -v "^step" "$work/log" 2>/dev/null | tail -20; }
      bash "$cluster" down >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
tiny_corpus "$work/corpus" 'document %d: text for the lost-link test.'
export FLEXDEMO_TOKENIZE="$build/flexdemo-tokenize"
timeout_s=10

train() {  # OUT STEPS [options...]
  local out=$1 steps=$2
  shift 2
  bash "$cluster" run -- "$build/flexdemo" train --model gpt-nano --width 32 --layers 2 --heads 2 \
    --context 32 --seq 32 --batch 8 --chunk 8 --tokenizer bytes --data "$work/corpus" \
    --steps "$steps" --checkpoint-every 50 --comm-timeout "$timeout_s" --eval-seqs 4 \
    --progress lines --log-every 1000 --out "$out" "$@"
}
wait_for_step() {  # RUN N
  for _ in $(seq 1 1200); do
    [ "$(steps_logged "$1")" -ge "$2" ] && return 0
    kill -0 "$job" 2>/dev/null || { echo "FAIL: the job ended before step $2"; exit 1; }
    sleep 0.1
  done
  echo "FAIL: step $2 not reached in 120 s"
  exit 1
}
ranks_alive() {  # flexdemo processes left in the nodes' namespaces
  local n=0
  for ns in fdc-node1 fdc-node2; do
    for pid in $(ip netns pids "$ns" 2>/dev/null); do
      [[ "$(cat "/proc/$pid/comm" 2>/dev/null)" == flexdemo* ]] && n=$((n + 1))
    done
  done
  echo "$n"
}
fail=0

# ---- short: 2 s down, then up again
bash "$cluster" up 2 1 none > /dev/null
train "$work/short" 100000 --max-time 15 > "$work/log" 2>&1 &
job=$!
wait_for_step "$work/short" 100
bash "$cluster" link 2 down
sleep 2
bash "$cluster" link 2 up
kill -0 "$job" 2>/dev/null || { echo "FAIL: the run ended before the link came back"; exit 1; }
rc=0
wait "$job" || rc=$?
job=""
# The longest wait between two steps' ends (elapsed_s), not step_ms: the outage may hit the
# step's metrics all-reduce or the stop vote, which follow the timed part of the step.
longest=$(grep -o '"elapsed_s":[0-9.e+-]*' "$work/short/metrics.jsonl" | cut -d: -f2 |
  awk 'NR > 1 && 1e3 * ($1 - prev) > max { max = 1e3 * ($1 - prev) } { prev = $1 } END { print max }')
steps=$(steps_logged "$work/short")
echo "short (2 s down): exit code $rc after $steps steps, the longest between two steps ${longest} ms"
[ "$rc" -eq 0 ] || { echo "FAIL: the run did not go on"; fail=1; }
grep -q "^stopping after step $steps of 100000: --max-time 15 s reached" "$work/log" ||
  { echo "FAIL: the run did not end by --max-time"; fail=1; }
[ "$(grep -o '"step":[0-9]*' "$work/short/metrics.jsonl" | cut -d: -f2)" = "$(seq 1 "$steps")" ] ||
  { echo "FAIL: metrics.jsonl does not hold steps 1..$steps once each"; fail=1; }
awk -v ms="$longest" 'BEGIN { exit !(ms >= 1500) }' ||
  { echo "FAIL: no step waited for the link: was it down?"; fail=1; }

# ---- long: down and left down
train "$work/long" 100000 > "$work/log" 2>&1 &
job=$!
wait_for_step "$work/long" 120  # past the checkpoints at 50 and 100
down_at=$(date +%s.%N)
bash "$cluster" link 2 down
for _ in $(seq 1 600); do
  [ "$(ranks_alive)" -eq 0 ] && break
  sleep 0.1
done
ended=$(seconds_since "$down_at")
echo "long (left down): every rank ended ${ended} s after the link went down"
[ "$(ranks_alive)" -eq 0 ] || { echo "FAIL: ranks still run 60 s after the link went down"; fail=1; }
awk -v s="$ended" -v t="$timeout_s" 'BEGIN { exit !(s <= t + 10) }' ||
  { echo "FAIL: more than --comm-timeout + 10 s"; fail=1; }
grep -q "^flexdemo: error: .* has not completed in $timeout_s s: a rank has died or hangs, or the network is down$" \
  "$work/log" || { echo "FAIL: no timeout message"; fail=1; }
up_at=$(date +%s.%N)
bash "$cluster" link 2 up
wait_for_exit "$job" 120 || { echo "FAIL: mpirun still runs 120 s after the link came back"; exit 1; }
job=""
echo "mpirun ended $(seconds_since "$up_at") s after the link came back, exit code $rc"
[ "$rc" -ne 0 ] || { echo "FAIL: exit code 0"; fail=1; }
newest=$(newest_checkpoint "$work/long")
train "$work/long" $((newest + 10)) --resume "$work/long" > "$work/resume.log" 2>&1 ||
  { cat "$work/resume.log"; echo "FAIL: --resume failed"; exit 1; }
if grep -q 'skipping damaged' "$work/resume.log"; then echo "FAIL: newest checkpoint damaged"; fail=1; fi
echo "resumed from the newest checkpoint (step $newest) to step $((newest + 10))"
exit "$fail"
