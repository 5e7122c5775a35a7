#!/usr/bin/env bash
# The gap to AdamW-HSDP as nodes are added (issue 55): MODEL (default gpt-micro) on the demo's
# corpus, 1 rank a node, the global batch fixed (--batch 16: each node's share shrinks as nodes
# are added), the same seed, STEPS steps (default 1000), at each node count of NODES (default
# "2 4 8"). First AdamW-HSDP's rate bracket (RATES, default "5e-4 1e-3 2e-3") at the first node
# count; then at every node count AdamW-HSDP at the best of it and FlexDeMo's default step
# (`--optimizer flexdemo`, whatever it resolves to there: from 4 replicas on the shared second
# moment) with the all-gather and, from 4 nodes on, with the owners' exchange. Each node count
# is one bench/tune.sh sweep (a finished run is kept and not trained again). Writes, under OUT
# (default runs/studies/nodes-gap/<model>-<steps>/): <nodes>x1/ (the sweep: its runs, table.md,
# gaps.md, gaps.png), table.md (final validation loss, the gap, bytes a node a step in
# payloads: one payload is what a node sends another a step with the all-gather at the first
# node count), rows.csv (every run's validation rows) and gap.png (the gap against node count,
# gnuplot).
#   bash bench/nodes_gap.sh    (about 10 minutes a run on 2 cores at 1,000 steps)
set -euo pipefail
cd "$(dirname "$0")/.."
model="${MODEL:-gpt-micro}"
steps="${STEPS:-1000}"
read -r -a nodes <<<"${NODES:-2 4 8}"
read -r -a rates <<<"${RATES:-5e-4 1e-3 2e-3}"
out="${OUT:-runs/studies/nodes-gap/$model-$steps}"
export FLEXDEMO_TOKENIZE="$PWD/build/flexdemo-tokenize"
mkdir -p "$out"

sweep() {  # NODES GRID-LINES...: one bench/tune.sh sweep at NODES x 1
  local n=$1 grid
  shift
  grid="$out/${n}x1.grid"
  printf '%s\n' "$@" >"$grid"
  MODEL="$model" STEPS="$steps" NP="$n" RANKS_PER_NODE=1 EVAL_EVERY="${EVAL_EVERY:-100}" \
    GRID="$grid" OUT="$out/${n}x1" bash bench/tune.sh >"$out/${n}x1.log" 2>&1 ||
    { echo "bench/nodes_gap.sh: the sweep at $n nodes failed: $out/${n}x1.log" >&2; exit 1; }
}

final_loss() { python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["final_val_loss"])' "$1"; }

# AdamW-HSDP's bracket at the first node count, then its best rate everywhere.
bracket=()
for lr in "${rates[@]}"; do bracket+=("adamw-lr$lr --optimizer adamw --lr $lr"); done
echo "== ${nodes[0]} nodes: AdamW-HSDP's rate bracket (${rates[*]}) =="
sweep "${nodes[0]}" "${bracket[@]}"
best=""
for lr in "${rates[@]}"; do
  loss=$(final_loss "$out/${nodes[0]}x1/adamw-lr$lr/summary.json")
  if [ -z "$best" ] || python3 -c "import sys; sys.exit(not float('$loss') < float('$best_loss'))"; then
    best=$lr best_loss=$loss
  fi
done
echo "AdamW-HSDP's best rate at ${nodes[0]} nodes: $best ($best_loss)"
for n in "${nodes[@]}"; do
  echo "== $n nodes x 1 rank =="
  lines=("adamw-lr$best --optimizer adamw --lr $best" "flexdemo --optimizer flexdemo")
  # The owners' exchange is for many nodes: at 2 it sends what the all-gather sends.
  # Its defaults since 2026-12-07 (what the name says: the statistics at log8, what an owner
  # leaves out kept by the owner); "flexdemo-owners" ran the ones before (fp32, senders).
  [ "$n" -lt 4 ] || lines+=("flexdemo-owners-log8-owner --optimizer flexdemo --demo-exchange owners")
  [ "$n" != "${nodes[0]}" ] || lines+=("${bracket[@]}")
  sweep "$n" "${lines[@]}"
done

python3 - "$out" "adamw-lr$best" "${nodes[@]}" <<'EOF'
import csv, json, os, sys
out, adamw, nodes = sys.argv[1], sys.argv[2], [int(n) for n in sys.argv[3:]]
runs = [("flexdemo", "FlexDeMo default, all-gather"),
        ("flexdemo-owners-log8-owner", "FlexDeMo default, owners' exchange")]
def run_dir(n, name):
    return os.path.join(out, f"{n}x1", name)
def summary(n, name):
    return json.load(open(os.path.join(run_dir(n, name), "summary.json")))
# The all-gather at the first node count: a node sends its payload to each other node (below 4
# nodes nothing else: the default's second moment is each replica's own there).
payload = summary(nodes[0], "flexdemo")["inter_bytes_per_step"] / nodes[0] / (nodes[0] - 1)
lines = [f"{os.path.basename(out)}: final validation loss against AdamW-HSDP ({adamw}, the best "
         f"of its bracket at {nodes[0]} nodes) at the same node count; bytes a node a step, and in "
         f"payloads of {payload:,.0f} B (what a node sends to one other with the all-gather at {nodes[0]} nodes).", "",
         "| nodes | AdamW-HSDP | " + " | ".join(f"{label} | gap | payloads" for _, label in runs) + " |",
         "|---:|---:|" + "---:|---:|---:|" * len(runs)]
gaps = []
for n in nodes:
    ref = summary(n, adamw)["final_val_loss"]
    row, gap_row = [str(n), f"{ref:.4f}"], [n]
    for name, _ in runs:
        if not os.path.isfile(os.path.join(run_dir(n, name), "summary.json")):
            row += ["", "", ""]
            gap_row.append(float("nan"))
            continue
        s = summary(n, name)
        gap = 100 * (s["final_val_loss"] / ref - 1)
        row += [f"{s['final_val_loss']:.4f}", f"{gap:+.2f}%",
                f"{s['inter_bytes_per_step'] / n / payload:.2f}"]
        gap_row.append(gap)
    lines.append("| " + " | ".join(row) + " |")
    gaps.append(gap_row)
open(os.path.join(out, "table.md"), "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
with open(os.path.join(out, "rows.csv"), "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["run", "step", "elapsed_s", "val_loss", "loss", "inter_bytes_sent"])
    for n in nodes:
        for name in sorted(os.listdir(os.path.join(out, f"{n}x1"))):
            metrics = os.path.join(run_dir(n, name), "metrics.jsonl")
            if not os.path.isfile(metrics):
                continue
            for line in open(metrics):
                m = json.loads(line)
                if "val_loss" in m:
                    w.writerow([f"{os.path.basename(out)}/{n}x1/{name}", m["step"],
                                f"{m['elapsed_s']:.3f}", f"{m['val_loss']:.6f}",
                                f"{m['loss']:.6f}", m["inter_bytes_sent"]])
with open(os.path.join(out, "gap.dat"), "w") as f:
    f.write("".join(" ".join(f"{v}" for v in row) + "\n" for row in gaps))
plot = ["set terminal pngcairo size 900,550", "set output 'gap.png'",
        f"set title 'final validation loss against AdamW-HSDP ({os.path.basename(out)})'",
        "set xlabel 'nodes (1 rank a node, the global batch fixed)'", "set ylabel 'gap (%)'",
        "set logscale x 2", f"set xrange [{nodes[0] * 0.8}:{nodes[-1] * 1.25}]",
        f"set xtics ({', '.join(str(n) for n in nodes)})", "set grid",
        "set key top left", "plot 0 with lines dt 2 lc 'black' title 'AdamW-HSDP', " + ", ".join(
            f"'gap.dat' using 1:{i + 2} with linespoints pt 7 title \"{label}\""
            for i, (_, label) in enumerate(runs))]
open(os.path.join(out, "gap.gnuplot"), "w").write("\n".join(plot) + "\n")
EOF
if command -v gnuplot >/dev/null; then
  (cd "$out" && gnuplot gap.gnuplot) && echo "plot: $out/gap.png"
fi
