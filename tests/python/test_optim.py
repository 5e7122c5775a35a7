"""flexdemo.DeMo against the reference DeMo's update rule (its step, written here in float64 on
the same tensors), and FlexDeMo's answers to bad input."""

import copy
import logging

import pytest
import torch

import flexdemo
from float64_demo import Reference
from flexdemo.reference import CompactTorchDeMo, ReferenceTorchDeMo

CHUNK, TOPK, DECAY, LR, WD = 8, 4, 0.95, 0.01, 0.05


def reference_demo_step(params, grads, deltas, weight_decay=WD):
    """The reference DeMo's step for one replica (its all-gather returns its own payload):
    weight decay, delta = decay * delta + lr * grad, the chunked DCT's top-k transmitted and
    taken out of delta, and sign-SGD on the decoded transmission."""
    for p, g, delta in zip(params, grads, deltas):
        ref = Reference(tuple(p.shape), CHUNK, TOPK)
        p.mul_(1 - LR * weight_decay)
        delta.mul_(DECAY).add_(g.double(), alpha=LR)
        coeffs = ref.dct(delta)
        chosen = ref.topk(coeffs)
        kept = torch.zeros_like(coeffs).scatter_(1, chosen, coeffs.gather(1, chosen))
        transmitted = ref.idct(kept).reshape(p.shape)
        delta.sub_(transmitted)
        p.sub_(LR * transmitted.sign())
        yield transmitted


def test_demo_follows_the_reference_rule():
    torch.manual_seed(0)
    shapes = [(32, 24), (24,), (16, 3, 4)]
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    opt = flexdemo.DeMo(params, compression_decay=DECAY, compression_topk=TOPK,
                        compression_chunk=CHUNK, weight_decay=WD, lr=LR)
    ref_params = [p.detach().double().clone() for p in params]
    deltas = [torch.zeros(s, dtype=torch.float64) for s in shapes]
    for step in range(4):
        grads = [torch.randn(s) for s in shapes]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        transmitted = list(reference_demo_step(ref_params, grads, deltas))
        for p, r, t in zip(params, ref_params, transmitted):
            clear = t.abs() > 1e-5 * t.abs().max()  # where sign() is certain
            assert torch.allclose(p.detach().double()[clear], r[clear], atol=1e-5), step
            r[~clear] = p.detach().double()[~clear]  # follow flexdemo where it is not
    assert opt.data_transmit == opt.bucket_bytes > 0


def test_flexdemo_default_step_follows_float64():
    """FlexDeMo's default step, written here in float64: each gradient divided by the root of its
    bias-corrected running mean square (+ eps), entering the residual unscaled; the chunked DCT's
    top-k transmitted (fp32 here) and taken out; the step lr times the transmission, scaled down
    to RMS 1 per tensor where above it, after decoupled weight decay."""
    torch.manual_seed(2)
    shapes = [(32, 24), (24,), (16, 3, 4)]
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    opt = flexdemo.FlexDeMo(params, lr=LR, compression_decay=DECAY, compression_topk=TOPK,
                            compression_chunk=CHUNK, values="fp32", weight_decay=WD)
    assert (opt.sign, opt.precondition, opt.fold_lr, opt.rms_cap, opt.step_bound) == (
        False, True, False, 1.0, 0.0)
    ref_params = [p.detach().double().clone() for p in params]
    deltas = [torch.zeros(s, dtype=torch.float64) for s in shapes]
    sq = [torch.zeros(s, dtype=torch.float64) for s in shapes]
    beta2, eps = 0.999, 1e-8
    capped = []
    for step in range(1, 5):
        grads = [torch.randn(s) * 10 ** (step - 2) for s in shapes]  # bounds reached late
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        for p, r, g, delta, v in zip(params, ref_params, grads, deltas, sq):
            ref = Reference(tuple(p.shape), CHUNK, TOPK)
            v.mul_(beta2).add_((1 - beta2) * g.double() ** 2)
            delta.mul_(DECAY).add_(g.double() / ((v / (1 - beta2 ** step)).sqrt() + eps))
            coeffs = ref.dct(delta)
            chosen = ref.topk(coeffs)
            kept = torch.zeros_like(coeffs).scatter_(1, chosen, coeffs.gather(1, chosen))
            transmitted = ref.idct(kept).reshape(p.shape)
            delta.sub_(transmitted)
            rms = transmitted.pow(2).mean().sqrt().item()
            capped.append(rms > 1)
            r.mul_(1 - LR * WD).sub_(LR * (transmitted / rms if rms > 1 else transmitted))
            assert torch.allclose(p.detach().double(), r, rtol=0, atol=1e-5), step
    assert any(capped) and not all(capped), "the test must see capped and uncapped steps"


@pytest.mark.parametrize("kind", [ReferenceTorchDeMo, CompactTorchDeMo])
def test_benchmark_baselines_compute_demo(kind):
    """The plain-torch steps flexdemo.bench times against (2 replicas' equal payloads) follow the
    float64 DeMo rule: an honest baseline does the same work."""
    torch.manual_seed(1)
    shapes = [(32, 24), (24,), (40, 16)]
    params = [torch.randn(s, dtype=torch.float64) for s in shapes]
    plain = kind([p.clone() for p in params], CHUNK, TOPK, decay=DECAY, replicas=2)
    ref_params = [p.clone() for p in params]
    deltas = [torch.zeros(s, dtype=torch.float64) for s in shapes]
    for _ in range(3):
        grads = [torch.randn(s, dtype=torch.float64) for s in shapes]
        for p, g in zip(plain.params, grads):
            p.grad = g
        plain.step(LR)
        list(reference_demo_step(ref_params, grads, deltas, weight_decay=0.0))
    for got, want in zip(plain.params, ref_params):
        assert torch.allclose(got, want, rtol=0, atol=1e-12)


def test_flexdemo_trains_a_small_model_without_distributed():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    x = torch.randn(64, 16)
    y = x[:, :1] * 0.5
    for inner in ("sgd", "adamw"):
        opt = flexdemo.FlexDeMo(model.parameters(), lr=3e-3, inner=inner, compression_topk=8,
                                compression_chunk=8, exchange_every=2)
        first = None
        for _ in range(60):
            loss = torch.nn.functional.mse_loss(model(x), y)
            first = first if first is not None else loss.item()
            loss.backward()
            opt.step()
            opt.zero_grad()
        assert loss.item() < 0.5 * first, inner
        assert opt.exchanges == 30


# ====== Bad input: one clear line each ======
def one_param(**kwargs):
    return flexdemo.FlexDeMo([torch.nn.Parameter(torch.zeros(8, 8))], **kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(compression_topk=65, compression_chunk=8),
     "compression_topk 65 exceeds the 64 coefficients of a compression_chunk 8 chunk"),
    (dict(compression_chunk=0), "compression_chunk must be >= 1, got 0"),
    (dict(values="fp16"), "values 'fp16': unknown value encoding 'fp16'; accepted: fp32, bf16"),
    (dict(inner="lion"), "inner 'lion': unknown inner optimizer 'lion'; accepted: sgd, adamw"),
    (dict(lr=0), "lr must be > 0, got 0"),
    (dict(compression_decay=1.0), r"compression_decay must be in \[0, 1\), got 1"),
    (dict(exchange_every=0), "exchange_every must be >= 1, got 0"),
    (dict(on_nonfinite="ignore"), "on_nonfinite 'ignore'; accepted: skip, stop"),
    (dict(on_bad_peer="ignore"), "on_bad_peer 'ignore': unknown peer policy 'ignore'; accepted"),
    (dict(peer_scale_bound=0.5), r"peer_scale_bound must be 0 \(off\) or > 1, got 0.5"),
    (dict(step_bound=-1), r"step_bound must be >= 0 \(0: off\), got -1"),
    (dict(rms_cap=-1), r"rms_cap must be >= 0 \(0: off\), got -1"),
    (dict(sign=True, rms_cap=1.0), "update_rms, step_bound and rms_cap need sign off"),
    (dict(exchange="owners", overlap=True), "exchange owners and overlap exclude each other"),
    (dict(demo_exchange="owners", overlap_step=True),
     "demo_exchange owners and overlap_step exclude each other"),
    (dict(inner_steps=0), "inner_steps must be >= 1, got 0"),
])
def test_bad_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        one_param(**kwargs)


def test_unknown_keyword():
    with pytest.raises(TypeError, match="unknown option 'topk_per_chunk'"):
        one_param(topk_per_chunk=3)


def test_parameters_on_several_devices():
    params = [torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4, device="meta"))]
    with pytest.raises(ValueError, match="parameter 1 is on meta, the others on cpu"):
        flexdemo.FlexDeMo(params)


def test_mixed_dtypes():
    params = [torch.nn.Parameter(torch.zeros(4)),
              torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))]
    with pytest.raises(ValueError, match="tensor 1 is BFloat16 .*; the step updates non-empty "
                                         "contiguous float32 tensors"):
        flexdemo.FlexDeMo(params)


@pytest.mark.parametrize("policy", ["skip", "stop"])
def test_nonfinite_gradient(policy, caplog):
    p = torch.nn.Parameter(torch.ones(8, 8))
    opt = flexdemo.FlexDeMo([p], lr=0.1, on_nonfinite=policy, compression_chunk=8)
    p.grad = torch.full((8, 8), float("nan"))
    if policy == "stop":
        with pytest.raises(FloatingPointError, match="non-finite gradient at step 1"):
            opt.step()
        return
    with caplog.at_level(logging.WARNING, logger="flexdemo"):
        opt.step()
    assert "step 1: non-finite gradient on some rank; the step is skipped" in caplog.text
    assert torch.equal(p.detach(), torch.ones(8, 8)) and opt.nonfinite_steps == 1
    residual = [v for k, v in opt.state[p].items() if k.startswith("residual")][0]
    assert torch.isfinite(residual).all()


def test_state_dict_round_trip():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(16, 16))
    opt = flexdemo.FlexDeMo([p], inner="adamw", compression_chunk=8)
    for _ in range(3):
        p.grad = torch.randn(16, 16)
        opt.step()
    saved = copy.deepcopy(opt.state_dict())  # as from a file: state_dict() holds references
    weights = p.detach().clone()
    q = torch.nn.Parameter(weights.clone())
    other = flexdemo.FlexDeMo([q], inner="adamw", compression_chunk=8)
    other.load_state_dict(saved)
    g = torch.randn(16, 16)
    p.grad, q.grad = g.clone(), g.clone()
    opt.step()
    other.step()
    assert torch.equal(p, q)
