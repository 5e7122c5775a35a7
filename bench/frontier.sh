#!/usr/bin/env bash
# The loss-against-bytes frontier of one tuning sweep: every run that bench/tune.sh kept in
# runs/studies/tune/<model>-<steps>/ (or the folder given), placed by its bytes between nodes per
# step (summary.json's inter_bytes_per_step) and its final validation loss; a run is on the
# frontier when no other run has both fewer (or as many) bytes and a lower loss. Writes
# frontier.md (every run, bytes ascending, the frontier's runs marked), frontier.dat and, with
# gnuplot, frontier.png (bytes on a log scale) into that folder.
#   bench/frontier.sh [FOLDER]       default: runs/studies/tune/$MODEL-$STEPS
#   MODEL (default gpt-micro), STEPS (default 2000)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-runs/studies/tune/${MODEL:-gpt-micro}-${STEPS:-2000}}"
if [ ! -d "$out" ]; then
  echo "frontier.sh: no sweep folder $out (bench/tune.sh writes it)" >&2
  exit 2
fi
python3 - "$out" <<'EOF'
import json, os, sys
out = sys.argv[1]
runs = []
for name in sorted(os.listdir(out)):
    folder = os.path.join(out, name)
    if not os.path.isfile(os.path.join(folder, "options.txt")):
        continue  # not finished
    s = json.load(open(os.path.join(folder, "summary.json")))
    runs.append((s["inter_bytes_per_step"], s["final_val_loss"], name))
if not runs:
    sys.exit(f"frontier.sh: no finished run in {out}")
runs.sort()
frontier, best = set(), float("inf")
for nbytes, loss, name in runs:  # bytes ascending: on it when below every cheaper run
    if loss < best:
        frontier.add(name)
        best = loss
lines = ["| run | bytes between nodes per step | final val loss | on the frontier |",
         "|---|---|---|---|"]
for nbytes, loss, name in runs:
    lines.append(f"| {name} | {nbytes:,.0f} | {loss:.4f} | {'yes' if name in frontier else ''} |")
open(os.path.join(out, "frontier.md"), "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
with open(os.path.join(out, "frontier.dat"), "w") as f:  # index 0: every run; 1: the frontier
    for block in (runs, [r for r in runs if r[2] in frontier]):
        f.write("".join(f"{nbytes:.0f} {loss:.6f} \"{name}\"\n" for nbytes, loss, name in block))
        f.write("\n\n")
plot = ["set terminal pngcairo size 1000,600", "set output 'frontier.png'",
        f"set title 'final validation loss against bytes between nodes per step ({os.path.basename(os.path.abspath(out))})'",
        "set xlabel 'bytes between nodes per step'", "set ylabel 'final validation loss'",
        "set logscale x", "set grid", "set key top right", "set offsets graph 0.05, graph 0.3, graph 0.05, graph 0.05",
        "plot 'frontier.dat' index 1 using 1:2 with linespoints pt 7 title 'frontier', "
        "'' index 0 using 1:2 with points pt 6 title 'runs', "
        "'' index 0 using 1:2:3 with labels left offset 1,0 font ',8' notitle"]
open(os.path.join(out, "frontier.gnuplot"), "w").write("\n".join(plot) + "\n")
EOF
if command -v gnuplot >/dev/null; then
  (cd "$out" && gnuplot frontier.gnuplot) && echo "plot: $out/frontier.png"
fi
