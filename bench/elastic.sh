#!/usr/bin/env bash
# Preemption and elastic resume on the demo's job: gpt-micro, FlexDeMo, 500 steps, 2 nodes x 2
# ranks (the options of bench/tune.sh's flexdemo-lr1e-3 run, the uninterrupted reference).
#   leg 1, 2 x 2: a real SIGTERM to rank 2 once step STOP1 (default 150) is logged; the seconds
#          from the signal to the end of mpirun are measured, the checkpoint is the resume point;
#   leg 2, 1 node x 2 ranks (one replica): resumed, stopped after step STOP2 (default 300) by
#          FLEXDEMO_INJECT_SIGNAL;
#   leg 3, 2 x 2 again: resumed to step 500.
# Writes runs/studies/elastic/ (the run, each leg's log, losses.csv: step, uninterrupted and
# elastic training loss, validation losses; table.md). The reference is trained first if
# runs/studies/tune/gpt-micro-500/flexdemo-lr1e-3 is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
stop1="${STOP1:-150}"
stop2="${STOP2:-300}"
out=runs/studies/elastic
reference=runs/studies/tune/gpt-micro-500/flexdemo-lr1e-3
source tests/lib.sh  # rank_pid, steps_logged, seconds_since, newest_checkpoint
bash scripts/install-deps.sh >/dev/null
bash scripts/build.sh flexdemo_cli flexdemo_tokenize >/dev/null
export OMP_NUM_THREADS=1 FLEXDEMO_INJECT_SIGNAL=
root_flag=""
if [ "$(id -u)" -eq 0 ]; then root_flag="--allow-run-as-root"; fi
train_command() {  # NP RANKS_PER_NODE OUT [options...]: sets cmd
  local np=$1 rpn=$2 run=$3
  shift 3
  cmd=(mpirun $root_flag --oversubscribe -np "$np" -x FLEXDEMO_INJECT_SIGNAL build/flexdemo train
    --model gpt-micro --ranks-per-node "$rpn" --steps 500 --eval-every 50 --log-every 100
    --progress lines --optimizer flexdemo --lr 1e-3 --out "$run" "$@")
}
if [ ! -f "$reference/summary.json" ]; then
  ONLY='^flexdemo-lr1e-3$' bash bench/tune.sh
fi
rm -rf "$out"
mkdir -p "$out"
run="$out/run"

# Leg 1: preempted by a SIGTERM to one rank.
train_command 4 2 "$run"
"${cmd[@]}" > "$out/leg1.log" 2>&1 &
job=$!  # mpirun
until [ "$(steps_logged "$run")" -ge "$stop1" ]; do
  kill -0 "$job" 2>/dev/null || { tail "$out/leg1.log"; echo "elastic: leg 1 ended early"; exit 1; }
  sleep 0.2
done
rank2=$(rank_pid "$job" 2)
signalled=$(date +%s.%N)
kill -TERM "$rank2"
rc=0
wait "$job" || rc=$?
seconds=$(seconds_since "$signalled")
checkpoint=$(newest_checkpoint "$run")
echo "leg 1: SIGTERM to rank 2, exit code $rc ${seconds} s later, checkpoint at step $checkpoint" |
  tee "$out/preemption.txt"

# Leg 2: one node, one replica; leg 3: two nodes again.
rc=0
train_command 2 2 "$run" --resume "$run"
FLEXDEMO_INJECT_SIGNAL="$stop2:0" "${cmd[@]}" > "$out/leg2.log" 2>&1 || rc=$?
[ $rc -eq 75 ] || { tail "$out/leg2.log"; echo "elastic: leg 2 ended with $rc"; exit 1; }
train_command 4 2 "$run" --resume "$run"
"${cmd[@]}" > "$out/leg3.log" 2>&1
grep -h "^resuming" "$out"/leg*.log

python3 - "$reference" "$run" "$out" "$checkpoint" "$stop2" "$seconds" <<'EOF'
import json, sys
reference, run, out, stop1, stop2, seconds = sys.argv[1:]
def read(path):
    rows = {}
    for line in open(path + "/metrics.jsonl"):
        m = json.loads(line)
        rows[m["step"]] = m
    return rows
a, b = read(reference), read(run)
with open(out + "/losses.csv", "w") as f:
    f.write("step,uninterrupted_loss,elastic_loss,uninterrupted_val,elastic_val\n")
    for step in sorted(a):
        f.write("%d,%.6f,%.6f,%s,%s\n" % (step, a[step]["loss"], b[step]["loss"],
                                          a[step].get("val_loss", ""), b[step].get("val_loss", "")))
same = all(a[s]["loss"] == b[s]["loss"] for s in a if s <= int(stop1))
with open(out + "/table.md", "w") as f:
    f.write("gpt-micro, FlexDeMo, 500 steps: 2 nodes x 2 ranks to step %s (SIGTERM to rank 2; "
            "the job ended %s s later), 1 node x 2 ranks to step %s, 2 x 2 to 500; next to the "
            "same run uninterrupted on 2 x 2. Steps 1-%s equal the uninterrupted run's bit for bit: "
            "%s.\n\n" % (stop1, seconds, stop2, stop1, "yes" if same else "NO"))
    f.write("| step | topology | training loss, uninterrupted | elastic | validation loss, uninterrupted | elastic |\n")
    f.write("|---:|---|---:|---:|---:|---:|\n")
    for step in sorted(a):
        if step % 50 and step not in (int(stop1) + 1, int(stop2) + 1):
            continue
        topology = "2 x 2" if step <= int(stop1) or step > int(stop2) else "1 x 2"
        va, vb = a[step].get("val_loss"), b[step].get("val_loss")
        f.write("| %d | %s | %.4f | %.4f | %s | %s |\n" % (step, topology, a[step]["loss"],
                b[step]["loss"], "%.4f" % va if va else "", "%.4f" % vb if vb else ""))
print(open(out + "/table.md").read())
EOF
rm -rf "$run/checkpoints"  # 50 MB each; the metrics and logs are what is kept
