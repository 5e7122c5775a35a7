#!/usr/bin/env bash
# ctest: preemption of a 2 nodes x 2 ranks job (tiny GPT, FlexDeMo) in the middle of its run.
#   tests/preemption.sh BUILD_DIR rank     SIGTERM to one rank: every rank stops at the next step
#                                          boundary, one line, exit code 75, a checkpoint; --resume
#                                          then gives the same losses and weights, bit for bit, as
#                                          an uninterrupted run
#   tests/preemption.sh BUILD_DIR mpirun   SIGUSR1 to mpirun (forwarded to every rank): the same
#                                          stop; SIGTERM to mpirun, which passes SIGTERM on to the
#                                          ranks after odls_base_sigkill_timeout and kills them as
#                                          long after that: the same stop and checkpoint
#   tests/preemption.sh BUILD_DIR twice    SIGTERM, then SIGINT to one rank: it ends at once (exit
#                                          code 128 + the signal handled second, one line naming
#                                          it), no checkpoint is written
# Prints the seconds from the signal to the job's exit.
set -euo pipefail
build=$1
mode=$2
source "$(dirname "$0")/lib.sh"
work=$(mktemp -d)
job=""
trap 'rc=$?; [ -z "$job" ] || kill -9 "$job" 2>/dev/null || true
      [ $rc -eq 0 ] || { echo "--- job log:"; grep -v "^step" "$work/log" 2>/dev/null | tail -30; }
      rm -rf "$work"' EXIT
tiny_corpus "$work/corpus" 'document %d: text for the preemption test.'
steps=300
job_command() {  # RUN [mpirun option NAME VALUE] [train options...]: sets cmd
  local out=$1
  shift
  local mpi=()
  if [ "${1:-}" = --mca ]; then mpi=("$1" "$2" "$3"); shift 3; fi
  cmd=(mpirun --allow-run-as-root --oversubscribe -np 4 "${mpi[@]}" -x OMP_NUM_THREADS=1
    -x FLEXDEMO_TOKENIZE="$build/flexdemo-tokenize" "$build/flexdemo" train --model gpt-nano
    --width 32 --layers 2 --heads 2 --context 32 --seq 32 --batch 8 --chunk 8 --tokenizer bytes
    --data "$work/corpus" --ranks-per-node 2 --steps "$steps" --checkpoint-every 1000
    --comm-timeout 30 --eval-seqs 4 --eval-every 50 --progress lines --log-every 1000
    "$@" --out "$out")
}
# RUN SIGNALLER [mpirun option]: starts the job, calls SIGNALLER at step 40 and waits for the
# job's end; sets rc and seconds (from the signal to the end).
signal_and_wait() {
  local run=$1 signaller=$2
  shift 2
  job_command "$run" "$@"
  "${cmd[@]}" > "$work/log" 2>&1 &
  job=$!
  for _ in $(seq 1 1200); do
    [ "$(steps_logged "$run")" -ge 40 ] && break
    kill -0 "$job" 2>/dev/null || { echo "FAIL: the job ended before step 40"; exit 1; }
    sleep 0.1
  done
  start=$(date +%s.%N)
  "$signaller"
  wait_for_exit "$job" 60 || { echo "FAIL: the job still runs 60 s after the signal"; exit 1; }
  job=""
  seconds=$(seconds_since "$start")
}
# RUN NAME: exit code 75, rank 0's line, the checkpoint at the last step logged.
expect_stopped() {
  local run=$1 name=$2 at
  [ "$rc" -eq 75 ] || { echo "FAIL: exit code $rc, expected 75"; exit 1; }
  grep -qE "^flexdemo: stopped by $name \(caught on [0-9] ranks?\) after step [0-9]+ of $steps: checkpoint .+ written; continue with --resume $run\$" \
    "$work/log" || { echo "FAIL: no 'stopped by $name' line"; exit 1; }
  at=$(newest_checkpoint "$run")
  [ "$at" = "$(steps_logged "$run")" ] ||
    { echo "FAIL: checkpoint at step $at, but $(steps_logged "$run") steps were logged"; exit 1; }
  [ "$at" -lt "$steps" ] || { echo "FAIL: the run was not stopped early"; exit 1; }
  echo "$name: stopped after step $at, ${seconds} s from the signal to the job's end (code $rc)"
}
# RUN: --resume to the last step, from the newest checkpoint, each step logged once.
resume_to_end() {
  job_command "$1" --resume "$1"
  "${cmd[@]}" > "$work/resume.log" 2>&1 ||
    { cat "$work/resume.log"; echo "FAIL: --resume failed"; exit 1; }
  if grep -q 'skipping damaged' "$work/resume.log"; then echo "FAIL: damaged checkpoint"; exit 1; fi
  [ "$(grep -o '"step":[0-9]*' "$1/metrics.jsonl" | cut -d: -f2)" = "$(seq 1 $steps)" ] ||
    { echo "FAIL: metrics.jsonl does not hold steps 1..$steps once each"; exit 1; }
}
term_rank2() { kill -TERM "$(rank_pid "$job" 2)"; }
# Two of the same signal pending at once are delivered once: the second is another one.
term_int_rank2() { local pid; pid=$(rank_pid "$job" 2); kill -TERM "$pid"; kill -INT "$pid"; }
usr1_mpirun() { kill -USR1 "$job"; }
term_mpirun() { kill -TERM "$job"; }

case "$mode" in
  rank)
    signal_and_wait "$work/run" term_rank2
    expect_stopped "$work/run" SIGTERM
    resume_to_end "$work/run"
    job_command "$work/reference"
    "${cmd[@]}" > "$work/reference.log" 2>&1 || { echo "FAIL: the uninterrupted run failed"; exit 1; }
    losses() { grep -o '"loss":[^,]*' "$1/metrics.jsonl"; }
    diff <(losses "$work/reference") <(losses "$work/run") > /dev/null ||
      { echo "FAIL: the losses differ from the uninterrupted run's"; exit 1; }
    cmp "$work/reference/checkpoints/step-$steps/model.safetensors" \
      "$work/run/checkpoints/step-$steps/model.safetensors" ||
      { echo "FAIL: the final weights differ from the uninterrupted run's"; exit 1; }
    echo "resumed to step $steps: every loss and the final weights equal the uninterrupted run's"
    ;;
  mpirun)
    signal_and_wait "$work/usr1" usr1_mpirun
    expect_stopped "$work/usr1" SIGUSR1
    resume_to_end "$work/usr1"
    # mpirun ends the ranks itself on SIGTERM: SIGCONT, after odls_base_sigkill_timeout SIGTERM,
    # after as long again SIGKILL. 5 s: the ranks stop and write their checkpoint in that time.
    steps=3000
    signal_and_wait "$work/term" term_mpirun --mca odls_base_sigkill_timeout 5
    [ "$rc" -ne 0 ] || { echo "FAIL: exit code 0 after SIGTERM to mpirun"; exit 1; }
    grep -qE "^flexdemo: stopped by SIGTERM \(caught on 4 ranks\)" "$work/log" ||
      { echo "FAIL: no 'stopped by SIGTERM' line"; exit 1; }
    at=$(newest_checkpoint "$work/term")
    [ "$at" = "$(steps_logged "$work/term")" ] && [ "$at" -lt "$steps" ] ||
      { echo "FAIL: the checkpoint (step $at) is not at the last step logged"; exit 1; }
    echo "SIGTERM to mpirun: checkpoint at step $at; mpirun ended ${seconds} s after the signal"
    steps=$((at + 10))
    resume_to_end "$work/term"
    ;;
  twice)
    signal_and_wait "$work/run" term_int_rank2
    # Both signals may be pending at once, and the kernel then delivers SIGINT (2) before SIGTERM
    # (15): the line names the one handled second, and the exit code is 128 + its number.
    line="^flexdemo: a second stop signal \((SIGTERM|SIGINT)\): stopping at once, without a checkp"
    second=$(grep -oE "$line" "$work/log" | grep -oE "SIGTERM|SIGINT") ||
      { echo "FAIL: no 'second stop signal (SIGTERM|SIGINT)' line"; exit 1; }
    expected=$((128 + $(kill -l "$second")))
    [ "$rc" -eq "$expected" ] ||
      { echo "FAIL: exit code $rc, expected $expected (128 + $second)"; exit 1; }
    [ -z "$(newest_checkpoint "$work/run")" ] || { echo "FAIL: a checkpoint was written"; exit 1; }
    echo "SIGTERM, then SIGINT: the job ended ${seconds} s after the signals (code $rc, $second" \
      "handled second), no checkpoint"
    ;;
  *)
    echo "usage: tests/preemption.sh BUILD_DIR rank|mpirun|twice"
    exit 2
    ;;
esac
