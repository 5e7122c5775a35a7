"""bench/many_nodes.sh's table: each measured run (its rate, node count and exchange) beside the
projection (flexdemo.project) of that point from the run's own measured compute time: with the
links' nominal rate and LATENCY_MS, and with the latency and rate each way that `flexdemo bench
link` measured on the same cluster (<rate>/<nodes>/link.json), where there is one; and with
that link and each step's compute paced by the slowest rank: the model's nodes are identical,
where here the ranks share the machine's cores and every step waits at its one collective over
the world (the agreement on finite gradients) for the last rank to arrive. That wait is measured
where no bytes cross between nodes: the local-10 run's steps without an exchange (their mean
time waiting for collectives), and added to each run's compute at the same rate and nodes.

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


def sync_wait_ms(run):
    """The mean time a step waits for collectives where no bytes cross between nodes (the
    local-steps run's steps without an exchange), or None without that run."""
    if not os.path.isfile(os.path.join(run, "metrics.jsonl")):
        return None
    steps = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    idle = [m["comm_ms"] for m in steps
            if "step_ms" in m and m["step"] > 10 and m["inter_collectives"] == 0]
    return statistics.fmean(idle) if idle else None


def main():
    root, latency_ms = sys.argv[1], float(sys.argv[2])
    sizes_of = {}
    links = {}  # (rate, nodes): (the bench link probe's JSON, a step's wait without an exchange)
    rows = []
    for rate in sorted(os.listdir(root)):
        if not os.path.isdir(os.path.join(root, rate)):
            continue
        for nodes in sorted(os.listdir(os.path.join(root, rate)), key=int):
            probe = os.path.join(root, rate, nodes, "link.json")
            if os.path.isfile(probe):
                links[(rate, int(nodes))] = (json.load(open(probe)),
                                             sync_wait_ms(os.path.join(root, rate, nodes,
                                                                       "local-10")))
            p, wait_ms = links.get((rate, int(nodes)), (None, None))
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
                compute_s = m["compute_ms"] / 1000
                link = project.Link(rate_gbit(rate) * 1e9 / 8, latency_ms / 1000)
                got_bytes = project.exchange_cost(KIND[name], n, s, h)[0]
                got_ms = 1000 * project.step_seconds(KIND[name], n, s, h, link, compute_s, False)
                probed_ms = None
                if p is not None:
                    probed = project.Link(p["rate_mbit"] * 1e6 / 8, p["latency_ms"] / 1000)
                    probed_ms = 1000 * project.step_seconds(KIND[name], n, s, h, probed,
                                                            compute_s, False)
                paced_ms = None
                if probed_ms is not None and wait_ms is not None:
                    paced_ms = 1000 * project.step_seconds(KIND[name], n, s, h, probed,
                                                           compute_s + wait_ms / 1000, False)
                rows.append((rate, n, name, m, got_bytes, got_ms, probed_ms, paced_ms))
    print(f"Measured (mean of each run's steps after the first 10) against projected "
          f"(python -m flexdemo.project's model from the run's own compute time; with the "
          f"nominal rate and latency {latency_ms:g} ms a message, and with the link as "
          f"`flexdemo bench link` measured it). Bytes are per node per step.\n")
    print("| rate | nodes | exchange | bytes sent | bytes received | projected bytes | "
          "compute ms | step ms | projected (nominal link) | error | projected (probed link) "
          "| error | projected (probed link, paced by the slowest rank) | error |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    error = lambda got, m: f"{100 * (got / m['step_ms'] - 1):+.1f}%"  # noqa: E731
    cell = lambda got, m: "| | " if got is None else f"| {got:.1f} | {error(got, m)} "  # noqa
    for rate, n, name, m, got_bytes, got_ms, probed_ms, paced_ms in rows:
        probed = cell(probed_ms, m) + cell(paced_ms, m)
        print(f"| {rate} | {n} | {name} | {m['sent']:,.0f} | {m['recv']:,.0f} | "
              f"{got_bytes:,.0f} | {m['compute_ms']:.1f} | {m['step_ms']:.1f} | {got_ms:.1f} | "
              f"{error(got_ms, m)} {probed}|")
    if links:
        some = next(iter(links.values()))[0]
        print("\nThe links as `flexdemo bench link` measured them (one rank a node; latency: a "
              "1-byte all-gather over its n - 1 messages; rate: a ring shift of "
              f"{some['ring_shift_bytes']:,} bytes, each link loaded both ways):\n")
        print("| rate | nodes | latency ms a message | rate each way, Mbit/s | a step's wait "
              "without an exchange, ms |")
        print("|---|---:|---:|---:|---:|")
        for (rate, n), (p, wait) in links.items():
            print(f"| {rate} | {n} | {p['latency_ms']:.3f} | {p['rate_mbit']:.1f} | "
                  + ("" if wait is None else f"{wait:.1f}") + " |")


if __name__ == "__main__":
    main()
