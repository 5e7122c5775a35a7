"""Run by test_engine.py under ``torchrun --nproc-per-node 3`` (gloo, CPU): 3 replicas.

flexdemo's engine, driven by FlexDeMo / DeMo over a real process group, against DeMo written in
float64 (float64_demo.py): each replica starts from its own residual history and gradients; every
rank all-gathers what each replica held (residual before and after, gradient) and checks
- every value encoding: only the top-k left each residual, as the encoding decodes it, and the
  step is sign-SGD on the replicas' mean per coefficient, inverse-transformed;
- the SGD step with sign off: the direction scaled down to rms_cap where above it, then clamped
  to step_bound;
- AdamW on the direction or its sign, bias-corrected at the step the state was restored to;
- faulty peers: replica 1 tampered (1000x, NaN, corrupt) is left out of the mean on every
  replica alike and counted, or stops every replica (peer_policy stop).
Raises AssertionError (a non-zero exit) on the first failure.
"""

import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import flexdemo  # noqa: E402
from float64_demo import Reference  # noqa: E402

CHUNK, TOPK, DECAY, LR, WD = 16, 6, 0.9, 0.01, 0.1
# [48, 40] -> chunks 16 x 10 (divisors), [30] -> 1 x 15, [4, 6, 5] as [4, 30] -> 4 x 15.
SHAPES = [(48, 40), (30,), (4, 6, 5)]


def quantisation_ok(values, sent, encoding):
    """sent (what the receiver decodes) is `values` in this encoding: per chunk row."""
    err = (sent - values).abs()
    if encoding == "fp32":
        return bool((err <= values.abs() * 2.0 ** -22 + 1e-12).all())
    if encoding == "bf16":
        return bool((err <= values.abs() * 2.0 ** -8 + 1e-12).all())
    if encoding == "fp8":  # e4m3 of v / scale, scale = max|v| / 448 per chunk
        scale = values.abs().amax(dim=1, keepdim=True) / 448
        return bool((err <= values.abs() * 2.0 ** -4 + scale * 2.0 ** -9 + 1e-9).all())
    if encoding == "int8":  # round(v / scale), scale = max|v| / 127 per chunk
        scale = values.abs().amax(dim=1, keepdim=True) / 127
        return bool((err <= scale * 0.5 + 1e-7).all())
    if encoding == "1bit":  # sign(v) * mean|v| per chunk
        want = values.sign() * values.abs().mean(dim=1, keepdim=True)
        return bool(((sent - want).abs() <= 1e-6 * want.abs() + 1e-12).all())
    if encoding == "2bit":  # sign(v) times one of two magnitudes per chunk
        signs = bool((sent.sign() == values.sign()).all())
        levels = all(len(torch.unique((row.abs() / row.abs().max() * 1e4).round())) <= 2
                     for row in sent)
        return signs and levels
    raise AssertionError(encoding)


def gathered(t):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def residual_of(opt, p):
    return next(v for k, v in opt.state[p].items() if k.startswith("residual."))


def one_step(opt, params, seed):
    """This replica's residual history (random) and gradients, one step; per tensor and
    replica (residual before, after, gradient) as every replica sees them."""
    g = torch.Generator().manual_seed(100 + seed)
    history = []
    for p in params:
        r = residual_of(opt, p)
        r.copy_(torch.randn(r.shape, generator=g) * 0.01)
        history.append(r.clone())
        p.grad = torch.randn(p.shape, generator=g)
    grads = [p.grad.clone() for p in params]
    opt.step()
    after = [residual_of(opt, p).clone() for p in params]
    return [list(zip(gathered(b), gathered(a), gathered(gr)))
            for b, a, gr in zip(history, after, grads)]


def sent_of(ref, before, after, grad, encoding=None):
    """What left a replica's residual: the top-k of its accumulated coefficients."""
    accumulated = DECAY * ref.dct_block(before.double()) + LR * ref.dct(grad)
    chosen = ref.topk(accumulated)
    sent = accumulated - ref.dct_block(after.double())
    mask = torch.zeros_like(sent, dtype=torch.bool).scatter_(1, chosen, True)
    assert sent[~mask].abs().max().item() < 1e-6, "non-selected coefficients changed"
    if encoding is not None:
        assert quantisation_ok(accumulated.gather(1, chosen), sent.gather(1, chosen), encoding), \
            encoding
    return chosen, sent.gather(1, chosen)


def direction(ref, replicas, encoding=None, kept=None):
    """The replicas' mean per coefficient (of the replicas that sent it), transformed back."""
    total = torch.zeros(ref.rows // ref.h * (ref.cols // ref.w), ref.h * ref.w,
                        dtype=torch.float64)
    count = torch.zeros_like(total)
    for r, (before, after, grad) in enumerate(replicas):
        if kept is not None and r not in kept:
            continue
        chosen, sent = sent_of(ref, before, after, grad, encoding)
        total.scatter_add_(1, chosen, sent)
        count.scatter_add_(1, chosen, torch.ones_like(sent))
    return ref.idct(total / count.clamp(min=1))


def fresh_params(seed=0):
    g = torch.Generator().manual_seed(seed)  # the same on every replica
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def check_encodings():
    for values in flexdemo.ops.VALUE_ENCODINGS:
        params = fresh_params()
        start = [p.detach().double().clone() for p in params]
        opt = flexdemo.DeMo(params, compression_decay=DECAY, compression_topk=TOPK,
                            compression_chunk=CHUNK, weight_decay=WD, lr=LR, values=values)
        history = one_step(opt, params, dist.get_rank())
        for s, p, p0, replicas in zip(SHAPES, params, start, history):
            ref = Reference(s, CHUNK, TOPK)
            d = direction(ref, replicas, values)
            want = (1 - LR * WD) * p0.reshape(d.shape) - LR * d.sign()
            clear = d.abs() > 1e-5 * d.abs().max()  # sign() certain
            got = p.detach().double().reshape(d.shape)
            assert torch.allclose(got[clear], want[clear], rtol=0, atol=1e-6), (values, s)


def check_bounded_sgd():
    for bound, cap in ((0.0, 0.0), ("median", 0.0), (0.0, "half"), ("median", "half"),
                       (0.0, "twice")):
        for t, s in enumerate(SHAPES):
            # The direction first, from a run without bounds; then the same step bounded.
            ds = []
            for b, c in ((0.0, 0.0), (bound, cap)):
                if ds:
                    d = ds[0]
                    rms = d.pow(2).mean().sqrt().item()
                    c = {0.0: 0.0, "half": rms / 2, "twice": rms * 2}[c]
                    g = d * (c / rms) if 0 < c < rms else d
                    b = g.abs().median().item() if b == "median" else 0.0
                p = fresh_params()[t]
                p0 = p.detach().double().clone()
                opt = flexdemo.FlexDeMo([p], lr=LR, weight_decay=WD, compression_decay=DECAY,
                                        compression_topk=TOPK, compression_chunk=CHUNK,
                                        values="fp32", precondition=False, fold_lr=True,
                                        step_bound=b, rms_cap=c)
                history = one_step(opt, [p], dist.get_rank())
                ref = Reference(s, CHUNK, TOPK)
                ds.append(direction(ref, history[0]))
            d = ds[1]
            g = d * (c / rms) if 0 < c < rms else d
            g = g.clamp(-b, b) if b > 0 else g
            want = (1 - LR * WD) * p0.reshape(d.shape) - LR * g
            got = p.detach().double().reshape(d.shape)
            assert torch.allclose(got, want, rtol=0, atol=1e-6), (bound, cap, s)


def check_adamw():
    for sign in (True, False):
        params = fresh_params()
        opt = flexdemo.FlexDeMo(params, inner="adamw", lr=LR, weight_decay=WD,
                                compression_decay=DECAY, compression_topk=TOPK,
                                compression_chunk=CHUNK, values="fp32", sign=sign,
                                betas=(0.9, 0.95))
        g = torch.Generator().manual_seed(7)
        m0, v0 = [], []
        for p in params:
            opt.state[p]["exp_avg"].copy_(torch.randn(p.shape, generator=g).reshape(
                opt.state[p]["exp_avg"].shape) * 0.01)
            opt.state[p]["exp_avg_sq"].copy_(torch.rand(p.shape, generator=g).reshape(
                opt.state[p]["exp_avg_sq"].shape) * 1e-4)
            m0.append(opt.state[p]["exp_avg"].double().clone())
            v0.append(opt.state[p]["exp_avg_sq"].double().clone())
        for engine in opt._engines:  # two exchanges done: this step is the third
            engine.restore_steps(2)
        start = [p.detach().double().clone() for p in params]
        history = one_step(opt, params, dist.get_rank())
        step, b1, b2, eps = 3, 0.9, 0.95, 1e-8
        for s, p, p0, m, v, replicas in zip(SHAPES, params, start, m0, v0, history):
            ref = Reference(s, CHUNK, TOPK)
            d = direction(ref, replicas)
            u = d.sign() if sign else d
            m_ref = b1 * m.reshape(d.shape) + (1 - b1) * u
            v_ref = b2 * v.reshape(d.shape) + (1 - b2) * u * u
            denom = (v_ref / (1 - b2 ** step)).sqrt() + eps
            p_ref = p0.reshape(d.shape) * (1 - LR * WD) - LR * (m_ref / (1 - b1 ** step)) / denom
            clear = d.abs() > 1e-5 * d.abs().max()
            got = p.detach().double().reshape(d.shape)
            assert torch.allclose(got[clear], p_ref[clear], atol=1e-5), (sign, s)
            got_m = opt.state[p]["exp_avg"].double().reshape(d.shape)
            assert torch.allclose(got_m[clear], m_ref[clear], atol=1e-6), (sign, s)


def check_faulty_peer():
    for how, factor in (("scale", 1000.0), ("scale", float("nan")), ("corrupt", 1.0)):
        params = fresh_params()
        start = [p.detach().double().clone() for p in params]
        opt = flexdemo.DeMo(params, compression_decay=DECAY, compression_topk=TOPK,
                            compression_chunk=CHUNK, lr=LR, values="bf16")
        if dist.get_rank() == 1:
            opt.tamper_next_exchange(how, factor)
        history = one_step(opt, params, dist.get_rank())
        assert opt.peers_left_out == 1, (how, factor, opt.peers_left_out)
        for s, p, p0, replicas in zip(SHAPES, params, start, history):
            d = direction(Reference(s, CHUNK, TOPK), replicas, kept=(0, 2))
            clear = d.abs() > 1e-5 * d.abs().max()
            want = p0.reshape(d.shape) - LR * d.sign()
            got = p.detach().double().reshape(d.shape)
            assert torch.allclose(got[clear], want[clear], rtol=0, atol=1e-6), (how, s)
        mine = torch.cat([p.detach().reshape(-1) for p in params])
        assert all(torch.equal(mine, other) for other in gathered(mine)), how
    params = fresh_params()
    opt = flexdemo.DeMo(params, compression_chunk=CHUNK, compression_topk=TOPK,
                        on_bad_peer="stop")
    if dist.get_rank() == 1:
        opt.tamper_next_exchange("corrupt")
    for p in params:
        p.grad = torch.randn(p.shape)
    try:
        opt.step()
        raise AssertionError("peer_policy stop did not stop")
    except RuntimeError as e:
        assert "replica 1 sent tensor 0 a corrupt payload" in str(e), e


def main():
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    check_encodings()
    check_bounded_sgd()
    check_adamw()
    check_faulty_peer()
    dist.barrier()
    dist.destroy_process_group()
    if int(os.environ["RANK"]) == 0:
        print("engine checks: all passed")


if __name__ == "__main__":
    main()
