#!/usr/bin/env python3
"""Issue 32's gap plot from the kept data: each run's validation loss against AdamW-HSDP's at every
validation step of gpt-micro's 2,000-step job (docs/results/data/parity.csv), drawn with gnuplot
into docs/results/plots/parity-gpt-micro-2000-gaps.png.

The reference is the issue's AdamW-HSDP run (lr 1e-3, measured at commit ac0e433: its losses are
in the issue's table, not in parity.csv) and the old default's run from the same table.
    python3 bench/parity_plot.py [--csv FILE] [--out PNG]
"""
import argparse
import csv
import os
import subprocess
import tempfile

STEPS = [250, 500, 750, 1000, 1250, 1500, 1750, 2000]
ADAMW_HSDP = [5.6113, 5.2999, 5.1360, 4.9727, 4.8565, 4.7591, 4.7081, 4.6715]
OLD_DEFAULT = [5.6736, 5.3857, 5.2273, 5.0963, 4.9690, 4.8857, 4.8457, 4.8061]
RUNS = {  # parity.csv's run -> the plot's label
    "tune/gpt-micro-2000/flexdemo-cap1-topk112-fp8-lr1e-3":
        "default: adaptive step, RMS capped at 1, top-k 112 fp8",
    "tune/gpt-micro-2000/flexdemo-pre-nosign-nofold-bound1-topk112-fp8-lr1e-3":
        "adaptive step bounded at 1, top-k 112 fp8",
    "tune/gpt-micro-2000/flexdemo-pre-nosign-nofold-lr1e-3":
        "adaptive step, unbounded, top-k 32 bf16",
    "tune/gpt-micro-2000/flexdemo-adaptive-rms0.5-topk112-fp8":
        "adaptive step at RMS 0.5, top-k 112 fp8",
    "tune/gpt-micro-2000/flexdemo-pre-lr1e-3": "sign step, preconditioned",
    "tune/gpt-micro-2000/diloco-demo-h10-avg-2bit-lr1e-3": "AdamW, 10 local steps through DeMo",
}


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    results = os.path.join(here, "..", "docs", "results")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", default=os.path.join(results, "data", "parity.csv"))
    parser.add_argument("--out", default=os.path.join(results, "plots",
                                                      "parity-gpt-micro-2000-gaps.png"))
    args = parser.parse_args()
    losses = {run: {} for run in RUNS}
    with open(args.csv, newline="") as f:
        for row in csv.DictReader(f):
            if row["run"] in losses:
                losses[row["run"]][int(row["step"])] = float(row["val_loss"])
    series = [("old default: sign step, top-k 32 bf16 (issue's)", dict(zip(STEPS, OLD_DEFAULT)))]
    for run, label in RUNS.items():
        if not losses[run]:
            raise SystemExit(f"parity_plot: no rows of {run} in {args.csv}")
        series.append((label, losses[run]))
    reference = dict(zip(STEPS, ADAMW_HSDP))
    with tempfile.TemporaryDirectory() as work:
        data = os.path.join(work, "gaps.dat")
        with open(data, "w") as f:
            for _, by_step in series:
                for step in STEPS:
                    if step in by_step:
                        f.write(f"{step} {100 * (by_step[step] / reference[step] - 1):.4f}\n")
                f.write("\n\n")
        plots = [f"'{data}' index {i} using 1:2 with linespoints title \"{label}\""
                 for i, (label, _) in enumerate(series)]
        plots.append("1 with lines dt 2 lc rgb 'black' title \"issue 32's mark (1%)\"")
        script = "\n".join([
            "set terminal pngcairo size 1000,700", f"set output '{os.path.abspath(args.out)}'",
            "set title 'gpt-micro on fortunes, 2 nodes x 2 ranks: "
            "validation loss above AdamW-HSDP'",
            "set xlabel 'step'", "set ylabel 'gap to AdamW-HSDP (%)'", "set grid",
            "set key below", "set yrange [-1:*]", "set xzeroaxis lt -1", "plot " + ", ".join(plots)]) + "\n"
        subprocess.run(["gnuplot"], input=script, text=True, check=True)
    print(f"plot: {args.out}")


if __name__ == "__main__":
    main()
