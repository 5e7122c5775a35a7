#!/usr/bin/env bash
# The tuning sweep: each optimizer trained with each of its candidate settings on one fixed step
# budget (the same model, data, seed, batch and topology: 2 nodes x 2 ranks, like
# scripts/demo.sh), every run kept, and the best per optimizer chosen on final validation loss.
# Writes runs/studies/tune/<model>-<steps>/<run>/ (one `flexdemo train` output each) and
# table.md there (every run; the best of each optimizer in bold, with its loss against the best
# AdamW-HSDP run), gaps.md and gaps.png there (each run's validation loss against the best
# AdamW-HSDP run's at every validation step), and frontier.md and frontier.png there (each run's
# final validation loss against its bytes between nodes per step; on the frontier when every run
# with as few bytes or fewer ends higher). A run that finished (its options.txt is written
# last) is not trained again, so a sweep cut short continues where it stopped; delete a run's
# folder to train it again.
#   MODEL (default gpt-micro), STEPS (default 500), NP (MPI ranks, default 4), RANKS_PER_NODE
#   (default 2; a run whose options name --ranks-per-node keeps its own), GRID (a file of lines
#   "RUN-NAME OPTIONS...", default: the built-in grid below; RUN-NAME starts with the optimizer),
#   ONLY (a regular expression: train only the runs it matches; the table lists all kept runs),
#   EVAL_EVERY (validation every N steps, default 50), OUT (the sweep's folder, default
#   runs/studies/tune/<model>-<steps>; give each corpus its own when --data changes).
#   Extra arguments go to every `flexdemo train`.
# It builds build/ from the working tree first: a patch under study stays applied until its
# runs are over (reverted earlier, the next sweep trains without it).
set -euo pipefail
cd "$(dirname "$0")/.."
model="${MODEL:-gpt-micro}"
steps="${STEPS:-500}"
np="${NP:-4}"
ranks_per_node="${RANKS_PER_NODE:-2}"
out="${OUT:-runs/studies/tune/$model-$steps}"
bash scripts/install-deps.sh >/dev/null
bash scripts/build.sh flexdemo_cli flexdemo_tokenize >/dev/null
export OMP_NUM_THREADS=1
root_flag=""
if [ "$(id -u)" -eq 0 ]; then root_flag="--allow-run-as-root"; fi

default_grid() {
  cat <<'EOF'
flexdemo-lr2.5e-4 --optimizer flexdemo --lr 2.5e-4
flexdemo-lr5e-4 --optimizer flexdemo --lr 5e-4
flexdemo-lr1e-3 --optimizer flexdemo --lr 1e-3
flexdemo-lr2e-3 --optimizer flexdemo --lr 2e-3
flexdemo-topk64-lr1e-3 --optimizer flexdemo --topk 64 --lr 1e-3
adamw-lr5e-4 --optimizer adamw --lr 5e-4
adamw-lr1e-3 --optimizer adamw --lr 1e-3
adamw-lr2e-3 --optimizer adamw --lr 2e-3
flexdemo-adamw-lr1e-3 --optimizer flexdemo-adamw --beta1 0.9 --lr 1e-3
flexdemo-adamw-sign-lr1e-3 --optimizer flexdemo-adamw --sign --beta1 0.9 --lr 1e-3
flexdemo-adamw-beta1-0-lr1e-3 --optimizer flexdemo-adamw --beta1 0 --lr 1e-3
flexdemo-topk128-lr1e-3 --optimizer flexdemo --topk 128 --lr 1e-3
flexdemo-adamw-beta1-0-lr2e-3 --optimizer flexdemo-adamw --beta1 0 --lr 2e-3
flexdemo-adamw-beta1-0-lr5e-4 --optimizer flexdemo-adamw --beta1 0 --lr 5e-4
flexdemo-adamw-beta1-0-lr2.5e-4 --optimizer flexdemo-adamw --beta1 0 --lr 2.5e-4
flexdemo-1node-lr1e-3 --optimizer flexdemo --lr 1e-3 --ranks-per-node 4
EOF
}

grid() { if [ -n "${GRID:-}" ]; then grep -v '^\s*\(#\|$\)' "$GRID"; else default_grid; fi; }

mkdir -p "$out"
while read -r name options; do
  if [ -n "${ONLY:-}" ] && ! [[ "$name" =~ $ONLY ]]; then continue; fi
  # options.txt is written after a run ends well (one stopped early still writes summary.json)
  if [ -f "$out/$name/options.txt" ]; then continue; fi
  echo "== $name: $options =="
  rm -rf "${out:?}/$name"
  topology=(--ranks-per-node "$ranks_per_node")  # unless the run sets its own
  if [[ " $options " == *" --ranks-per-node "* ]]; then topology=(); fi
  # shellcheck disable=SC2086  # $options and $root_flag split into words on purpose
  mpirun $root_flag --oversubscribe -np "$np" build/flexdemo train --model "$model" \
    "${topology[@]}" --steps "$steps" --eval-every "${EVAL_EVERY:-50}" --log-every 100 \
    --progress lines $options --out "$out/$name" "$@" </dev/null  # mpirun would eat the grid
  echo "$options" >"$out/$name/options.txt"
done < <(grid)

# The table: every kept run, grouped by optimizer, best first.
python3 - "$out" <<'EOF'
import json, os, sys
out = sys.argv[1]
# A run's method: its optimizer, and its exchange where that is not the optimizer's own (so that
# AdamW's local steps through DeMo are not ranked as AdamW-HSDP).
def method(config):
    own = {"adamw": "full", "sgd": "full", "flexdemo": "demo", "flexdemo-adamw": "demo"}
    m = config["optimizer"]
    if config.get("replicator") not in (None, own.get(m)):
        m += "+" + config["replicator"]
    if config.get("inner_steps", 1) > 1:
        m += f"+H{config['inner_steps']}"
    return m
rows = []
for name in sorted(os.listdir(out)):
    summary = os.path.join(out, name, "summary.json")
    if not os.path.isfile(os.path.join(out, name, "options.txt")):
        continue
    s = json.load(open(summary))
    config = json.load(open(os.path.join(out, name, "config.json")))
    options = open(os.path.join(out, name, "options.txt")).read().strip()
    rows.append((method(config), s["final_val_loss"], name, options, s["steps"],
                 s["inter_bytes_per_step"]))
best = {}
for opt, loss, *_ in rows:
    best[opt] = min(loss, best.get(opt, float("inf")))
ref = best.get("adamw")
lines = ["| run | options | steps | final val loss | best of its optimizer vs best AdamW-HSDP |",
         "|---|---|---|---|---|"]
for opt, loss, name, options, steps, _ in sorted(rows):
    top = loss == best[opt]
    vs = f"{100 * (loss / ref - 1):+.2f}%" if top and ref else ""
    cell = f"**{loss:.4f}**" if top else f"{loss:.4f}"
    lines.append(f"| {name} | `{options}` | {steps} | {cell} | {vs} |")
open(os.path.join(out, "table.md"), "w").write("\n".join(lines) + "\n")
print("\n".join(lines))

# The gap to the best AdamW-HSDP run at every validation step both have: gaps.md, and gaps.dat
# (one block per run: step, gap %) for the plot.
def val_losses(name):
    evals = {}
    for line in open(os.path.join(out, name, "metrics.jsonl")):
        m = json.loads(line)
        if "val_loss" in m:
            evals[m["step"]] = m["val_loss"]
    return evals
adamw = [(loss, name) for opt, loss, name, *_ in rows if opt == "adamw"]  # AdamW-HSDP
if adamw:
    ref_name = min(adamw)[1]
    ref_evals = val_losses(ref_name)
    steps = sorted(ref_evals)
    others = [name for _, _, name, *_ in sorted(rows, key=lambda r: r[1]) if name != ref_name]
    gap_lines = [f"Validation loss against {ref_name} at each step (+: above it).", "",
                 "| run | " + " | ".join(str(s) for s in steps) + " |",
                 "|---|" + "---|" * len(steps)]
    blocks = []
    for name in others:
        evals = val_losses(name)
        gaps = {s: 100 * (evals[s] / ref_evals[s] - 1) for s in steps if s in evals}
        gap_lines.append(f"| {name} | " + " | ".join(
            f"{gaps[s]:+.2f}%" if s in gaps else "" for s in steps) + " |")
        blocks.append(f"# {name}\n" + "".join(f"{s} {g:.4f}\n" for s, g in gaps.items()))
    open(os.path.join(out, "gaps.md"), "w").write("\n".join(gap_lines) + "\n")
    open(os.path.join(out, "gaps.dat"), "w").write("\n\n".join(blocks))
    print("\n".join(gap_lines))
    plot = ["set terminal pngcairo size 1000,600", "set output 'gaps.png'",
            f"set title 'validation loss against {ref_name} (%)'", "set xlabel 'step'",
            "set ylabel 'gap (%)'", "set key outside right", "set grid",
            "plot " + ", ".join(f"'gaps.dat' index {i} using 1:2 with linespoints title '{n}'"
                                for i, n in enumerate(others))]
    open(os.path.join(out, "gaps.gnuplot"), "w").write("\n".join(plot) + "\n")

# The loss-against-bytes frontier: frontier.md, and frontier.dat (index 0: every run; 1: the
# frontier's) for the plot.
by_bytes = sorted((nbytes, loss, name) for _, loss, name, _, _, nbytes in rows)
frontier, lowest = [], float("inf")
for nbytes, loss, name in by_bytes:  # bytes ascending: on it when below every cheaper run
    if loss < lowest:
        frontier.append((nbytes, loss, name))
        lowest = loss
lines = ["| run | bytes between nodes per step | final val loss | on the frontier |",
         "|---|---|---|---|"]
lines += [f"| {name} | {nbytes:,.0f} | {loss:.4f} | {'yes' if (nbytes, loss, name) in frontier else ''} |"
          for nbytes, loss, name in by_bytes]
open(os.path.join(out, "frontier.md"), "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
with open(os.path.join(out, "frontier.dat"), "w") as f:
    for block in (by_bytes, frontier):
        f.write("".join(f'{nbytes:.0f} {loss:.6f} "{name}"\n' for nbytes, loss, name in block))
        f.write("\n\n")
plot = ["set terminal pngcairo size 1000,600", "set output 'frontier.png'",
        f"set title 'final validation loss against bytes between nodes per step ({os.path.basename(out)})'",
        "set xlabel 'bytes between nodes per step'", "set ylabel 'final validation loss'",
        "set logscale x", "set grid", "set key top right",
        "set offsets graph 0.05, graph 0.3, graph 0.05, graph 0.05",
        "plot 'frontier.dat' index 1 using 1:2 with linespoints pt 7 title 'frontier', "
        "'' index 0 using 1:2 with points pt 6 title 'runs', "
        "'' index 0 using 1:2:3 with labels left offset 1,0 font ',8' notitle"]
open(os.path.join(out, "frontier.gnuplot"), "w").write("\n".join(plot) + "\n")
EOF
if command -v gnuplot >/dev/null && [ -f "$out/gaps.gnuplot" ]; then
  (cd "$out" && gnuplot gaps.gnuplot) && echo "plot: $out/gaps.png"
fi
if command -v gnuplot >/dev/null; then
  (cd "$out" && gnuplot frontier.gnuplot) && echo "plot: $out/frontier.png"
fi
