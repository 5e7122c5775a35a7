"""bench/many_nodes.sh's table: each measured run (its rate, node count and exchange) beside the
projection (flexdemo.project) of that point from the run's own measured compute time.

    python bench/many_nodes_table.py runs/studies/many-nodes/<model> LATENCY_MS

Measured per step: the mean over the steps after the first 10 of each node's bytes sent and
received between nodes (the run's totals over its ranks, divided by the nodes: one rank a node)
and of the step's wall time and its compute time (step time less the exchanges' wait).
"""

import json
import os
import statistics
import sys

from flexdemo import project

KIND = {"allgather": "allgather", "owners": "owner", "allreduce": "allreduce-ring",
        "local-10": "local"}


def rate_gbit(rate):  # "1gbit", "100mbit"
    scale = {"gbit": 1.0, "mbit": 1e-3, "kbit": 1e-6}
    for unit, s in scale.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * s
    raise ValueError(f"rate {rate!r}")


def measured(run, nodes):
    steps = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    steps = [m for m in steps if "step_ms" in m and m["step"] > 10]
    mean = lambda key: statistics.fmean(m[key] for m in steps)  # noqa: E731
    return {"step_ms": mean("step_ms"), "compute_ms": mean("compute_ms"),
            "sent": mean("inter_bytes_sent") / nodes, "recv": mean("inter_bytes_recv") / nodes,
            "steps": len(steps)}


def main():
    root, latency_ms = sys.argv[1], float(sys.argv[2])
    sizes_of = {}
    rows = []
    for rate in sorted(os.listdir(root)):
        if not os.path.isdir(os.path.join(root, rate)):
            continue
        for nodes in sorted(os.listdir(os.path.join(root, rate)), key=int):
            for name in KIND:
                run = os.path.join(root, rate, nodes, name)
                if not os.path.isfile(os.path.join(run, "summary.json")):
                    continue
                n = int(nodes)
                config = json.load(open(os.path.join(run, "config.json")))
                key = (config["model"], config["topk"], config["chunk"], config["values"])
                if key not in sizes_of:
                    shapes = project.model_shapes(config["model"], None)
                    sizes_of[key] = project.sizes(shapes, 4, config["chunk"], config["topk"],
                                                  config["values"])
                s = sizes_of[key]
                m = measured(run, n)
                h = config["inner_steps"]
                link = project.Link(rate_gbit(rate) * 1e9 / 8, latency_ms / 1000)
                got_bytes = project.exchange_cost(KIND[name], n, s, h)[0]
                got_ms = 1000 * project.step_seconds(KIND[name], n, s, h, link,
                                                     m["compute_ms"] / 1000, False)
                rows.append((rate, n, name, m, got_bytes, got_ms))
    print(f"Measured (mean of each run's steps after the first 10) against projected "
          f"(python -m flexdemo.project's model from the run's own compute time; latency "
          f"{latency_ms:g} ms a message). Bytes are per node per step.\n")
    print("| rate | nodes | exchange | bytes sent | bytes received | projected bytes | "
          "compute ms | step ms | projected step ms | error |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for rate, n, name, m, got_bytes, got_ms in rows:
        print(f"| {rate} | {n} | {name} | {m['sent']:,.0f} | {m['recv']:,.0f} | "
              f"{got_bytes:,.0f} | {m['compute_ms']:.1f} | {m['step_ms']:.1f} | {got_ms:.1f} | "
              f"{100 * (got_ms / m['step_ms'] - 1):+.1f}% |")


if __name__ == "__main__":
    main()
