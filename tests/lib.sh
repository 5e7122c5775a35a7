# shellcheck shell=bash
# Shell helpers of the ctest scripts that run whole jobs (sourced, not run).

# Exits 77 (ctest: skipped), the reason printed, where network namespaces cannot be made.
require_netns() {
  if [ "$(id -u)" -ne 0 ] || ! ip netns add fdc-probe 2>/dev/null; then
    echo "SKIPPED: cannot create network namespaces here (needs root and iproute2)"
    exit 77
  fi
  ip netns del fdc-probe
}

# RUN: the steps in RUN/metrics.jsonl so far (0 before it exists).
steps_logged() {
  if [ -f "$1/metrics.jsonl" ]; then grep -c '"step"' "$1/metrics.jsonl" || true; else echo 0; fi
}

# PID SECONDS: waits at most SECONDS for PID, a background job of this shell, to end; sets rc
# to its exit code, or returns 1 while it still runs.
wait_for_exit() {
  local pid=$1 seconds=$2
  for _ in $(seq 1 $((seconds * 10))); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  if kill -0 "$pid" 2>/dev/null; then return 1; fi
  # shellcheck disable=SC2034  # for the caller
  rc=0
  wait "$pid" || rc=$?
}

# MPIRUN_PID RANK: the process of that world rank among mpirun's children (on this machine).
rank_pid() {
  local pid
  for pid in $(pgrep -P "$1"); do
    if tr '\0' '\n' < "/proc/$pid/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=$2"; then
      echo "$pid"
      return
    fi
  done
  echo "rank $2 of mpirun $1 not found" >&2
  return 1
}

# T0 (from date +%s.%N): the seconds since, with two decimals.
seconds_since() {
  awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.2f", b - a }'
}

# RUN: the step of its newest checkpoint folder (nothing when there is none).
newest_checkpoint() {
  ls "$1/checkpoints" 2>/dev/null | grep -E '^step-[0-9]+$' | sed 's/step-//' | sort -n | tail -1
}

# DIR FORMAT: a corpus of 300 short documents in DIR/text, document d being printf FORMAT d.
tiny_corpus() {
  mkdir -p "$1"
  # shellcheck disable=SC2059  # the format is the argument
  for d in $(seq 1 300); do printf "$2\n%%\n" "$d"; done > "$1/text"
}

# WORK STEPS STOP: with the caller's `train OUT [options...]` (passing FLEXDEMO_INJECT_SIGNAL on
# to the ranks) and WORK/whole trained STEPS steps uninterrupted: a run stopped by a preemption
# signal after step STOP and resumed must log steps 1..STEPS once each and equal WORK/whole, every
# loss and the final weights bit for bit.
expect_exact_resume() {
  local work=$1 steps=$2 stop=$3 rc=0
  FLEXDEMO_INJECT_SIGNAL=$stop:0 train "$work/run" || rc=$?
  [ $rc -eq 75 ] || { echo "FAIL: the stopped leg ended with $rc, expected 75"; exit 1; }
  [ -d "$work/run/checkpoints/step-$stop" ] || { echo "FAIL: no checkpoint at step $stop"; exit 1; }
  train "$work/run" --resume "$work/run" || { echo "FAIL: --resume failed"; exit 1; }
  # (uniq: a --link-budget choice logs the step it applies to inside the step's own line)
  [ "$(grep -o '"step":[0-9]*' "$work/run/metrics.jsonl" | cut -d: -f2 | uniq)" = "$(seq 1 "$steps")" ] ||
    { echo "FAIL: metrics.jsonl does not hold steps 1..$steps once each"; exit 1; }
  diff <(grep -o '"loss":[^,]*' "$work/whole/metrics.jsonl") \
    <(grep -o '"loss":[^,]*' "$work/run/metrics.jsonl") ||
    { echo "FAIL: the losses differ from the uninterrupted run's"; exit 1; }
  cmp "$work/whole/checkpoints/step-$steps/model.safetensors" \
    "$work/run/checkpoints/step-$steps/model.safetensors" ||
    { echo "FAIL: the final weights differ from the uninterrupted run's"; exit 1; }
}
