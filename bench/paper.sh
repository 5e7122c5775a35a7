#!/usr/bin/env bash
# The FlexDeMo paper's comparison on its own task, translation: a T5 from random initialisation
# trained on English -> French pairs (gettext:fr, the installed message catalogues) by FlexDeMo
# (DeMo between nodes + sign-SGD), FlexDeMo-AdamW and AdamW-HSDP, on an emulated cluster of
# 2 nodes x 2 ranks (scripts/cluster.sh; needs root) at each link rate, with the same data,
# seed, batch and steps. Each run is then scored on the validation pairs: loss and chrF of its
# greedy translations (`flexdemo eval --translate`). Keeps every run in
# runs/studies/paper/<model>-<steps>-topk<k>/<rate>/<run>, writes table.md there and, per
# rate, a `flexdemo report` (validation loss against step and wall time, bytes between nodes).
#   MODEL (default t5-nano; t5-small is the paper's model: docs/results/equal-steps.md), STEPS (default 500),
#   RATES (default "none 100mbit"), RUNS (default "flexdemo flexdemo-adamw adamw-hsdp"),
#   LR_FLEXDEMO, LR_FLEXDEMO_ADAMW, LR_ADAMW (default: the optimizers' tuned defaults),
#   TRANSLATE (validation pairs translated for chrF, default 200), TOPK (DeMo's coefficients per
#   chunk, default 4 as in the paper). RATES="" trains nothing and
#   only rebuilds the table and reports from the runs kept. Extra arguments go to every run.
set -euo pipefail
cd "$(dirname "$0")/.."
model="${MODEL:-t5-nano}"
steps="${STEPS:-500}"
rates="${RATES-none 100mbit}"
runs="${RUNS:-flexdemo flexdemo-adamw adamw-hsdp}"
translate="${TRANSLATE:-200}"
topk="${TOPK:-4}"
out="runs/studies/paper/$model-$steps-topk$topk"
bash scripts/install-deps.sh >/dev/null
bash scripts/build.sh flexdemo_cli flexdemo_tokenize >/dev/null
cluster=scripts/cluster.sh
trap 'bash "$cluster" down >/dev/null 2>&1 || true' EXIT
export FLEXDEMO_TOKENIZE="$PWD/build/flexdemo-tokenize" OMP_NUM_THREADS=1

options_of() {
  local lr
  case "$1" in
    flexdemo) lr=${LR_FLEXDEMO:+--lr $LR_FLEXDEMO}; echo "--optimizer flexdemo $lr" ;;
    flexdemo-adamw) lr=${LR_FLEXDEMO_ADAMW:+--lr $LR_FLEXDEMO_ADAMW}; echo "--optimizer flexdemo-adamw $lr" ;;
    adamw-hsdp) lr=${LR_ADAMW:+--lr $LR_ADAMW}; echo "--optimizer adamw $lr" ;;
    *) echo "paper.sh: unknown run '$1'" >&2; exit 1 ;;
  esac
}

# The paper's setting, scaled to the model: sources and targets cut at 64 tokens (the paper: 512
# and 150; 95% of gettext:fr's fit in 43 and 49), global batch 32, DeMo top-k 4 of chunk 64.
task=(--model "$model" --data gettext:fr --seq 64 --target-seq 64 --batch 32 --topk "$topk"
  --chunk 64)
mkdir -p "$out"
for rate in $rates; do
  bash "$cluster" up 2 2 "$rate"
  for run in $runs; do
    echo "== $model, $rate: $run =="
    d="$out/$rate/$run"
    rm -rf "${d:?}"
    # shellcheck disable=SC2046
    bash "$cluster" run -- "$PWD/build/flexdemo" train "${task[@]}" --steps "$steps" \
      --eval-every 25 --progress lines --log-every 50 $(options_of "$run") --out "$PWD/$d" "$@" \
      </dev/null
    build/flexdemo eval "$d" --translate "$translate" > "$d/eval.json"
  done
  bash "$cluster" down
done

# The table covers every run kept so far, so rates can be measured one at a time.
python3 - "$out" "$model" <<'EOF'
import json, os, sys
out, model = sys.argv[1], sys.argv[2]
lines = [f"| link | run | final val loss | vs AdamW-HSDP | chrF | MB between nodes per step | wall s |",
         "|---|---|---|---|---|---|---|"]
for rate in sorted(os.listdir(out)):
    if not os.path.isdir(os.path.join(out, rate)):
        continue
    ref = None
    rows = []
    for run in ("adamw-hsdp", "flexdemo", "flexdemo-adamw"):
        d = os.path.join(out, rate, run)
        if not os.path.isfile(os.path.join(d, "eval.json")):
            continue
        s = json.load(open(os.path.join(d, "summary.json")))
        e = json.load(open(os.path.join(d, "eval.json")))
        last = [json.loads(l) for l in open(os.path.join(d, "metrics.jsonl")) if l.strip()][-1]
        if run == "adamw-hsdp":
            ref = s["final_val_loss"]
        vs = f"{100 * (s['final_val_loss'] / ref - 1):+.1f}%" if ref else ""
        rows.append(f"| {rate} | {run} | {s['final_val_loss']:.4f} | {vs} | {e['chrf']:.1f} | "
                    f"{s['inter_bytes_per_step'] / 1e6:.3f} | {last['elapsed_s']:.0f} |")
    lines += rows
open(os.path.join(out, "table.md"), "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
for rate_dir in "$out"/*/; do
  kept=$(find "$rate_dir" -name summary.json -printf '%h ' 2>/dev/null)
  # shellcheck disable=SC2086
  [ -z "$kept" ] || build/flexdemo report $kept --out "$rate_dir/report" >/dev/null
done
echo "results: $out/table.md, $out/<rate>/report/"
