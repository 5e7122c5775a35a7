"""The DeMo step in plain torch ops, computed as the reference DeMo optimizer computes it: the
chunked DCT as matrix products on rearranged chunks, ``torch.topk`` per chunk, a dense scatter
to transmit and to decode (``scatter_reduce`` mean over the replicas), sign-SGD. The baseline
``python -m flexdemo.bench`` measures flexdemo's ops against; not used by the optimizers."""

from __future__ import annotations

import math
from typing import Dict, List

import torch


def _divisor(n: int, target: int) -> int:
    """The largest divisor of n not above target (the reference's chunk rule)."""
    return max(d for d in range(1, min(n, target) + 1) if n % d == 0)


def _dct_basis(n: int, device, dtype) -> torch.Tensor:
    k = torch.arange(n, dtype=torch.float64).unsqueeze(1)
    i = torch.arange(n, dtype=torch.float64).unsqueeze(0)
    b = torch.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2.0 / n)
    b[0] /= math.sqrt(2.0)
    return b.to(device=device, dtype=dtype)


class PlainTorchDeMo:
    """One replica's DeMo step over ``params`` (sign-SGD); ``replicas`` copies of its own
    payload stand for the all-gather's result."""

    def __init__(self, params: List[torch.Tensor], chunk: int = 64, topk: int = 32,
                 decay: float = 0.999, replicas: int = 1):
        self.params, self.topk, self.decay, self.replicas = params, topk, decay, replicas
        self.delta = [torch.zeros_like(p) for p in params]
        self.basis: Dict[int, torch.Tensor] = {}
        self.chunks = []
        for p in params:
            dims = (1, p.numel()) if p.dim() == 1 else (p.shape[0], p[0].numel())
            h, w = _divisor(dims[0], chunk), _divisor(dims[1], chunk)
            for n in (h, w):
                if n not in self.basis:
                    self.basis[n] = _dct_basis(n, p.device, p.dtype)
            self.chunks.append((dims, h, w))

    def _encode(self, x, dims, h, w):  # [rows, cols] -> [y, x, h*w]
        y = x.reshape(dims[0] // h, h, dims[1] // w, w).permute(0, 2, 1, 3)
        y = self.basis[h] @ y @ self.basis[w].T
        return y.reshape(y.shape[0], y.shape[1], h * w)

    def _decode(self, c, dims, h, w):
        y = c.reshape(c.shape[0], c.shape[1], h, w)
        y = self.basis[h].T @ y @ self.basis[w]
        return y.permute(0, 2, 1, 3).reshape(dims)

    @torch.no_grad()
    def step(self, lr: float) -> None:
        for p, delta, (dims, h, w) in zip(self.params, self.delta, self.chunks):
            delta.mul_(self.decay).add_(p.grad, alpha=lr)
            coeffs = self._encode(delta, dims, h, w)
            k = min(self.topk, h * w)
            idx = torch.topk(coeffs.abs(), k, dim=-1, largest=True, sorted=False).indices
            val = torch.gather(coeffs, -1, idx)
            sent = torch.zeros_like(coeffs).scatter_(-1, idx, val)
            delta.sub_(self._decode(sent, dims, h, w).reshape(delta.shape))
            all_idx = torch.cat([idx] * self.replicas, dim=-1)
            all_val = torch.cat([val] * self.replicas, dim=-1)
            mean = torch.zeros_like(coeffs).scatter_reduce_(-1, all_idx, all_val, reduce="mean",
                                                            include_self=False)
            direction = self._decode(mean, dims, h, w).reshape(p.shape)
            p.add_(direction.sign_(), alpha=-lr)
