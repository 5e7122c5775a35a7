#!/usr/bin/env bash
# Many local steps (--inner-steps, DiLoCo's outer loop) against FlexDeMo and AdamW-HSDP on slow
# links: gpt-micro, 2 nodes x 2 ranks, 500 steps, validation loss against wall time at 100 Mbit/s
# and 10 Mbit/s, and the time each run takes to reach AdamW-HSDP's 500-step validation loss.
# Runs named -x2 train twice the steps (1000, the cosine schedule stretched to them), runs named
# -s2 with another seed (--seed 2: another initialisation, data order and validation sample); both
# are timed as the run without the suffix (a step costs the same).
#
# Two measurements, combined:
#   1. loss: each run's 500 (or 1000) steps on this machine (mpirun, no link limit). The losses
#      do not depend on the link: a run is bit-identical at every rate (runs/studies/e2e.csv).
#   2. time: each run on the emulated cluster (scripts/cluster.sh; needs root) at each rate for
#      TIME_STEPS steps after 2 warm-up steps, no evaluation; its mean step time on rank 0's clock
#      (whole rounds of every --inner-steps H: 50 steps by default) is its seconds per step there.
#      AdamW-HSDP sends 34 MB a step (30 s at 10 Mbit/s): it is timed over HSDP_STEPS (6) steps.
# Wall time at a rate = steps x that rate's mean step time (evaluations not counted).
#   PHASES (default "loss time table"), RATES (default "100mbit 10mbit"), RUNS (default all).
#   docs/results/fewer-bits.md's tables add 2mbit, timed for the compressed runs only (RATES=2mbit PHASES=time
#   RUNS="flexdemo flexdemo-2bit diloco-demo-..."; the dense exchanges of diloco-h10* and
#   adamw-hsdp outlast --comm-timeout there), then RATES="100mbit 10mbit 2mbit" PHASES=table.
# Runs the tuning sweep or the wire-format run already trained with the same options are reused
# (flexdemo, adamw-hsdp, flexdemo-2bit). Everything lands in runs/studies/local-steps/.
set -euo pipefail
cd "$(dirname "$0")/.."
phases="${PHASES:-loss time table}"
rates="${RATES-100mbit 10mbit}"
all_runs="adamw-hsdp flexdemo flexdemo-2bit diloco-h10 diloco-h10-avg diloco-demo-h10
  diloco-demo-h10-avg diloco-demo-h10-avg-nodct diloco-demo-h5-avg diloco-demo-h25-avg
  diloco-demo-h10-sign diloco-demo-h10-sign-half flexdemo-x2 flexdemo-2bit-x2 diloco-demo-h10-avg-x2
  adamw-hsdp-s2 flexdemo-s2 diloco-demo-h10-avg-s2 flexdemo-x2-s2 diloco-demo-h10-avg-x2-s2"
runs="${RUNS:-$all_runs}"
time_steps="${TIME_STEPS:-50}"
hsdp_steps="${HSDP_STEPS:-6}"
out=runs/studies/local-steps
mkdir -p "$out"
export FLEXDEMO_TOKENIZE="$PWD/build/flexdemo-tokenize"
common=(--model gpt-micro --lr 1e-3 --progress lines)

options_of() {
  case "$1" in
    *-x2) options_of "${1%-x2}" ;;
    *-s2) echo "$(options_of "${1%-s2}") --seed 2" ;;
    adamw-hsdp) echo "--optimizer adamw" ;;
    flexdemo) echo "--optimizer flexdemo" ;;
    flexdemo-2bit) echo "--optimizer flexdemo --values 2bit" ;;
    # DiLoCo: AdamW local steps, the exact mean of the pseudo-gradients (a dense all-reduce),
    # DiLoCo's outer Nesterov SGD (lr 0.7, momentum 0.9), or plain averaging (lr 1, momentum 0).
    diloco-h10) echo "--optimizer adamw --inner-steps 10 --outer-lr 0.7 --outer-momentum 0.9" ;;
    diloco-h10-avg) echo "--optimizer adamw --inner-steps 10 --outer-lr 1 --outer-momentum 0" ;;
    # The same through DeMo's exchange: top-k 320 of 4,096 (10x the default: at H = 10 the
    # same coefficients per step as FlexDeMo), 2bit values.
    diloco-demo-h10) echo "--optimizer adamw --replicator demo --inner-steps 10 --topk 320 --values 2bit --outer-lr 0.7 --outer-momentum 0.9" ;;
    diloco-demo-h10-avg) echo "--optimizer adamw --replicator demo --inner-steps 10 --topk 320 --values 2bit --outer-lr 1 --outer-momentum 0" ;;
    # The same without the DCT: top-k of the pseudo-gradient's own entries in each chunk.
    diloco-demo-h10-avg-nodct) echo "--optimizer adamw --replicator demo --inner-steps 10 --topk 320 --values 2bit --transform none --outer-lr 1 --outer-momentum 0" ;;
    diloco-demo-h5-avg) echo "--optimizer adamw --replicator demo --inner-steps 5 --topk 160 --values 2bit --outer-lr 1 --outer-momentum 0" ;;
    diloco-demo-h25-avg) echo "--optimizer adamw --replicator demo --inner-steps 25 --topk 800 --values 2bit --outer-lr 1 --outer-momentum 0" ;;
    # The outer step on the mean's sign, every parameter moved by H x --lr or half of it.
    diloco-demo-h10-sign) echo "--optimizer adamw --replicator demo --inner-steps 10 --topk 320 --values 2bit --outer-sign --outer-lr 1e-2" ;;
    diloco-demo-h10-sign-half) echo "--optimizer adamw --replicator demo --inner-steps 10 --topk 320 --values 2bit --outer-sign --outer-lr 5e-3" ;;
    *) echo "local_steps.sh: unknown run '$1'" >&2; exit 1 ;;
  esac
}
trained_as() {  # a kept run with the same options
  case "$1" in
    adamw-hsdp) echo runs/studies/tune/gpt-micro-500/adamw-lr1e-3 ;;
    flexdemo) echo runs/studies/tune/gpt-micro-500/flexdemo-lr1e-3 ;;
    flexdemo-2bit) echo runs/studies/wire/gpt-micro-500-2bit ;;
    *) echo "" ;;
  esac
}
loss_dir() { local d; d=$(trained_as "$1"); echo "${d:-$out/loss/$1}"; }
steps_of() { [[ "${1%-s2}" == *-x2 ]] && echo 1000 || echo 500; }
timed_as() { local r=${1%-s2}; echo "${r%-x2}"; }  # a step costs what the plain run's does

field() { grep -o "\"$2\": *[0-9.e+-]*" "$1" | head -1 | sed 's/.*: *//'; }

if [[ " $phases " == *" loss "* ]]; then
  bash scripts/build.sh flexdemo_cli flexdemo-tokenize > /dev/null
  for run in $runs; do
    d=$(loss_dir "$run")
    [ -f "$d/summary.json" ] && { echo "== loss: $run (kept: $d) =="; continue; }
    echo "== loss: $run =="
    rm -rf "$d"
    # shellcheck disable=SC2046
    mpirun --allow-run-as-root --oversubscribe -np 4 build/flexdemo train "${common[@]}" \
      --ranks-per-node 2 --steps "$(steps_of "$run")" --eval-every 50 --log-every 100 \
      $(options_of "$run") --out "$d"
  done
fi

if [[ " $phases " == *" time "* ]]; then
  cluster=scripts/cluster.sh
  trap 'bash "$cluster" down >/dev/null 2>&1 || true' EXIT
  for rate in $rates; do
    bash "$cluster" up 2 2 "$rate"
    for run in $runs; do
      [ "$(timed_as "$run")" = "$run" ] || continue
      steps=$time_steps
      [ "$run" = adamw-hsdp ] && steps=$hsdp_steps
      d="$out/time/$rate/$run"
      echo "== time at $rate: $run ($steps steps) =="
      rm -rf "$d"
      # shellcheck disable=SC2046
      bash "$cluster" run -- "$PWD/build/flexdemo" train "${common[@]}" --steps $((steps + 2)) \
        --eval-every 0 --log-every 10 $(options_of "$run") --out "$PWD/$d" > /dev/null
    done
    bash "$cluster" down
  done
fi

if [[ " $phases " == *" table "* ]]; then
  # RUN REFERENCE: REFERENCE's final validation loss, at RUN's seed (-s2 runs are held to the -s2
  # references: another seed evaluates on another validation sample).
  target_of() {
    local ref=$2
    [[ "$1" == *-s2 ]] && ref="$ref-s2"
    field "$(loss_dir "$ref")/summary.json" final_val_loss
  }
  target=$(target_of adamw-hsdp adamw-hsdp)
  flexdemo_target=$(target_of flexdemo flexdemo)
  csv="$out/local-steps.csv"
  echo "rate,run,final_val_loss,s_per_step,inter_bytes_per_step,s_to_adamw_hsdp_loss,step_reached,s_to_flexdemo_loss,step_reached_flexdemo" > "$csv"
  # RUN_DIR TARGET: the first step whose validation loss is at most TARGET, or -.
  first_step_at() {
    awk -v target="$2" 'match($0, /"step":[0-9]+/) { s = substr($0, RSTART + 7, RLENGTH - 7) }
      match($0, /"val_loss":[0-9.e+-]+/) {
        if (substr($0, RSTART + 11, RLENGTH - 11) + 0 <= target + 0) { print s; found = 1; exit } }
      END { if (!found) print "-" }' "$1/metrics.jsonl"
  }
  seconds_for() { [ "$1" = "-" ] && echo "-" || awk -v s="$1" -v t="$2" 'BEGIN { printf "%.0f", s * t }'; }
  for rate in $rates; do
    for run in $all_runs; do
      ld=$(loss_dir "$run") td="$out/time/$rate/$(timed_as "$run")"
      [ -f "$ld/summary.json" ] && [ -f "$td/metrics.jsonl" ] || continue
      # Mean wall time of a step after the 2 warm-up steps, from rank 0's clock (elapsed_s), not
      # step_ms: a rank's step ends when its sends are in its socket buffers, and on a slow link
      # the bytes still queued there delay the next collective (at 2 Mbit/s 0.85 s a step for
      # FlexDeMo against 0.69 s of step_ms).
      s_per_step=$(awk 'match($0, /"step":[0-9]+/) { s = substr($0, RSTART + 7, RLENGTH - 7) + 0 }
        match($0, /"elapsed_s":[0-9.e+-]+/) {
          t = substr($0, RSTART + 12, RLENGTH - 12) + 0
          if (s == 2) { t2 = t } else if (s > 2) { last = t; n = s - 2 } }
        END { printf "%.4f", (last - t2) / n }' "$td/metrics.jsonl")
      reached=$(first_step_at "$ld" "$(target_of "$run" adamw-hsdp)")
      reached_flexdemo=$(first_step_at "$ld" "$(target_of "$run" flexdemo)")
      echo "$rate,$run,$(field "$ld/summary.json" final_val_loss),$s_per_step,$(field "$ld/summary.json" inter_bytes_per_step),$(seconds_for "$reached" "$s_per_step"),$reached,$(seconds_for "$reached_flexdemo" "$s_per_step"),$reached_flexdemo" >> "$csv"
      # Validation loss against the wall time at this rate, for the plot.
      awk -v t="$s_per_step" 'match($0, /"step":[0-9]+/) { s = substr($0, RSTART + 7, RLENGTH - 7) }
        match($0, /"val_loss":[0-9.e+-]+/) { print s * t, substr($0, RSTART + 11, RLENGTH - 11) }' \
        "$ld/metrics.jsonl" > "$out/curve-$rate-$run.dat"
    done
    gp="$out/loss-vs-time-$rate.gp"
    {
      echo "set terminal pngcairo size 900,560 noenhanced"
      echo "set output '$out/loss-vs-time-$rate.png'"
      echo "set title 'Validation loss against wall time at $rate (gpt-micro, 2 nodes x 2 ranks, 500 steps; -x2: 1000)'"
      echo "set xlabel 'seconds (steps x mean step time at $rate)'; set ylabel 'validation loss'"
      echo "set logscale x; set grid; set key top right"
      echo "set arrow from graph 0, first $target to graph 1, first $target nohead dashtype 2"
      printf "plot "
      first=1
      for run in $all_runs; do
        [ -f "$out/curve-$rate-$run.dat" ] || continue
        # Another seed evaluates on another validation sample: in the CSV, not on these axes.
        [[ "$run" == *-s2 ]] && continue
        [ $first -eq 1 ] || printf ", "
        first=0
        printf "'%s' using 1:2 with linespoints title '%s'" "$out/curve-$rate-$run.dat" "$run"
      done
      echo
    } > "$gp"
    gnuplot "$gp"
  done
  column -s, -t < "$csv"
  echo "AdamW-HSDP's 500-step validation loss: $target, FlexDeMo's: $flexdemo_target; results: $csv, $out/loss-vs-time-<rate>.png"
fi
