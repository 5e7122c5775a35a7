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
