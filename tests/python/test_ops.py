"""flexdemo's torch ops against DeMo written here from the paper in float64: the chunked
orthonormal DCT-II from its cosine formula, top-k per chunk, error feedback, the replicas' mean
per coefficient, the inverse and the sign-SGD / bounded SGD / AdamW update. Every value
encoding; and torch.library.opcheck on every op."""

import pytest
import torch

import flexdemo
from flexdemo import ops

from float64_demo import Reference

CHUNK, TOPK, DECAY, LR, WD = 16, 6, 0.9, 0.01, 0.1
# [48, 40] -> chunks 16 x 10 (divisors), [30] -> 1 x 15, [4, 6, 5] as [4, 30] -> 4 x 15.
SHAPES = [(48, 40), (30,), (4, 6, 5)]
REPLICAS = 3


def quantisation_ok(values, sent, encoding):
    """sent (what the receiver decodes) is `values` in this encoding: per chunk row."""
    err = (sent - values).abs()
    if encoding == "fp32":
        return torch.equal(sent.float(), values.float())
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
                     for row in sent)  # (sent is a float32 residual's difference: rounded)
        return signs and levels
    raise AssertionError(encoding)


def layout(values):
    return dict(chunk=CHUNK, chunk_mode="divisor", topk=TOPK, values=values)


def replica_grads(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in SHAPES]


def encode_replicas(values, params):
    """Each replica's residuals (random history), encoded with its own gradients: the bucket of
    payloads, and per replica and tensor (residual before, residual after) as [C, h*w]."""
    size = sum(ops.payload_bytes(params, CHUNK, "divisor", TOPK, values))
    buckets, residual_pairs = [], []
    for r in range(REPLICAS):
        g = torch.Generator().manual_seed(100 + r)
        residuals = [torch.randn(ops.residual_shape(p, CHUNK, "divisor"), generator=g) * 0.01
                     for p in params]
        before = [x.clone() for x in residuals]
        grads = replica_grads(r)
        bucket = torch.empty(size, dtype=torch.uint8)
        ops.encode(params, grads, residuals, bucket, decay=DECAY, lr=LR, **layout(values))
        buckets.append(bucket)
        residual_pairs.append([(b, a, gr) for b, a, gr in zip(before, residuals, grads)])
    return torch.cat(buckets), residual_pairs


@pytest.mark.parametrize("values", ops.VALUE_ENCODINGS)
def test_encode_and_decode_match_float64_demo(values):
    params = [torch.randn(s) for s in SHAPES]
    gathered, pairs = encode_replicas(values, params)
    refs = [Reference(s, CHUNK, TOPK) for s in SHAPES]
    sent_per_replica = []
    for r in range(REPLICAS):
        sent_tensors = []
        for ref, (before, after, grad) in zip(refs, pairs[r]):
            accumulated = DECAY * ref.dct_block(before.double()) + LR * ref.dct(grad)
            chosen = ref.topk(accumulated)
            values_kept = accumulated.gather(1, chosen)
            left = ref.dct_block(after.double())
            sent = accumulated - left  # error feedback: the residual keeps what was not sent
            # Nothing but the top-k left the residual, and it left as its encoding decodes.
            mask = torch.zeros_like(sent, dtype=torch.bool).scatter_(1, chosen, True)
            assert sent[~mask].abs().max().item() < 1e-6, "non-selected coefficients changed"
            assert quantisation_ok(values_kept, sent.gather(1, chosen), values), values
            sent_tensors.append((chosen, sent.gather(1, chosen)))
        sent_per_replica.append(sent_tensors)

    # Decode: per coefficient the mean of the replicas that sent it; inverse; sign-SGD.
    stepped = [p.clone() for p in params]
    ops.decode_sgd(gathered, REPLICAS, stepped, lr=LR, weight_decay=WD, **layout(values))
    for t, (ref, p, new) in enumerate(zip(refs, params, stepped)):
        total = torch.zeros(ref.rows // ref.h * (ref.cols // ref.w), ref.h * ref.w,
                            dtype=torch.float64)
        count = torch.zeros_like(total)
        for r in range(REPLICAS):
            chosen, sent = sent_per_replica[r][t]
            total.scatter_add_(1, chosen, sent)
            count.scatter_add_(1, chosen, torch.ones_like(sent))
        direction = ref.idct(total / count.clamp(min=1))
        want = (1 - LR * WD) * p.double().reshape(ref.rows, ref.cols) - LR * direction.sign()
        clear = direction.abs() > 1e-5 * direction.abs().max()  # sign() certain
        got = new.double().reshape(ref.rows, ref.cols)
        assert torch.allclose(got[clear], want[clear], rtol=0, atol=1e-6), (values, t)


def decoded_direction(ref, pairs, t):
    """Tensor t's direction as float64 DeMo decodes it: per coefficient the mean of the replicas
    that sent it (what left each replica's residual), transformed back."""
    total = torch.zeros(ref.rows // ref.h * (ref.cols // ref.w), ref.h * ref.w,
                        dtype=torch.float64)
    count = torch.zeros_like(total)
    for r in range(REPLICAS):
        before, after, grad = pairs[r][t]
        accumulated = DECAY * ref.dct_block(before.double()) + LR * ref.dct(grad)
        chosen = ref.topk(accumulated)
        sent = (accumulated - ref.dct_block(after.double())).gather(1, chosen)
        total.scatter_add_(1, chosen, sent)
        count.scatter_add_(1, chosen, torch.ones_like(sent))
    return ref.idct(total / count.clamp(min=1))


@pytest.mark.parametrize("bound, cap", [(0.0, 0.0), ("median", 0.0), (0.0, "half"),
                                        ("median", "half"), (0.0, "twice")])
def test_plain_sgd_decode_matches_float64(bound, cap):
    """sign=False: param = (1 - lr wd) param - lr g, g the direction scaled down to RMS cap where
    its tensor's RMS is above it (cap at half its RMS, or at twice: no change), then clamped to
    [-bound, bound] (the median |g|: half the elements clamped); 0: neither."""
    params = [torch.randn(s) for s in SHAPES]
    gathered, pairs = encode_replicas("fp32", params)
    for t, s in enumerate(SHAPES):
        ref = Reference(s, CHUNK, TOPK)
        d = decoded_direction(ref, pairs, t)
        rms = d.pow(2).mean().sqrt().item()
        c = {0.0: 0.0, "half": rms / 2, "twice": rms * 2}[cap]
        g = d * (c / rms) if 0 < c < rms else d
        b = g.abs().median().item() if bound == "median" else 0.0
        g = g.clamp(-b, b) if b > 0 else g
        new = [p.clone() for p in params]
        ops.decode_sgd(gathered, REPLICAS, new, lr=LR, weight_decay=WD, sign=False, step_bound=b,
                       rms_cap=c, **layout("fp32"))
        want = (1 - LR * WD) * params[t].double().reshape(d.shape) - LR * g
        assert torch.allclose(new[t].double().reshape(d.shape), want, rtol=0, atol=1e-6), t


@pytest.mark.parametrize("sign", [True, False])
def test_adamw_decode_matches_float64_adamw(sign):
    values = "fp32"
    params = [torch.randn(s) for s in SHAPES]
    gathered, pairs = encode_replicas(values, params)
    refs = [Reference(s, CHUNK, TOPK) for s in SHAPES]
    g = torch.Generator().manual_seed(7)
    exp_avg = [torch.randn(s, generator=g) * 0.01 for s in SHAPES]
    exp_avg_sq = [torch.rand(s, generator=g) * 1e-4 for s in SHAPES]
    m, v, new = [x.clone() for x in exp_avg], [x.clone() for x in exp_avg_sq], [
        p.clone() for p in params]
    step, b1, b2, eps = 3, 0.9, 0.95, 1e-8
    ops.decode_adamw(gathered, REPLICAS, new, m, v, lr=LR, weight_decay=WD, beta1=b1, beta2=b2,
                     eps=eps, step=step, sign=sign, **layout(values))
    for t, ref in enumerate(refs):
        d = decoded_direction(ref, pairs, t)
        u = d.sign() if sign else d
        shape = (ref.rows, ref.cols)
        m_ref = b1 * exp_avg[t].double().reshape(shape) + (1 - b1) * u
        v_ref = b2 * exp_avg_sq[t].double().reshape(shape) + (1 - b2) * u * u
        denom = (v_ref / (1 - b2 ** step)).sqrt() + eps
        p_ref = params[t].double().reshape(shape) * (1 - LR * WD) - LR * (m_ref / (1 - b1 ** step)) / denom
        clear = d.abs() > 1e-5 * d.abs().max()
        assert torch.allclose(new[t].double().reshape(shape)[clear], p_ref[clear], atol=1e-5)
        assert torch.allclose(m[t].double().reshape(shape)[clear], m_ref[clear], atol=1e-6)
        assert torch.allclose(v[t].double().reshape(shape)[clear], v_ref[clear], atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_precondition_matches_float64(dtype):
    """v = beta2 v + (1 - beta2) g^2 in place, and g / (sqrt(v) / sqrt(1 - beta2^t) + eps)
    returned: AdamW's denominator on the gradient (any float dtype, any layout)."""
    beta2, eps, step = 0.95, 1e-6, 3
    grads = [torch.randn(s).to(dtype) for s in SHAPES] + [torch.randn(40, 48).t()]
    sq = [torch.rand(g.shape).contiguous() for g in grads]
    want_v = [beta2 * v.double() + (1 - beta2) * g.double() ** 2 for v, g in zip(sq, grads)]
    want = [g.double() / (v.sqrt() / (1 - beta2 ** step) ** 0.5 + eps)
            for g, v in zip(grads, want_v)]
    got = ops.precondition(grads, sq, beta2=beta2, eps=eps, step=step)
    for g, w, v, wv in zip(got, want, sq, want_v):
        assert g.dtype == torch.float32 and g.shape == v.shape
        assert torch.allclose(v.double(), wv, rtol=1e-6, atol=0)
        assert torch.allclose(g.double(), w, rtol=1e-5, atol=1e-7)


def test_accumulate_is_decayed_momentum_in_dct_space():
    params = [torch.randn(s) for s in SHAPES]
    residuals = [torch.randn(ops.residual_shape(p, CHUNK, "divisor")) for p in params]
    before = [r.clone() for r in residuals]
    grads = replica_grads(0)
    ops.accumulate(params, grads, residuals, chunk=CHUNK, chunk_mode="divisor", decay=DECAY,
                   lr=LR)
    for ref, b, a, g in zip([Reference(s, CHUNK, TOPK) for s in SHAPES], before, residuals, grads):
        want = DECAY * ref.dct_block(b.double()) + LR * ref.dct(g)
        assert torch.allclose(ref.dct_block(a.double()), want, atol=1e-6)


def test_payload_bytes_closed_form():
    # fp32, 1-byte positions (chunks of <= 256 coefficients): 36 + chunks * k * (1 + 4).
    p = torch.zeros(48, 40)  # 3 x 4 chunks of 16 x 10
    assert ops.payload_bytes([p], CHUNK, "divisor", TOPK, "fp32") == [36 + 12 * TOPK * 5]
    assert ops.payload_bytes([p], CHUNK, "divisor", TOPK, "bf16") == [36 + 12 * TOPK * 3]


# ====== torch.library.opcheck ======
def _op_samples():
    params = [torch.randn(s) for s in SHAPES]
    residuals = [torch.zeros(ops.residual_shape(p, CHUNK, "divisor")) for p in params]
    size = sum(ops.payload_bytes(params, CHUNK, "divisor", TOPK, "bf16"))
    bucket = torch.zeros(size, dtype=torch.uint8)
    grads = replica_grads(1)
    torch.ops.flexdemo.encode(params, grads, residuals, bucket, CHUNK, "divisor", TOPK, "bf16",
                              DECAY, LR)
    lay = (CHUNK, "divisor", TOPK, "bf16")
    return {
        "accumulate": (params, grads, residuals, CHUNK, "divisor", DECAY, LR),
        "encode": (params, grads, [r.clone() for r in residuals], bucket.clone()) + lay + (DECAY, LR),
        "decode_sgd": (bucket, 1, [p.clone() for p in params]) + lay + (LR, WD, False, 0.5, 0.0),
        "precondition": ([torch.randn(s) for s in SHAPES], [torch.rand(s) for s in SHAPES],
                         [torch.empty(s) for s in SHAPES], 0.999, 1e-8, 2),
        "decode_adamw": (bucket, 1, [p.clone() for p in params],
                         [torch.zeros(s) for s in SHAPES], [torch.zeros(s) for s in SHAPES]) +
                        lay + (LR, WD, 0.9, 0.999, 1e-8, 1, True),
    }


@pytest.mark.parametrize("name", ["precondition", "accumulate", "encode", "decode_sgd",
                                  "decode_adamw"])
def test_opcheck(name):
    op = getattr(torch.ops.flexdemo, name).default
    torch.library.opcheck(op, _op_samples()[name])


# ====== Bad input: one clear line ======
def test_ops_reject_bad_layouts():
    p = [torch.zeros(8, 8)]
    with pytest.raises(ValueError, match="value encoding 'fp16'; accepted: fp32, bf16"):
        ops.payload_bytes(p, 4, "divisor", 2, "fp16")
    with pytest.raises(ValueError, match="chunk 0; it must be > 0"):
        ops.payload_bytes(p, 0, "divisor", 2, "bf16")
    with pytest.raises(ValueError, match="payloads must be contiguous uint8 of"):
        ops.encode(p, [None], [torch.zeros(8, 8)], torch.zeros(3, dtype=torch.uint8),
                   decay=0.9, lr=0.1, **dict(layout("bf16"), chunk=4))
    empty = torch.zeros(sum(ops.payload_bytes(p, 4, "divisor", 2, "bf16")), dtype=torch.uint8)
    for name in ("step_bound", "rms_cap"):
        with pytest.raises(ValueError, match=name + " -1; it must be >= 0"):
            ops.decode_sgd(empty, 1, p, lr=0.1, sign=False, **{name: -1},
                           **dict(layout("bf16"), chunk=4, topk=2))
    with pytest.raises(ValueError, match="gradient 0 has 64 elements on cpu, its grad_sq or out 4 on"):
        ops.precondition(p, [torch.zeros(4)], beta2=0.999, eps=1e-8, step=1)
    with pytest.raises(ValueError, match="beta2 1; it must be in"):
        ops.precondition(p, [torch.zeros(8, 8)], beta2=1.0, eps=1e-8, step=1)
    with pytest.raises(ValueError, match="residual 0 must be contiguous float32 of 64"):
        ops.accumulate(p, [None], [torch.zeros(4)], chunk=4, chunk_mode="divisor", decay=0.9,
                       lr=0.1)


def test_corrupt_payload_is_refused():
    params = [torch.randn(s) for s in SHAPES]
    gathered, _ = encode_replicas("bf16", params)
    gathered[40] ^= 0xFF  # a byte of the first payload's body
    with pytest.raises(RuntimeError, match="checksum"):
        ops.decode_sgd(gathered, REPLICAS, params, lr=LR, **layout("bf16"))


@pytest.mark.parametrize("values", ops.VALUE_ENCODINGS)
def test_screen_names_each_faulty_replica(values):
    """Replica 1 sends values 1000x (re-sealed), NaN or a corrupt payload: screen names it for
    every tensor, with the right kind; healthy buckets pass; the scale check can be turned off."""
    params = [torch.randn(s) for s in SHAPES]
    gathered, _ = encode_replicas(values, params)
    size = gathered.numel() // REPLICAS
    assert ops.screen(gathered, REPLICAS, params, **layout(values)) == []
    for how, factor, kind in (("scale", 1000.0, "out of scale"),
                              ("scale", float("nan"), "non-finite"), ("corrupt", 1.0, "corrupt")):
        bad = gathered.clone()
        ops.tamper_(bad.narrow(0, size, size), params, how=how, factor=factor, **layout(values))
        found = ops.screen(bad, REPLICAS, params, **layout(values))
        assert [(r, t, k) for r, t, k, _ in found] == [(1, t, kind) for t in range(len(SHAPES))]
        if kind == "out of scale":
            # 1000x replica 1's norm over the larger of the other two (the lower median of 3)
            assert all(100 < ratio < 10000 for _, _, _, ratio in found), found
            assert ops.screen(bad, REPLICAS, params, scale_bound=0, **layout(values)) == []
    with pytest.raises(ValueError, match="scale_bound 1; it must be 0"):
        ops.screen(gathered, REPLICAS, params, scale_bound=1, **layout(values))


def test_version():
    assert flexdemo.__version__


def test_payload_checksum_is_zlibs_crc32():
    """Header bytes 32..35 hold the CRC-32 of the body (docs/wire-format.md), whatever a
    payload's alignment in its bucket."""
    import struct
    import zlib
    params = [torch.randn(s) for s in [(7, 5), (13,), (64, 64), (3, 9)]]
    for values in ops.VALUE_ENCODINGS:
        sizes = ops.payload_bytes(params, 8, "divisor", 5, values)
        bucket = torch.empty(sum(sizes), dtype=torch.uint8)
        ops.encode(params, [torch.randn_like(p) for p in params],
                   [torch.zeros(ops.residual_shape(p, 8, "divisor")) for p in params], bucket,
                   chunk=8, chunk_mode="divisor", topk=5, values=values, decay=0.9, lr=0.1)
        data, offset = bytes(bucket.numpy()), 0
        for n in sizes:
            payload = data[offset:offset + n]
            assert struct.unpack_from("<I", payload, 32)[0] == zlib.crc32(payload[36:]), values
            offset += n
