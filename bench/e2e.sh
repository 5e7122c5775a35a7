#!/usr/bin/env bash
# The end-to-end benchmark on an emulated cluster (scripts/cluster.sh; needs root): 2 nodes x 2
# ranks train gpt-micro with the same data, seed and steps using FlexDeMo (sign-SGD), FlexDeMo
# (AdamW inner), DeMo without sharding (S = 1) and AdamW-HSDP, at each link rate; flexdemo-3x is
# FlexDeMo trained 3x as many steps (its own schedule, the same data order), to measure the wall
# time FlexDeMo needs to reach AdamW-HSDP's final validation loss; flexdemo-overlap is FlexDeMo
# with --overlap-step (each exchange applied one step later, hidden behind that step);
# flexdemo-backward is FlexDeMo with --exchange-in-backward (each unit's exchange started in the
# backward) and flexdemo-noclip the same run without it (both need --clip 0 --on-nonfinite stop,
# so they compare with each other: the same losses, only the step time differs). Keeps every
# run in runs/studies/e2e/<rate>/<run>, writes runs/studies/e2e.csv and, per rate, a
# `flexdemo report` (validation loss against wall time, bytes between nodes per step), plus
# runs/studies/e2e-step-time.png (median step time against rate).
#   STEPS (default 200), RATES (default "none 1gbit 100mbit 10mbit"), RUNS (default all eight).
#   RATES="" trains nothing and only rebuilds the table and reports from the runs kept.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh >/dev/null
bash scripts/build.sh >/dev/null
steps="${STEPS:-200}"
rates="${RATES-none 1gbit 100mbit 10mbit}"
all_runs="flexdemo flexdemo-adamw demo-s1 adamw-hsdp flexdemo-3x flexdemo-overlap flexdemo-noclip
  flexdemo-backward"
runs="${RUNS:-$all_runs}"
out=runs/studies/e2e
cluster=scripts/cluster.sh
trap 'bash "$cluster" down >/dev/null 2>&1 || true' EXIT
mkdir -p "$out"
export FLEXDEMO_TOKENIZE="$PWD/build/flexdemo-tokenize"

options_of() {
  case "$1" in
    flexdemo) echo "--optimizer flexdemo" ;;
    flexdemo-adamw) echo "--optimizer flexdemo-adamw" ;;
    demo-s1) echo "--optimizer flexdemo --shard-size 1" ;;
    adamw-hsdp) echo "--optimizer adamw" ;;
    flexdemo-3x) echo "--optimizer flexdemo" ;;
    flexdemo-overlap) echo "--optimizer flexdemo --overlap-step" ;;
    flexdemo-noclip) echo "--optimizer flexdemo --clip 0 --on-nonfinite stop" ;;
    flexdemo-backward) echo "--optimizer flexdemo --clip 0 --on-nonfinite stop --exchange-in-backward" ;;
    *) echo "e2e.sh: unknown run '$1'" >&2; exit 1 ;;
  esac
}

steps_of() { if [ "$1" = flexdemo-3x ]; then echo $((3 * steps)); else echo "$steps"; fi; }

median() { sort -g | awk '{v[NR] = $1} END {print v[int((NR + 1) / 2)]}'; }
field() { grep -o "\"$2\": *[0-9.e+-]*" "$1" | head -1 | sed 's/.*: *//'; }

for rate in $rates; do
  bash "$cluster" up 2 2 "$rate"
  for run in $runs; do
    echo "== $rate: $run =="
    rm -rf "${out:?}/$rate/$run"  # a fresh run, never appended to an old one
    # shellcheck disable=SC2046
    bash "$cluster" run -- "$PWD/build/flexdemo" train --model gpt-micro --steps "$(steps_of "$run")" \
      --eval-every 25 --progress lines --log-every 50 $(options_of "$run") \
      --out "$PWD/$out/$rate/$run"
  done
  bash "$cluster" down
done

# The table and reports cover every run kept so far, so rates can be measured one at a time.
all_rates="none 1gbit 100mbit 10mbit"
csv=runs/studies/e2e.csv
echo "rate,run,final_val_loss,median_step_ms,wall_s,tokens_per_s,inter_bytes_per_step,s_to_adamw_hsdp_loss" > "$csv"
# Seconds until a run's validation loss first reaches AdamW-HSDP's final one at the same rate.
seconds_to() {
  awk -v target="$2" '
    match($0, /"elapsed_s":[0-9.e+-]+/) { t = substr($0, RSTART + 12, RLENGTH - 12) }
    match($0, /"val_loss":[0-9.e+-]+/) {
      v = substr($0, RSTART + 11, RLENGTH - 11)
      if (v + 0 <= target + 0) { print t; found = 1; exit }
    }
    END { if (!found) print "-" }' "$1"
}
for rate in $all_rates; do
  kept=""
  target=""
  [ -f "$out/$rate/adamw-hsdp/summary.json" ] &&
    target=$(field "$out/$rate/adamw-hsdp/summary.json" final_val_loss)
  for run in $all_runs; do
    d="$out/$rate/$run"
    [ -f "$d/summary.json" ] || continue
    step_ms=$(grep -o '"step_ms":[0-9.e+-]*' "$d/metrics.jsonl" | cut -d: -f2 | median)
    wall=$(tail -1 "$d/metrics.jsonl" | grep -o '"elapsed_s":[0-9.e+-]*' | cut -d: -f2)
    reach="-"
    [ -z "$target" ] || reach=$(seconds_to "$d/metrics.jsonl" "$target")
    echo "$rate,$run,$(field "$d/summary.json" final_val_loss),$step_ms,$wall,$(field "$d/summary.json" tokens_per_s),$(field "$d/summary.json" inter_bytes_per_step),$reach" >> "$csv"
    kept="$kept $d"
  done
  # shellcheck disable=SC2086
  [ -z "$kept" ] || build/flexdemo report $kept --out "runs/studies/e2e-report-$rate" > /dev/null
done
column -s, -t < "$csv"

# Median step time against link rate, one line per run.
gp=runs/studies/e2e-step-time.gp
{
  echo "set terminal pngcairo size 900,560 noenhanced"
  echo "set output 'runs/studies/e2e-step-time.png'"
  echo "set title 'Median step time against link rate (2 nodes x 2 ranks, gpt-micro)'"
  echo "set ylabel 'ms'; set logscale y; set grid; set key outside bottom center"
  echo "set datafile separator ','"
  printf "plot "
  first=1
  for run in $all_runs; do
    [ $first -eq 1 ] || printf ", "
    first=0
    printf "'< grep \",%s,\" %s' using 4:xtic(1) with linespoints title '%s'" "$run" "$csv" "$run"
  done
  echo
} > "$gp"
gnuplot "$gp"
echo "results: $csv, runs/studies/e2e-report-<rate>/, runs/studies/e2e-step-time.png"
