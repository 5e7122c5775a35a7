"""The DeMo step in plain torch ops: the baselines ``python -m flexdemo.bench`` measures
flexdemo's ops against; not used by the optimizers.

``ReferenceTorchDeMo`` computes the step op for op as the reference DeMo optimizer does (bloc97's
``demo.py``): per parameter, the chunked DCT as an ``einsum`` over the chunks' view, ``torch.topk``
per chunk, ``scatter_reduce`` (mean) into zeros both for the estimate that leaves the momentum and
for the replicas' mean, the decoded direction copied into a gradient buffer and ``sign_``-ed, then
``torch.optim.SGD``'s step without momentum (``param.add_(grad, alpha=-lr)`` per parameter).
``CompactTorchDeMo`` is the same step written tighter (matrix products on permuted chunks, a plain
scatter for the estimate, the sign applied in place): the fastest plain-torch form we found."""

from __future__ import annotations

import math
from typing import Dict, List, Tuple

import torch


def _divisor(n: int, target: int) -> int:
    """The largest divisor of n not above target (the reference's chunk rule)."""
    return max(d for d in range(1, min(n, target) + 1) if n % d == 0)


def _dct_basis(n: int, device, dtype) -> torch.Tensor:
    """The orthonormal DCT-II of size n, entry [k][i]."""
    k = torch.arange(n, dtype=torch.float64).unsqueeze(1)
    i = torch.arange(n, dtype=torch.float64).unsqueeze(0)
    b = torch.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2.0 / n)
    b[0] /= math.sqrt(2.0)
    return b.to(device=device, dtype=dtype)


class _PlainTorchDeMo:
    """One replica's DeMo step over ``params`` (sign-SGD) with their ``.grad``; ``replicas``
    copies of its own payload stand for the all-gather's result."""

    def __init__(self, params: List[torch.Tensor], chunk: int = 64, topk: int = 32,
                 decay: float = 0.999, replicas: int = 1):
        self.params, self.topk, self.decay, self.replicas = params, topk, decay, replicas
        self.delta = [torch.zeros_like(p) for p in params]
        self.basis: Dict[int, torch.Tensor] = {}


class ReferenceTorchDeMo(_PlainTorchDeMo):
    """The reference's ops (1-D and 2-D parameters, as the reference handles)."""

    def __init__(self, params, chunk=64, topk=32, decay=0.999, replicas=1):
        super().__init__(params, chunk, topk, decay, replicas)
        if any(p.dim() > 2 for p in params):
            raise ValueError("ReferenceTorchDeMo: 1-D and 2-D parameters only, as the reference")
        self.chunks: List[Tuple[int, ...]] = []  # the chunk size along each dimension
        for p in params:
            sizes = tuple(_divisor(s, chunk) for s in p.shape)
            for n in sizes:
                if n not in self.basis:
                    self.basis[n] = _dct_basis(n, p.device, p.dtype)
            self.chunks.append(sizes)
        self.forward = {n: b.T.contiguous() for n, b in self.basis.items()}  # its f_dict
        self.grads = [torch.empty_like(p) for p in params]  # what it copies the direction into

    def _encode(self, x, sizes):
        if x.dim() > 1:
            h, w = sizes
            x = x.reshape(x.shape[0] // h, h, x.shape[1] // w, w)
            return torch.einsum("...ijkl, jb, ld -> ...ikbd", x, self.forward[h], self.forward[w])
        return torch.einsum("...ij, jb -> ...ib", x.reshape(-1, sizes[0]), self.forward[sizes[0]])

    def _decode(self, x):
        if x.dim() > 2:
            y = torch.einsum("...ijkl, kb, ld -> ...ibjd", x, self.basis[x.shape[2]],
                             self.basis[x.shape[3]])
            return y.reshape(y.shape[0] * y.shape[1], y.shape[2] * y.shape[3])
        return torch.einsum("...ij, jb -> ...ib", x, self.basis[x.shape[1]]).reshape(-1)

    @staticmethod
    def _decompress(p, idx, val, xshape):
        x = torch.zeros(xshape, device=p.device, dtype=p.dtype)
        if len(xshape) > 2:
            x = x.reshape(xshape[0], xshape[1], -1)
        x.scatter_reduce_(dim=-1, index=idx, src=val, reduce="mean", include_self=False)
        return x.reshape(xshape)

    @torch.no_grad()
    def step(self, lr: float) -> None:
        for p, delta, grad, sizes in zip(self.params, self.delta, self.grads, self.chunks):
            delta.mul_(self.decay)
            delta.add_(p.grad, alpha=lr)
            x = self._encode(delta, sizes)
            flat = x.reshape(x.shape[0], x.shape[1], -1) if x.dim() > 2 else x
            k = min(self.topk, flat.shape[-1])
            idx = torch.topk(flat.abs(), k=k, dim=-1, largest=True, sorted=False).indices
            val = torch.gather(flat, dim=-1, index=idx)
            delta.sub_(self._decode(self._decompress(p, idx, val, x.shape)).reshape(delta.shape))
            all_idx = torch.cat([idx] * self.replicas, dim=-1)
            all_val = torch.cat([val] * self.replicas, dim=-1)
            grad.copy_(self._decode(self._decompress(p, all_idx, all_val, x.shape)).reshape(
                grad.shape))
            grad.sign_()
        for p, grad in zip(self.params, self.grads):  # torch.optim.SGD, foreach=False
            p.add_(grad, alpha=-lr)


class CompactTorchDeMo(_PlainTorchDeMo):
    """The same step in fewer passes: every parameter as [rows, cols] chunks, matrix products."""

    def __init__(self, params, chunk=64, topk=32, decay=0.999, replicas=1):
        super().__init__(params, chunk, topk, decay, replicas)
        self.layout = []  # ([rows, cols], chunk rows, chunk cols) per parameter
        for p in params:
            dims = (1, p.numel()) if p.dim() == 1 else (p.shape[0], p[0].numel())
            h, w = _divisor(dims[0], chunk), _divisor(dims[1], chunk)
            for n in (h, w):
                if n not in self.basis:
                    self.basis[n] = _dct_basis(n, p.device, p.dtype)
            self.layout.append((dims, h, w))

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
        for p, delta, (dims, h, w) in zip(self.params, self.delta, self.layout):
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
