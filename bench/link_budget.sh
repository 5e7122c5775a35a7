#!/usr/bin/env bash
# --link-budget auto on the emulated cluster (scripts/cluster.sh; needs root): gpt-micro, 2 nodes
# x 2 ranks, --overlap-step, at each link rate. Measures what it chose, its step time against the
# same run on an unlimited link, and its validation loss against fixed settings.
#
#   1. auto: --link-budget auto at each rate of RATES (500 steps; on the unlimited link,
#      AUTO_NONE_STEPS = 100: only its step time is compared).
#   2. fixed: each fixed setting of FIXED (top-k and values, --overlap-step) trains 500 steps on
#      the unlimited link (its loss: a fixed run is bit-identical at every rate) and is timed for
#      TIME_STEPS (30) steps at each rate.
#   3. table: per rate the settings auto chose (from metrics.jsonl), its mean step time (steps
#      after the first 3, probes included) over the unlimited link's, its final validation
#      loss, and the best fixed setting at that rate: the lowest loss among the fixed runs whose
#      mean step time there is at most 1.1x the unlimited link's auto run.
#   PHASES (default "auto fixed table"), RATES (default "none 1gbit 100mbit 10mbit"),
#   FIXED (default "512-bf16 256-2bit 32-bf16"). Results in docs/results/link-budget/.
set -euo pipefail
cd "$(dirname "$0")/.."
phases="${PHASES:-auto fixed table}"
rates="${RATES-none 1gbit 100mbit 10mbit}"
fixed="${FIXED:-512-bf16 256-2bit 32-bf16}"
auto_none_steps="${AUTO_NONE_STEPS:-100}"
time_steps="${TIME_STEPS:-30}"
out=docs/results/link-budget
mkdir -p "$out"
export FLEXDEMO_TOKENIZE="$PWD/build/flexdemo-tokenize"
common=(--model gpt-micro --optimizer flexdemo --lr 1e-3 --overlap-step --progress lines)
cluster=scripts/cluster.sh
trap 'bash "$cluster" down >/dev/null 2>&1 || true' EXIT

# RATE STEPS DIR OPTIONS...: a run on the emulated cluster at RATE.
train_at() {
  local rate=$1 steps=$2 dir=$3
  shift 3
  bash "$cluster" up 2 2 "$rate"
  rm -rf "$dir"
  bash "$cluster" run -- "$PWD/build/flexdemo" train "${common[@]}" --steps "$steps" \
    --eval-every 50 --log-every 100 "$@" --out "$PWD/$dir"
  bash "$cluster" down
}
fixed_options() { echo "--topk ${1%-*} --values ${1#*-}"; }

if [[ " $phases " == *" auto "* ]]; then
  for rate in $rates; do
    steps=500
    [ "$rate" = none ] && steps=$auto_none_steps
    echo "== auto at $rate ($steps steps) =="
    train_at "$rate" "$steps" "$out/auto/$rate" --link-budget auto
  done
fi

if [[ " $phases " == *" fixed "* ]]; then
  for setting in $fixed; do
    for rate in $rates; do
      steps=$time_steps
      [ "$rate" = none ] && steps=500
      echo "== fixed $setting at $rate ($steps steps) =="
      # shellcheck disable=SC2046
      train_at "$rate" "$steps" "$out/fixed/$rate/$setting" $(fixed_options "$setting")
    done
  done
fi

if [[ " $phases " == *" table "* ]]; then
  python3 - "$out" "$rates" "$fixed" <<'PY'
import json, os, sys
out, rates, fixed = sys.argv[1], sys.argv[2].split(), sys.argv[3].split()

def lines(run):
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [json.loads(l) for l in f if l.strip()]

def mean_step_s(run):  # after the first 3 steps (the first choice comes before step 4)
    t = [l["step_ms"] for l in lines(run) if l["step"] > 3]
    return sum(t) / len(t) / 1e3

def final_loss(run):
    return json.load(open(os.path.join(run, "summary.json")))["final_val_loss"]

def choices(run):  # "top-k/values/every from step N" for each change
    out, last = [], None
    for l in lines(run):
        c = l.get("link_budget")
        if not c:
            continue
        now = (c["topk"], c["values"], c["every"])
        if now != last:
            out.append("%d %s every %d from step %d" % (now + (c["step"],)))
            last = now
    return "; ".join(out)

def probe(run):  # the measured rate of each choice, Mbit/s a rank
    return " ".join("%.1f" % l["link_budget"]["rank_mbit_s"] for l in lines(run) if "link_budget" in l)

unlimited = mean_step_s(os.path.join(out, "auto", "none"))
rows = ["| rate | auto chose | measured Mbit/s a rank | s/step | vs unlimited | val loss after 500 | best fixed at this rate (val loss, s/step) | fixed settings: s/step |",
        "|---|---|---|---|---|---|---|---|"]
csv = ["rate,run,final_val_loss,s_per_step,ratio_to_unlimited_auto"]
for rate in rates:
    auto = os.path.join(out, "auto", rate)
    if not os.path.exists(os.path.join(auto, "summary.json")):
        continue
    s = mean_step_s(auto)
    loss = final_loss(auto) if rate != "none" else float("nan")
    csv.append("%s,auto,%.4f,%.4f,%.3f" % (rate, loss, s, s / unlimited))
    best, timings = None, []
    for setting in fixed:
        timed = os.path.join(out, "fixed", rate, setting)
        trained = os.path.join(out, "fixed", "none", setting)
        if not (os.path.exists(os.path.join(timed, "metrics.jsonl")) and os.path.exists(os.path.join(trained, "summary.json"))):
            continue
        fs, fl = mean_step_s(timed), final_loss(trained)
        csv.append("%s,fixed-%s,%.4f,%.4f,%.3f" % (rate, setting, fl, fs, fs / unlimited))
        timings.append("%s %.2f" % (setting, fs))
        if fs <= 1.1 * unlimited and (best is None or fl < best[1]):
            best = (setting, fl, fs)
    best_text = "%s (%.4f, %.2f)" % best if best else "none within 1.1x"
    rows.append("| %s | %s | %s | %.3f | %.2fx | %s | %s | %s |" % (
        rate, choices(auto), probe(auto), s, s / unlimited,
        "-" if rate == "none" else "%.4f" % loss, best_text, ", ".join(timings)))
open(os.path.join(out, "link-budget.csv"), "w").write("\n".join(csv) + "\n")
open(os.path.join(out, "table.md"), "w").write("\n".join(rows) + "\n")
print("\n".join(rows))
PY
fi
