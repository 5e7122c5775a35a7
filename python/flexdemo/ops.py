"""flexdemo's DeMo step as torch custom ops (``torch.ops.flexdemo.*``).

The ops are the library's own C++ step (the fused CPU kernels, and the CUDA kernels when this
build has them), registered with ``TORCH_LIBRARY`` in ``python/csrc/ops.cpp``. They exchange
nothing: an optimizer encodes its tensors into one bucket of payloads, all-gathers the buckets
over the replica group, and decodes them into each tensor's update.

Every op takes the tensors' layout the same way: ``chunk`` (target chunk edge), ``chunk_mode``
("divisor", the reference DeMo's: per dimension the largest divisor <= chunk; or "padded"),
``topk`` (coefficients kept per chunk) and ``values`` (the wire encoding of the kept values).
"""

from __future__ import annotations

from typing import List, Sequence

import torch

VALUE_ENCODINGS = ("fp32", "bf16", "int8", "1bit", "2bit", "fp8")
CHUNK_MODES = ("divisor", "padded")

_ops = torch.ops.flexdemo


def payload_bytes(params: Sequence[torch.Tensor], chunk: int, chunk_mode: str, topk: int,
                  values: str) -> List[int]:
    """Each tensor's payload in bytes (36-byte header and checksum included)."""
    return list(_ops.payload_bytes(list(params), chunk, chunk_mode, topk, values))


def residual_shape(param: torch.Tensor, chunk: int, chunk_mode: str) -> List[int]:
    """The shape of a tensor's residual (float32, its chunked DCT coefficients in block layout)."""
    return list(_ops.residual_shape(param, chunk, chunk_mode))


def precondition(grads, grad_sq, *, beta2, eps, step) -> List[torch.Tensor]:
    """``grad_sq = beta2 * grad_sq + (1 - beta2) * grad^2`` (in place), and returned per tensor
    ``grad / (sqrt(grad_sq) / sqrt(1 - beta2^step) + eps)``: AdamW's denominator applied to the
    gradient, in one pass (grad_sq float32, contiguous, the gradient's size)."""
    out = [torch.empty_like(v) for v in grad_sq]
    _ops.precondition(list(grads), list(grad_sq), out, beta2, eps, step)
    return out


def accumulate(params, grads, residuals, *, chunk, chunk_mode, decay, lr) -> None:
    """residual = decay * residual + lr * DCT(grad), for the steps between exchanges."""
    _ops.accumulate(list(params), list(grads), list(residuals), chunk, chunk_mode, decay, lr)


def encode(params, grads, residuals, payloads, *, chunk, chunk_mode, topk, values, decay,
           lr) -> None:
    """Accumulate each gradient into its residual, select every chunk's top-k, write the
    payloads into ``payloads`` (uint8, ``sum(payload_bytes(...))``) and take what a receiver
    decodes out of the residuals (error feedback). A gradient may be None (zero)."""
    _ops.encode(list(params), list(grads), list(residuals), payloads, chunk, chunk_mode, topk,
                values, decay, lr)


def decode_sgd(gathered, replicas, params, *, chunk, chunk_mode, topk, values, lr,
               weight_decay=0.0, sign=True, step_bound=0.0, rms_cap=0.0) -> None:
    """From ``replicas`` buckets (rank order), each payload validated: per coefficient the mean
    of the replicas that sent it, the inverse DCT, and
    ``param = (1 - lr * weight_decay) * param - lr * g`` with g = sign(direction) (DeMo's), or
    with ``sign=False`` the direction, scaled down to RMS ``rms_cap`` where its tensor's RMS is
    above it, then clamped to [-step_bound, step_bound] (0: neither)."""
    _ops.decode_sgd(gathered, replicas, list(params), chunk, chunk_mode, topk, values, lr,
                    weight_decay, sign, step_bound, rms_cap)


def decode_adamw(gathered, replicas, params, exp_avg, exp_avg_sq, *, chunk, chunk_mode, topk,
                 values, lr, weight_decay, beta1, beta2, eps, step, sign=True) -> None:
    """The same decode, then torch.optim.AdamW's step (decoupled weight decay) fed with
    sign(direction), or the direction itself with ``sign=False``; ``step`` counts from 1."""
    _ops.decode_adamw(gathered, replicas, list(params), list(exp_avg), list(exp_avg_sq), chunk,
                      chunk_mode, topk, values, lr, weight_decay, beta1, beta2, eps, step, sign)


PEER_FAULT_KINDS = ("corrupt", "non-finite", "out of scale")


def screen(gathered, replicas, params, *, chunk, chunk_mode, topk, values, scale_bound=100.0):
    """Faulty peers: every payload of ``replicas`` buckets checked before a value is decoded:
    its structure and checksum, its values finite, and its values' L2 norm at most
    ``scale_bound`` times the lower median of the replicas' norms for that tensor (0: no scale
    check; with two replicas the smaller is the reference). Returns the failures as
    ``(replica, tensor, kind, ratio)``, kind one of PEER_FAULT_KINDS (ratio: out of scale's)."""
    rows = _ops.screen(gathered, replicas, list(params), chunk, chunk_mode, topk, values,
                       scale_bound)
    return [(int(r), int(t), PEER_FAULT_KINDS[int(k)], float(x)) for r, t, k, x in rows.tolist()]


def tamper_(payloads, params, *, chunk, chunk_mode, topk, values, how, factor=1.0) -> None:
    """A test aid: the bucket's payloads as a faulty sender would send them: ``how="scale"``
    multiplies every value a receiver decodes by ``factor`` (NaN: non-finite values) and
    re-seals each payload; ``how="corrupt"`` flips a bit, so the checksum fails."""
    _ops.tamper_(payloads, list(params), chunk, chunk_mode, topk, values, how, factor)


def cuda_built() -> bool:
    """Whether this build has the CUDA kernels."""
    return bool(_ops.cuda_built())


# Fake (meta) kernels: the ops only mutate their arguments, so tracing (torch.compile,
# torch.library.opcheck) needs nothing but their signatures.
@torch.library.register_fake("flexdemo::precondition")
def _precondition_fake(grads, grad_sq, out, beta2, eps, step):
    return None


@torch.library.register_fake("flexdemo::accumulate")
def _accumulate_fake(params, grads, residuals, chunk, chunk_mode, decay, lr):
    return None


@torch.library.register_fake("flexdemo::encode")
def _encode_fake(params, grads, residuals, payloads, chunk, chunk_mode, topk, values, decay, lr):
    return None


@torch.library.register_fake("flexdemo::decode_sgd")
def _decode_sgd_fake(gathered, replicas, params, chunk, chunk_mode, topk, values, lr,
                     weight_decay, sign, step_bound, rms_cap):
    return None


@torch.library.register_fake("flexdemo::decode_adamw")
def _decode_adamw_fake(gathered, replicas, params, exp_avg, exp_avg_sq, chunk, chunk_mode, topk,
                       values, lr, weight_decay, beta1, beta2, eps, step, sign):
    return None


@torch.library.register_fake("flexdemo::screen")
def _screen_fake(gathered, replicas, params, chunk, chunk_mode, topk, values, scale_bound):
    return gathered.new_empty((torch.library.get_ctx().new_dynamic_size(), 4),
                              dtype=torch.float64, device="cpu")


@torch.library.register_fake("flexdemo::tamper_")
def _tamper_fake(payloads, params, chunk, chunk_mode, topk, values, how, factor):
    return None
