"""Projects a data-parallel step onto many nodes: step time and bytes per node for each way of
exchanging between nodes, from a model's size, a step's compute time and the links.

    python -m flexdemo.project --model gpt2-small --compute-ms 120 \
        [--nodes 8,16,...,1024] [--rate-gbit 1,10,100] [--latency-ms 0.05] \
        [--topk 32] [--chunk 64] [--values bf16] [--inner-steps 10] [--overlap] [--json FILE]

The model: one of flexdemo's presets (gpt-nano, gpt-micro), gpt2-small (transformers' GPT2Config
defaults, 124M parameters), llama-1b (Llama 3.2 1B's shapes, 1.24B), a transformers config.json
(its file or folder), or --params N (N parameters in 64 x 64 chunks). Its shapes are built on
torch's meta device, so no memory is taken; a DeMo payload's bytes come from flexdemo's own wire
format (ops.payload_bytes), so they are the bytes flexdemo sends.

The compute time of a step (forward, backward, the optimizer and the exchange inside a node) is
--compute-ms, measured; or it is estimated as 6 x parameters x --tokens-per-node FLOPs over
--ranks-per-node accelerators of --tflops at --mfu (the estimate is printed with its inputs).

The exchanges between nodes, per step and per node (N nodes, G the dense gradient's bytes, P one
node's DeMo payload for the whole model; each node one full-duplex link of the rate to a switch
that does not block, each message in a collective's sequence costing --latency-ms):

    allreduce-ring   2 (N-1)/N G bytes each way, 2 (N-1) messages (AdamW-HSDP)
    allreduce-tree   2 G bytes each way, 2 ceil(log2 N) messages (a double binary tree)
    allgather        (N-1) P bytes each way, N-1 messages (FlexDeMo's DeMo exchange)
    owner            2 (N-1)/N P bytes each way, 2 (N-1) messages (each node owns 1/N of the
                     chunks: an all-to-all to the owners, then an all-gather of their top-k)
    local-H          the all-gather every --inner-steps steps: (N-1) P / H each way per step
    diloco-H         the ring all-reduce every --inner-steps steps: 2 (N-1)/N G / H

A step takes compute + exchange, or max(compute, exchange) with --overlap. The crossover of a
DeMo exchange is the fewest nodes at which its step takes longer than the dense all-reduce's (the
faster of ring and tree there).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch

from . import ops

# flexdemo's own GPT presets (flexdemo train --model; docs/command.md): width, layers, heads,
# context, with flexdemo's default BPE vocabulary of 4096. Their parameters carry GPT2LMHeadModel's
# names and shapes, so transformers builds the same tensors.
_FLEXDEMO_GPT = {"gpt-nano": (128, 4, 4, 128), "gpt-micro": (256, 4, 4, 256)}
_LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                 num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                 max_position_embeddings=131072, tie_word_embeddings=True)
MODELS = ("gpt-nano", "gpt-micro", "gpt2-small", "llama-1b")
DENSE = ("allreduce-ring", "allreduce-tree")
COMPRESSED = ("allgather", "owner", "local")  # DeMo's payloads: the ones with a crossover
EXCHANGES = DENSE + COMPRESSED + ("diloco",)


def model_shapes(model: Optional[str], params: Optional[int]) -> List[List[int]]:
    """The shapes of a model's parameters (tied ones once)."""
    if params is not None:
        if params < 4096:
            raise ValueError(f"--params {params}: give at least 4096 parameters")
        return [[math.ceil(params / 4096) * 64, 64]]
    import transformers  # only for a named or a config model

    if model in _FLEXDEMO_GPT:
        width, layers, heads, context = _FLEXDEMO_GPT[model]
        config = transformers.GPT2Config(n_embd=width, n_layer=layers, n_head=heads,
                                         n_positions=context, vocab_size=4096,
                                         bos_token_id=0, eos_token_id=0)
    elif model == "gpt2-small":
        config = transformers.GPT2Config()
    elif model == "llama-1b":
        config = transformers.LlamaConfig(**_LLAMA_1B)
    elif model and os.path.exists(model):
        config = transformers.AutoConfig.from_pretrained(model)
    else:
        raise ValueError(f"--model {model!r}: give one of {', '.join(MODELS)}, "
                         "a transformers config.json (file or folder), or --params N")
    with torch.device("meta"):
        if config.is_encoder_decoder:
            net = transformers.AutoModelForSeq2SeqLM.from_config(config)
        else:
            net = transformers.AutoModelForCausalLM.from_config(config)
    return [list(p.shape) for p in net.parameters()]


@dataclass
class Sizes:
    params: int
    dense_bytes: int    # G: the gradient a dense all-reduce exchanges
    payload_bytes: int  # P: one node's DeMo payload, every tensor


def sizes(shapes: Sequence[Sequence[int]], grad_bytes: int, chunk: int, topk: int,
          values: str) -> Sizes:
    tensors = [torch.empty(s, device="meta") for s in shapes]
    n = sum(t.numel() for t in tensors)
    payload = sum(ops.payload_bytes(tensors, chunk, "divisor", topk, values))
    return Sizes(n, n * grad_bytes, payload)


@dataclass
class Link:
    rate_bytes_per_s: float
    latency_s: float


def exchange_cost(kind: str, n: int, s: Sizes, h: int):
    """(bytes each way per node per step, messages per step) of one exchange on n nodes."""
    g, p = s.dense_bytes, s.payload_bytes
    if n == 1:
        return 0.0, 0.0
    if kind == "allreduce-ring":
        return 2 * (n - 1) / n * g, 2 * (n - 1)
    if kind == "allreduce-tree":
        return 2 * g, 2 * math.ceil(math.log2(n))
    if kind == "allgather":
        return (n - 1) * p, n - 1
    if kind == "owner":
        return 2 * (n - 1) / n * p, 2 * (n - 1)
    if kind == "local":
        return (n - 1) * p / h, (n - 1) / h
    if kind == "diloco":
        return 2 * (n - 1) / n * g / h, 2 * (n - 1) / h
    raise ValueError(f"exchange {kind!r}: one of {', '.join(EXCHANGES)}")


def step_seconds(kind: str, n: int, s: Sizes, h: int, link: Link, compute_s: float,
                 overlap: bool) -> float:
    nbytes, messages = exchange_cost(kind, n, s, h)
    exchange = nbytes / link.rate_bytes_per_s + messages * link.latency_s
    return max(compute_s, exchange) if overlap else compute_s + exchange


def crossover(kind: str, s: Sizes, h: int, link: Link, compute_s: float, overlap: bool,
              limit: int = 1 << 20) -> Optional[int]:
    """The fewest nodes (2..limit) at which `kind`'s step is slower than the dense all-reduce's
    (the faster of ring and tree at that many nodes); None when it is not slower up to limit."""
    def slower(n):
        dense = min(step_seconds(d, n, s, h, link, compute_s, overlap) for d in DENSE)
        return step_seconds(kind, n, s, h, link, compute_s, overlap) > dense
    if not slower(limit):
        return None
    lo, hi = 2, limit  # exchange minus all-reduce grows with n: the first n where it is slower
    while lo < hi:
        mid = (lo + hi) // 2
        if slower(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def label(kind: str, h: int) -> str:
    return f"{kind}-{h}" if kind in ("local", "diloco") else kind


def project(args) -> Dict:
    s = sizes(model_shapes(args.model, args.params), args.grad_bytes, args.chunk, args.topk,
              args.values)
    if args.compute_ms is not None:
        compute_s = args.compute_ms / 1000
        compute = f"{args.compute_ms:g} ms a step (given)"
    else:
        flops = 6 * s.params * args.tokens_per_node
        compute_s = flops / (args.ranks_per_node * args.tflops * 1e12 * args.mfu)
        compute = (f"{1000 * compute_s:.1f} ms a step: 6 x {s.params:,} parameters x "
                   f"{args.tokens_per_node:,} tokens a node over {args.ranks_per_node} "
                   f"accelerators of {args.tflops:g} TFLOPS at MFU {args.mfu:g}")
    result = {"params": s.params, "dense_bytes": s.dense_bytes, "payload_bytes": s.payload_bytes,
              "compute": compute, "compute_s": compute_s, "rates": []}
    for gbit in args.rate_gbit:
        link = Link(gbit * 1e9 / 8, args.latency_ms / 1000)
        rows = []
        for n in args.nodes:
            rows.append({"nodes": n, **{
                label(k, args.inner_steps): {
                    "bytes": exchange_cost(k, n, s, args.inner_steps)[0],
                    "step_s": step_seconds(k, n, s, args.inner_steps, link, compute_s,
                                           args.overlap)} for k in EXCHANGES}})
        result["rates"].append({
            "gbit": gbit, "rows": rows,
            "crossover": {label(k, args.inner_steps): crossover(
                k, s, args.inner_steps, link, compute_s, args.overlap)
                for k in COMPRESSED}})
    return result


def markdown(result: Dict, args) -> str:
    kinds = [label(k, args.inner_steps) for k in EXCHANGES]
    out = [f"{result['params']:,} parameters; dense gradient {result['dense_bytes']:,} bytes; "
           f"DeMo payload {result['payload_bytes']:,} bytes a node (top-k {args.topk} of "
           f"{args.chunk} x {args.chunk}, {args.values}; "
           f"{result['dense_bytes'] / result['payload_bytes']:.0f}x fewer); compute "
           f"{result['compute']}; latency {args.latency_ms:g} ms a message; "
           f"{'exchange overlapped with compute' if args.overlap else 'exchange after compute'}.",
           ""]
    for rate in result["rates"]:
        out += [f"**{rate['gbit']:g} Gbit/s**: step time in ms (MB sent per node per step)", "",
                "| nodes | " + " | ".join(kinds) + " |", "|---:|" + "---:|" * len(kinds)]
        for row in rate["rows"]:
            out.append(f"| {row['nodes']:,} | " + " | ".join(
                f"{1000 * row[k]['step_s']:,.1f} ({row[k]['bytes'] / 1e6:,.2f})"
                for k in kinds) + " |")
        out += ["", "Crossover against the dense all-reduce (the fewest nodes at which the step "
                "is slower than the faster of ring and tree): " + "; ".join(
                    f"{k} {'none to ' + format(1 << 20, ',') if n is None else format(n, ',')}"
                    for k, n in rate["crossover"].items()), ""]
    return "\n".join(out)


def positive_list(kind):
    def parse(text):
        try:
            values = [kind(v) for v in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated numbers")
        if not values or any(v <= 0 for v in values):
            raise argparse.ArgumentTypeError(f"{text!r}: every value must be > 0")
        return values
    return parse


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flexdemo.project",
                                 description=__doc__.split("\n\n")[0])
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", help=f"{', '.join(MODELS)}, or a transformers config.json")
    which.add_argument("--params", type=int, help="a parameter count instead of a model")
    ap.add_argument("--compute-ms", type=float,
                    help="a step's measured compute time (else estimated from --tflops)")
    ap.add_argument("--tokens-per-node", type=int, default=524288,
                    help="tokens a node processes a step (for the estimate)")
    ap.add_argument("--tflops", type=float, default=989.0,
                    help="an accelerator's peak dense TFLOPS (989: H200 bf16)")
    ap.add_argument("--mfu", type=float, default=0.4, help="the fraction of peak reached")
    ap.add_argument("--ranks-per-node", type=int, default=8, help="accelerators a node")
    ap.add_argument("--nodes", type=positive_list(int),
                    default=[2, 4, 8, 16, 32, 64, 128, 256, 512, 1024])
    ap.add_argument("--rate-gbit", type=positive_list(float), default=[1.0, 10.0, 100.0],
                    help="each node's link to the others, Gbit/s (comma-separated)")
    ap.add_argument("--latency-ms", type=float, default=0.05, help="one message's latency")
    ap.add_argument("--grad-bytes", type=int, default=4, choices=(2, 4),
                    help="bytes of a dense gradient's element (4: float32)")
    ap.add_argument("--topk", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--values", default="bf16", choices=ops.VALUE_ENCODINGS)
    ap.add_argument("--inner-steps", type=int, default=10,
                    help="H of the local-H and diloco-H exchanges")
    ap.add_argument("--overlap", action="store_true",
                    help="the exchange hidden behind compute: a step is the longer of the two")
    ap.add_argument("--json", help="also write the projection to this file")
    args = ap.parse_args(argv)
    for name in ("topk", "chunk", "inner_steps", "tokens_per_node", "ranks_per_node"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    for name in ("tflops", "mfu"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name} {getattr(args, name)}: must be > 0")
    if args.compute_ms is not None and args.compute_ms < 0:
        ap.error(f"--compute-ms {args.compute_ms}: must be >= 0")
    if args.latency_ms < 0:
        ap.error(f"--latency-ms {args.latency_ms}: must be >= 0")
    try:
        result = project(args)
    except ValueError as e:
        print(f"flexdemo.project: {e}", file=sys.stderr)
        return 2
    print(markdown(result, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
