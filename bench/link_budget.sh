#!/usr/bin/env bash
# --link-budget auto on the emulated cluster (scripts/cluster.sh; needs root): gpt-micro, 2 nodes
# x 2 ranks, --overlap-step. Measures what it chose at each link rate, its step time against the
# unlimited link's, and its validation loss against fixed settings.
#
#   1. loss: --link-budget auto trains 500 steps on the emulated cluster at each rate of RATES
#      (its choices depend on the link); each fixed setting of FIXED (TOPK-VALUES, with
#      --overlap-step) trains 500 steps with mpirun on this machine (a fixed run's losses do not
#      depend on the link). Runs already kept are not trained again.
#   2. time: this machine's step times drift by 20% between minutes, so step times are compared
#      in pairs run back to back: ROUNDS (3) times, for each rate, auto on the unlimited link
#      then auto at the rate, TIME_STEPS (30) steps each after its first choice (before step 4).
#      Per rate: the median of the pairs' ratios (rate / unlimited) and the mean step times.
#      FIRST_ROUND (1) > 1 adds rounds to those kept.
#   3. table: per rate the settings auto chose (from metrics.jsonl of the 500-step run), the
#      rate it measured, its step time ratio, its validation loss, and the fixed settings'.
#   PHASES (default "loss time table"), RATES (default "1gbit 100mbit 10mbit"), FIXED (default
#   "32-bf16 128-bf16 128-2bit"), AUTO (extra options of the auto runs, e.g. "--link-max-topk 512"; its
#   runs then go to auto-OPTIONS/). Results in runs/studies/link-budget/.
set -euo pipefail
cd "$(dirname "$0")/.."
phases="${PHASES:-loss time table}"
rates="${RATES-1gbit 100mbit 10mbit}"
fixed="${FIXED:-32-bf16 128-bf16 128-2bit}"
rounds="${ROUNDS:-3}"
first_round="${FIRST_ROUND:-1}"
time_steps="${TIME_STEPS:-30}"
out=runs/studies/link-budget
read -r -a auto_options <<< "${AUTO:-}"
auto_dir=auto
[ ${#auto_options[@]} -eq 0 ] || auto_dir="auto$(printf '%s' "${auto_options[*]}" | tr -c 'a-z0-9' '-')"
mkdir -p "$out"
export FLEXDEMO_TOKENIZE="$PWD/build/flexdemo-tokenize"
common=(--model gpt-micro --optimizer flexdemo --lr 1e-3 --overlap-step --progress lines)
cluster=scripts/cluster.sh
trap 'bash "$cluster" down >/dev/null 2>&1 || true' EXIT

# RATE STEPS DIR OPTIONS...: a run on the emulated cluster at RATE (the cluster must be up).
train_at() {
  local steps=$1 dir=$2
  shift 2
  rm -rf "$dir"
  bash "$cluster" run -- "$PWD/build/flexdemo" train "${common[@]}" --steps "$steps" \
    --log-every 100 "$@" --out "$PWD/$dir"
}

if [[ " $phases " == *" loss "* ]]; then
  for setting in $fixed; do
    d="$out/fixed/$setting"
    [ -f "$d/summary.json" ] && { echo "== fixed $setting (kept) =="; continue; }
    echo "== fixed $setting =="
    rm -rf "$d"
    mpirun --allow-run-as-root --oversubscribe -np 4 build/flexdemo train "${common[@]}" \
      --ranks-per-node 2 --steps 500 --eval-every 50 --log-every 100 \
      --topk "${setting%-*}" --values "${setting#*-}" --out "$d"
  done
  for rate in $rates; do
    d="$out/$auto_dir/$rate"
    [ -f "$d/summary.json" ] && { echo "== auto at $rate (kept) =="; continue; }
    echo "== auto at $rate =="
    bash "$cluster" up 2 2 "$rate"
    train_at 500 "$d" --eval-every 50 --link-budget auto "${auto_options[@]}"
    bash "$cluster" down
  done
fi

if [[ " $phases " == *" time "* ]]; then
  for round in $(seq "$first_round" "$rounds"); do
    for rate in $rates; do
      for link in none "$rate"; do
        echo "== time, round $round: $rate pair, link $link =="
        bash "$cluster" up 2 2 "$link" > /dev/null
        train_at $((time_steps + 4)) "$out/time-$auto_dir/$round-$rate-$link" --eval-every 0 \
          --link-budget auto "${auto_options[@]}" > /dev/null
        bash "$cluster" down
      done
    done
  done
fi

if [[ " $phases " == *" table "* ]]; then
  python3 - "$out" "$rates" "$fixed" "$rounds" "$auto_dir" <<'PY'
import json, os, statistics, sys
out, rates, fixed, rounds, auto_dir = sys.argv[1], sys.argv[2].split(), sys.argv[3].split(), int(sys.argv[4]), sys.argv[5]

def lines(run):
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [json.loads(l) for l in f if l.strip()]

def mean_step_s(run):
    # The mean wall time of the steps after the first choice (before step 4), on rank 0's clock
    # (elapsed_s), not step_ms: a step ends with its sends still queued in the socket buffers on
    # a slow link, and they delay the next collective, which step_ms does not count.
    steps = {l["step"]: l["elapsed_s"] for l in lines(run)}
    last = max(steps)
    return (steps[last] - steps[4]) / (last - 4)

def final_loss(run):
    return json.load(open(os.path.join(run, "summary.json")))["final_val_loss"]

def choices(run):  # each change: "top-k values every N from step S"
    found, last = [], None
    for l in lines(run):
        c = l.get("link_budget")
        if c and (c["topk"], c["values"], c["every"]) != last:
            last = (c["topk"], c["values"], c["every"])
            found.append("%d %s every %d from step %d" % (last + (c["step"],)))
    return "; ".join(found)

def measured(run):  # Mbit/s a rank at each choice
    return ", ".join("%.1f" % l["link_budget"]["rank_mbit_s"] for l in lines(run) if "link_budget" in l)

rows = ["| rate | auto chose | measured Mbit/s a rank (each choice) | s/step: unlimited, at the rate (pairs) | ratio (median of %d pairs) | val loss after 500 |" % rounds,
        "|---|---|---|---|---|---|"]
csv = ["rate,run,final_val_loss,s_per_step_unlimited,s_per_step_at_rate,ratio_median"]
for rate in rates:
    auto = os.path.join(out, auto_dir, rate)
    pairs = [(mean_step_s(os.path.join(out, "time-" + auto_dir, "%d-%s-none" % (r, rate))),
              mean_step_s(os.path.join(out, "time-" + auto_dir, "%d-%s-%s" % (r, rate, rate))))
             for r in range(1, rounds + 1)
             if os.path.exists(os.path.join(out, "time-" + auto_dir, "%d-%s-%s" % (r, rate, rate), "metrics.jsonl"))]
    if not pairs:
        continue
    # The choices and losses of the 500-step run where one was trained, else the timing runs'.
    trained = os.path.exists(os.path.join(auto, "summary.json"))
    chosen = auto if trained else os.path.join(out, "time-" + auto_dir, "1-%s-%s" % (rate, rate))
    loss = "%.4f" % final_loss(auto) if trained else "not trained"
    ratio = statistics.median(b / a for a, b in pairs)
    times = "; ".join("%.2f, %.2f" % p for p in pairs)
    rows.append("| %s | %s | %s | %s | %.2fx | %s |" % (rate, choices(chosen), measured(chosen), times, ratio, loss))
    csv.append("%s,auto,%s,%.4f,%.4f,%.3f" % (rate, loss if trained else "", statistics.mean(a for a, _ in pairs),
                                             statistics.mean(b for _, b in pairs), ratio))
for setting in fixed:
    d = os.path.join(out, "fixed", setting)
    if os.path.exists(os.path.join(d, "summary.json")):
        rows.append("| any | fixed: top-k %s, %s | | | | %.4f |" % (setting.split("-")[0], setting.split("-")[1], final_loss(d)))
        csv.append("any,fixed-%s,%.4f,,," % (setting, final_loss(d)))
open(os.path.join(out, auto_dir + ".csv"), "w").write("\n".join(csv) + "\n")
open(os.path.join(out, auto_dir + ".md"), "w").write("\n".join(rows) + "\n")
print("\n".join(rows))
PY
fi
