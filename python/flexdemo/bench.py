"""The optimizer step, one run: flexdemo's engine (``DeMo.step``, the reference DeMo step, and
``FlexDeMo.step`` with its defaults) against torch's AdamW (its default, foreach, and fused where
available) and against the same DeMo step in plain torch ops (op for op as the reference DeMo
computes it, and a tighter rewrite of it), on GPT-2 small's parameter shapes scaled by --scale
(0.25: 3.8M parameters).

    python -m flexdemo.bench [--scale 0.25] [--threads 1] [--device cpu|cuda] [--replicas 2]
                             [--rounds 3] [--json FILE]

Both flexdemo steps run on one replica (no process group: nothing crosses a network, the
payloads are still encoded, screened and decoded): ``DeMo.step`` at --topk and --values, the
reference DeMo's step, which the ratios compare; ``FlexDeMo.step`` with its defaults (each
gradient preconditioned, top-k 112 at fp8, the RMS-capped step). The plain-torch baselines decode
--replicas copies of their payload. Times are medians of --repeats steps after --warmup; the
ratios are of this run. Every line is timed in each of --rounds rounds, one line after another,
and reports the median of its rounds.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time

import torch

from . import ops
from .optim import DeMo, FlexDeMo
from .reference import CompactTorchDeMo, ReferenceTorchDeMo


def gpt2_shapes(scale: float):
    """GPT-2 small's parameters (vocab 50304, width 768, context 1024, 12 layers), scaled."""
    vocab, d = round(50304 * scale), round(768 * scale)
    context, layers = round(1024 * scale), max(1, int(12 * scale))
    shapes = [(vocab, d), (context, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d),
                   (4 * d,), (d, 4 * d), (d,)]
    return shapes + [(d,), (d,)]


def params_of(shapes, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    params = []
    for s in shapes:
        p = torch.nn.Parameter((torch.randn(s, generator=g) * 0.02).to(device))
        p.grad = (torch.randn(s, generator=g) * 1e-3).to(device)
        params.append(p)
    return params


def steady_allocator() -> None:
    """glibc's malloc returns large blocks to the system (mmap'd blocks, a trimmed heap top), so
    a step that allocates temporaries (torch's per-tensor AdamW) pays page faults on every call
    until some earlier large free raised the thresholds: the same AdamW step measured 18 ms cold
    and 8.7 ms after another optimizer had run. Keeping freed memory in the heap, as a training
    loop's allocator state soon does, makes every line measure the same steady state."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to pin
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's malloc.h
    libc.mallopt(m_mmap_threshold, 64 << 20)
    libc.mallopt(m_trim_threshold, 256 << 20)


def timed(step, device, warmup, repeats):
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()
    for _ in range(warmup):
        step()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", type=float, default=0.25)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--topk", type=int, default=32)
    p.add_argument("--values", default="bf16", choices=ops.VALUE_ENCODINGS)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", help="also write the times (ms) and ratios to this file")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.repeats < 1:
        p.error("--rounds {} and --repeats {}: each must be at least 1".format(args.rounds,
                                                                             args.repeats))
    steady_allocator()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    shapes = gpt2_shapes(args.scale)
    numel = sum(torch.Size(s).numel() for s in shapes)
    print("GPT-2 shapes x {}: {} tensors, {:,} parameters; {} thread(s), {}; DeMo: top-k {} of "
          "{}x{} chunks, {}; plain-torch: {} replicas' payloads decoded".format(
              args.scale, len(shapes), numel, args.threads, device, args.topk, args.chunk,
              args.chunk, args.values, args.replicas), flush=True)
    if device.type == "cuda" and not ops.cuda_built():
        raise SystemExit("bench: this flexdemo build has no CUDA kernels")

    # Every line's step is made first, then timed in --rounds rounds, the lines one after another
    # in each: a line's time is the median of its rounds, so that a slower minute of a shared
    # machine falls on every line alike rather than on whichever ran then.
    steppers = []
    demo = DeMo(params_of(shapes, device), lr=1e-3, compression_topk=args.topk,
                compression_chunk=args.chunk, values=args.values)
    steppers.append(("DeMo.step (reference step)", demo.step, 1))
    flexdemo_default = FlexDeMo(params_of(shapes, device), lr=1e-3, compression_chunk=args.chunk)
    steppers.append(("FlexDeMo.step (its defaults)", flexdemo_default.step, 1))
    # torch's default picks the per-tensor loop for CPU tensors and foreach for CUDA ones.
    adamw_kinds = [("default", {}), ("foreach", dict(foreach=True)), ("fused", dict(fused=True))]
    for name, kwargs in adamw_kinds:
        params = params_of(shapes, device)
        try:
            opt = torch.optim.AdamW(params, lr=1e-3, **kwargs)
            opt.step()  # an unsupported kind says so here
            steppers.append(("torch AdamW ({})".format(name), opt.step, 1))
        except (RuntimeError, ValueError) as e:
            print("torch AdamW ({}): not available here ({})".format(name, e))
    for name, kind in (("plain-torch DeMo (reference)", ReferenceTorchDeMo),
                       ("plain-torch DeMo (compact)", CompactTorchDeMo)):
        plain = kind(params_of(shapes, device), args.chunk, args.topk, replicas=args.replicas)
        steppers.append((name, lambda plain=plain: plain.step(1e-3), 4))  # slow: fewer steps
    times = {name: [] for name, _, _ in steppers}
    for _ in range(args.rounds):
        for name, step, fewer in steppers:
            warmup, repeats = args.warmup, args.repeats
            if fewer > 1:
                warmup, repeats = max(1, warmup // fewer), max(3, repeats // fewer)
            times[name].append(timed(step, device, warmup, repeats))
    rows = [(name, statistics.median(times[name])) for name, _, _ in steppers]

    ours = rows[0][1]
    print("\n{:<30} {:>10} {:>16}".format("step", "ms", "vs flexdemo"))
    for name, seconds in rows:
        print("{:<30} {:>10.2f} {:>15.2f}x".format(name, seconds * 1e3, seconds / ours))
    adamw = min(s for n, s in rows if n.startswith("torch AdamW"))
    default = dict(rows)["torch AdamW (default)"]
    reference, compact = rows[-2][1], rows[-1][1]
    flex = dict(rows)["FlexDeMo.step (its defaults)"]
    print("\nDeMo.step / torch AdamW default: {:.2f}x, / fastest: {:.2f}x; plain-torch DeMo / "
          "DeMo.step: {:.1f}x (the reference's ops), {:.1f}x (compact)".format(
              ours / default, ours / adamw, reference / ours, compact / ours))
    print("FlexDeMo.step (its defaults) / torch AdamW default: {:.2f}x".format(flex / default))
    if args.json:
        report = {name: seconds * 1e3 for name, seconds in rows}
        report.update(params=numel, device=str(device), threads=args.threads,
                      flexdemo_defaults_over_default_adamw=flex / default,
                      flexdemo_over_default_adamw=ours / default,
                      flexdemo_over_fastest_adamw=ours / adamw,
                      plain_torch_over_flexdemo=reference / ours,
                      compact_torch_over_flexdemo=compact / ours)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
