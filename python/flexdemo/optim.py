"""FlexDeMo and DeMo as torch optimizers.

A step: every tensor's gradient (FlexDeMo's default: first divided by the root of its running
mean square) goes into its residual (decayed momentum, kept as chunked DCT coefficients), each
chunk's top-k leaves the residual as a compact payload, one bucket of all payloads is
all-gathered over the replicate group (``torch.distributed``, asynchronously), and the replicas'
mean of every coefficient, transformed back, steps each parameter: by the direction with its
RMS capped per tensor (FlexDeMo's default), by its sign (DeMo's) or by AdamW. Every replica
decodes the same bytes in the same order, so replicas stay bit-identical.
With FSDP2 inside a node (``flexdemo.shard_model``), parameters are ``Shard(0)`` DTensors on the
node's shard mesh; the step works on each rank's local shard, and the ranks of one replicate
group hold the same shard index, so their payloads match.
"""

from __future__ import annotations

import logging
from typing import List, Optional

import torch
import torch.distributed as dist

from . import ops

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch without DTensor: plain tensors only
    DTensor = None

log = logging.getLogger("flexdemo")

INNER = ("sgd", "adamw")
ON_NONFINITE = ("skip", "stop")
ON_BAD_PEER = ("drop", "stop")
GPU_MAX_CHUNK_NUMEL = 16384  # the CUDA kernels' largest chunk (src/demo/cuda/cuda_kernels.h)


def _is_dtensor(t) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if _is_dtensor(t) else t


def _bad(message: str) -> ValueError:
    return ValueError("flexdemo: " + message)


def _group_ranks(group) -> List[int]:
    return dist.get_process_group_ranks(group)


class _Exchange:
    """A step's bucket in flight: ``wait()`` completes the all-gather and applies the update."""

    def __init__(self, optimizer: "FlexDeMo", work, recv: torch.Tensor):
        self._optimizer, self._work, self._recv = optimizer, work, recv

    def wait(self) -> None:
        if self._optimizer is None:
            return
        if self._work is not None:
            self._work.wait()
        optimizer, self._optimizer = self._optimizer, None
        optimizer._decode(self._recv)


class FlexDeMo(torch.optim.Optimizer):
    """DeMo between replicas (nodes), for parameters that are whole or FSDP2 shards.

    Args:
        params: float32 parameters (or param groups: lr, weight_decay, betas, eps per group),
            all on one device; plain tensors or the DTensors of ``fully_shard``.
        lr: learning rate.
        compression_decay: residual decay per step, in [0, 1).
        compression_topk: coefficients kept per chunk (clamped to smaller chunks); default 112
            with inner "sgd", 32 with "adamw" (at most the chunk's).
        compression_chunk: target chunk edge.
        chunk_mode: "divisor" (per dimension the largest divisor <= chunk, the reference's) or
            "padded" (min(dim, chunk), the tensor zero-padded).
        values: wire encoding of the kept values: fp32, bf16, int8, 1bit, 2bit, fp8; default
            fp8 with inner "sgd", bf16 with "adamw".
        inner: "sgd" (SGD on the direction: bounded, or its sign) or "adamw" (AdamW fed with
            sign(direction), or the direction with ``sign=False``).
        sign: step by the direction's sign (DeMo's sign-SGD); default off with inner "sgd",
            on with "adamw".
        rms_cap: with sign off and inner "sgd", each tensor's direction (this rank's shard)
            whose RMS is above rms_cap scaled down to it before the step, as Adafactor clips
            its update (0: not capped); default 1.
        step_bound: with sign off and inner "sgd", each element of the direction clamped to
            [-step_bound, step_bound] before the step, after rms_cap (0: not clamped).
        precondition: divide each gradient by the root of its running mean square (AdamW's
            denominator, beta2 and eps of the param group, on this replica's own gradient)
            before it enters the residual; default on with inner "sgd".
        fold_lr: scale each gradient by lr as it enters the residual (the reference DeMo's);
            default off with inner "sgd", on with "adamw".
        The defaults with inner "sgd" are ``flexdemo train --optimizer flexdemo``'s (the adaptive
        step, its RMS capped; docs/results/loss-parity.md); ``DeMo`` sets the reference's.
        weight_decay: decoupled, ``param *= 1 - lr * weight_decay``.
        exchange_every: exchange and update every N steps; the steps between only fold their
            gradients into the residuals.
        mesh: a DeviceMesh with dimensions ("replicate", "shard") (``flexdemo.hybrid_mesh``), or
            one dimension (replicas only). Or give the groups:
        replicate_group: the ranks that hold the same shard on other nodes (default: the world
            when neither mesh nor groups are given).
        shard_group: the ranks of this node that FSDP2 shards over (None: no sharding).
        on_nonfinite: a NaN/Inf gradient on a node: "skip" drops that node's gradient from the
            step (logged; the exchange goes on, so replicas stay identical), "stop" raises.
        on_bad_peer: a node whose payloads fail the checks (corrupt, non-finite values, or
            values out of scale: ``ops.screen``): "drop" leaves it out of the step's mean on
            every replica alike (logged, counted in ``peers_left_out``), "stop" raises.
        peer_scale_bound: out of scale means a tensor's values' norm above this many times
            the lower median of the replicas' norms (0: no scale check).
    """

    def __init__(self, params, lr: float = 1e-3, *, compression_decay: float = 0.999,
                 compression_topk: Optional[int] = None, compression_chunk: int = 64,
                 chunk_mode: str = "divisor", values: Optional[str] = None, inner: str = "sgd",
                 sign: Optional[bool] = None, rms_cap: Optional[float] = None,
                 step_bound: float = 0.0,
                 precondition: Optional[bool] = None, fold_lr: Optional[bool] = None,
                 betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, exchange_every: int = 1, mesh=None,
                 replicate_group=None, shard_group=None, on_nonfinite: str = "skip",
                 on_bad_peer: str = "drop", peer_scale_bound: float = 100.0):
        # The defaults: flexdemo train's per inner rule (src/train/options.cpp, resolve()).
        adaptive = inner == "sgd"
        sign = (not adaptive) if sign is None else bool(sign)
        if compression_topk is None:
            compression_topk = min(112 if adaptive else 32, int(compression_chunk) ** 2)
        values = ("fp8" if adaptive else "bf16") if values is None else values
        rms_cap = (1.0 if adaptive and not sign else 0.0) if rms_cap is None else rms_cap
        precondition = adaptive if precondition is None else bool(precondition)
        fold_lr = (not adaptive) if fold_lr is None else bool(fold_lr)
        _check_options(lr, compression_decay, compression_topk, compression_chunk, chunk_mode,
                       values, inner, betas, eps, weight_decay, exchange_every, on_nonfinite)
        if on_bad_peer not in ON_BAD_PEER:
            raise _bad("on_bad_peer {!r}; accepted: {}".format(on_bad_peer,
                                                                ", ".join(ON_BAD_PEER)))
        if not (peer_scale_bound == 0 or peer_scale_bound > 1):
            raise _bad("peer_scale_bound {}; it must be 0 (no scale check) or > 1".format(
                peer_scale_bound))
        for name, bound in (("rms_cap", rms_cap), ("step_bound", step_bound)):
            if not bound >= 0:
                raise _bad("{} {}; it must be >= 0 (0: none)".format(name, bound))
            if bound > 0 and (sign or inner != "sgd"):
                raise _bad("{} {} needs inner 'sgd' with sign=False, not inner {!r} with "
                           "sign={} (give {}=0)".format(name, bound, inner, sign, name))
        defaults = dict(lr=lr, weight_decay=weight_decay, betas=tuple(betas), eps=eps)
        super().__init__(params, defaults)
        self.decay = float(compression_decay)
        self.topk = int(compression_topk)
        self.chunk = int(compression_chunk)
        self.chunk_mode = chunk_mode
        self.values = values
        self.inner = inner
        self.sign = sign
        self.rms_cap = float(rms_cap)
        self.step_bound = float(step_bound)
        self.precondition = precondition
        self.fold_lr = fold_lr
        self.exchange_every = int(exchange_every)
        self.on_nonfinite = on_nonfinite
        self.on_bad_peer = on_bad_peer
        self.peer_scale_bound = float(peer_scale_bound)
        self.replicate_group, self.shard_group = _groups(mesh, replicate_group, shard_group)
        self.replicas = dist.get_world_size(self.replicate_group) if self.replicate_group else 1
        self._check_params()
        # Per replica and per shard: DCP keeps tensors of equal keys once.
        where = "replica{}.shard{}".format(
            dist.get_rank(self.replicate_group) if self.replicate_group else 0,
            dist.get_rank(self.shard_group) if self.shard_group else 0)
        self._residual_key, self._grad_sq_key = "residual." + where, "grad_sq." + where
        self._init_state()
        # Per param group, the tensors a step updates (fixed: the bucket's layout follows them);
        # the groups' hyperparameters are read from param_groups at each step.
        self._trained_params = [self._trained(g) for g in self.param_groups]
        self._layouts = self._payload_layouts()
        self.bucket_bytes = sum(n for _, n in self._layouts)  # this replica's payloads a step
        self._send: Optional[torch.Tensor] = None
        self._recv: Optional[torch.Tensor] = None
        self._pending: Optional[_Exchange] = None
        self.exchanges = 0          # all-gathers so far
        self.bytes_sent = 0         # this rank's payload bytes put on the replicate group
        self.nonfinite_steps = 0    # steps whose gradient this node dropped (on_nonfinite skip)
        self.peers_left_out = 0     # (node, step) pairs left out of a step's mean (on_bad_peer)
        self._tamper = None         # the test aid's (how, factor) for the next exchange

    def tamper_next_exchange(self, how: str, factor: float = 1.0) -> None:
        """A test aid: this rank's next payloads go out as a faulty node's would
        (``ops.tamper_``: "scale" by factor, NaN for non-finite values, or "corrupt")."""
        self._tamper = (how, float(factor))

    # ====== Parameters and state ======
    def _trained(self, group) -> List[torch.Tensor]:
        return [p for p in group["params"] if p.requires_grad and _local(p).numel() > 0]

    def _check_params(self) -> None:
        params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        if not params:
            raise _bad("FlexDeMo: no parameter requires grad")
        devices = sorted({str(_local(p).device) for p in params})
        if len(devices) > 1:
            raise _bad("FlexDeMo: parameters on several devices ({}); one device per "
                       "optimizer".format(", ".join(devices)))
        dtypes = sorted({str(p.dtype).replace("torch.", "") for p in params})
        if dtypes != ["float32"]:
            raise _bad("FlexDeMo: parameters of dtype {}; the step updates float32 parameters "
                       "(keep the weights float32, autocast the forward)".format(", ".join(dtypes)))
        if devices[0].startswith("cuda") and self.chunk ** 2 > GPU_MAX_CHUNK_NUMEL:
            raise _bad("FlexDeMo: compression_chunk {}: the GPU kernels take chunks of at most {} "
                       "coefficients (compression_chunk <= {})".format(
                           self.chunk, GPU_MAX_CHUNK_NUMEL, int(GPU_MAX_CHUNK_NUMEL ** 0.5)))
        for p in params:
            if not _local(p).is_contiguous():
                raise _bad("FlexDeMo: a parameter of shape {} is not contiguous".format(
                    tuple(p.shape)))
            if _is_dtensor(p) and self.shard_group is not None:
                sharded_over = _group_ranks(p.device_mesh.get_group())
                if p.device_mesh.ndim != 1 or sharded_over != _group_ranks(self.shard_group):
                    raise _bad("FlexDeMo: the parameters are sharded over ranks {} (their "
                               "DeviceMesh {}), shard_group holds ranks {}; give the group FSDP "
                               "shards over (flexdemo.shard_model: mesh['shard'])".format(
                                   sharded_over, tuple(p.device_mesh.mesh.shape),
                                   _group_ranks(self.shard_group)))

    def _like(self, p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """A state tensor laid out as its parameter: a DTensor for a shard, so that DCP saves the
        shards once per replica group, as it does the parameters."""
        if _is_dtensor(p):
            return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                                      shape=p.shape, stride=p.stride())
        return local

    def _init_state(self) -> None:
        # Made at once (not at the first step), so that a checkpoint can be loaded into it.
        for group in self.param_groups:
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                state = self.state[p]
                state["step"] = torch.tensor(0.0)
                local = _local(p)
                if local.numel() == 0:
                    continue
                shape = ops.residual_shape(local, self.chunk, self.chunk_mode)
                state[self._residual_key] = torch.zeros(shape, device=local.device)
                if self.precondition:  # this replica's own gradients': per replica too
                    state[self._grad_sq_key] = torch.zeros_like(local)
                if self.inner == "adamw":
                    state["exp_avg"] = self._like(p, torch.zeros_like(local))
                    state["exp_avg_sq"] = self._like(p, torch.zeros_like(local))

    def _payload_layouts(self):
        """Per param group: its payloads' offset in the bucket and their bytes."""
        layouts, offset = [], 0
        for trained in self._trained_params:
            params = [_local(p) for p in trained]
            n = sum(ops.payload_bytes(params, self.chunk, self.chunk_mode, self.topk,
                                      self.values)) if params else 0
            layouts.append((offset, n))
            offset += n
        return layouts

    def _bucket_device(self, device: torch.device) -> torch.device:
        if self.replicas > 1 and "nccl" in str(dist.get_backend(self.replicate_group)):
            return device
        return torch.device("cpu")

    def _buffers(self, device: torch.device):
        if self._send is None:
            on = self._bucket_device(device)
            pinned = on.type == "cpu" and device.type == "cuda"
            self._send = torch.empty(self.bucket_bytes, dtype=torch.uint8, device=on,
                                     pin_memory=pinned)
            self._recv = (torch.empty(self.bucket_bytes * self.replicas, dtype=torch.uint8,
                                      device=on, pin_memory=pinned)
                          if self.replicas > 1 else self._send)
        return self._send, self._recv

    # ====== The step ======
    def _grads(self, params: List[torch.Tensor]) -> List[Optional[torch.Tensor]]:
        return [None if p.grad is None else _local(p.grad) for p in params]

    def _finite(self, grads: List[Optional[torch.Tensor]]) -> bool:
        present = [g for g in grads if g is not None]
        finite = torch.ones((), dtype=torch.int32)
        if present:
            norms = torch._foreach_norm(present)
            finite = torch.isfinite(torch.stack(norms)).all().to(torch.int32).cpu()
        if self.shard_group is not None and dist.get_world_size(self.shard_group) > 1:
            # The node's ranks agree (FSDP2's reduce-scatter put a NaN in some shards only).
            t = finite.to(present[0].device if present else "cpu")
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.shard_group)
            finite = t.cpu()
        return bool(finite.item())

    @torch.no_grad()
    def step(self, closure=None):
        """One step; with an exchange due, it waits for the all-gather and applies the update.
        ``step_async`` returns the exchange in flight instead."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        pending = self.step_async()
        if pending is not None:
            pending.wait()
        return loss

    @torch.no_grad()
    def step_async(self) -> Optional[_Exchange]:
        """Encodes this step and starts its all-gather (async); returns the exchange, whose
        ``wait()`` applies the update, or None on a step that only accumulates. Until then the
        parameters are not updated: do other work (data, logging), not the next forward."""
        if self._pending is not None:
            raise RuntimeError("flexdemo: FlexDeMo.step_async: the previous exchange was not "
                               "waited for")
        groups = list(zip(self.param_groups, self._trained_params))
        grads = [self._grads(params) for _, params in groups]
        step = self._advance()
        if self.on_nonfinite and not self._finite([x for gs in grads for x in gs]):
            if self.on_nonfinite == "stop":
                raise FloatingPointError(
                    "flexdemo: non-finite gradient at step {} (on_nonfinite='stop')".format(step))
            self.nonfinite_steps += 1
            log.warning("flexdemo: step %d: non-finite gradient on this node; its gradient is "
                        "dropped from the step (on_nonfinite='skip')", step)
            grads = [[None] * len(params) for _, params in groups]
        if self.precondition:
            grads = [self._preconditioned(group, params, gs, step)
                     for (group, params), gs in zip(groups, grads)]
        if step % self.exchange_every != 0:
            for (group, params), gs in zip(groups, grads):
                if params:
                    ops.accumulate([_local(p) for p in params], gs, self._residuals(params),
                                   chunk=self.chunk, chunk_mode=self.chunk_mode,
                                   decay=self.decay, lr=self._folded(group))
            return None
        device = next((_local(p).device for _, params in groups for p in params),
                      torch.device("cpu"))
        send, recv = self._buffers(device)
        for (group, params), gs, (offset, n) in zip(groups, grads, self._layouts):
            if params:
                ops.encode([_local(p) for p in params], gs, self._residuals(params),
                           send.narrow(0, offset, n), chunk=self.chunk,
                           chunk_mode=self.chunk_mode, topk=self.topk, values=self.values,
                           decay=self.decay, lr=self._folded(group))
        if self._tamper is not None:
            how, factor = self._tamper
            self._tamper = None
            for (_, params), (offset, n) in zip(groups, self._layouts):
                if params:
                    ops.tamper_(send.narrow(0, offset, n), [_local(p) for p in params],
                                how=how, factor=factor, **self._layout())
        work = None
        if self.replicas > 1:
            work = dist.all_gather_into_tensor(recv, send, group=self.replicate_group,
                                               async_op=True)
            self.bytes_sent += self.bucket_bytes
        self.exchanges += 1
        self._pending = _Exchange(self, work, recv)
        return self._pending

    def _advance(self) -> int:
        """Every parameter's step count (kept per parameter, as torch's optimizers keep it)."""
        steps = [self.state[p]["step"] for g in self.param_groups for p in g["params"]
                 if p.requires_grad]
        torch._foreach_add_(steps, 1)
        return int(steps[0].item())

    def _residuals(self, params) -> List[torch.Tensor]:
        return [self.state[p][self._residual_key] for p in params]

    def _folded(self, group) -> float:
        """The scale of a gradient entering the residual."""
        return group["lr"] if self.fold_lr else 1.0

    def _preconditioned(self, group, params, grads, step: int) -> List[Optional[torch.Tensor]]:
        """v = beta2 * v + (1 - beta2) * g^2, then g / (sqrt(v / (1 - beta2^step)) + eps): AdamW's
        denominator on this replica's own gradients (a missing one counts as zero, stays None)."""
        beta2, eps = group["betas"][1], group["eps"]
        sq = [self.state[p][self._grad_sq_key] for p in params]
        for v, g in zip(sq, grads):
            if g is None:
                v.mul_(beta2)
        here = [(v, g) for v, g in zip(sq, grads) if g is not None]
        if not here:
            return list(grads)
        scaled = iter(ops.precondition([g for _, g in here], [v for v, _ in here], beta2=beta2,
                                       eps=eps, step=step))
        return [None if g is None else next(scaled) for g in grads]

    def _layout(self):
        return dict(chunk=self.chunk, chunk_mode=self.chunk_mode, topk=self.topk,
                    values=self.values)

    def _screen(self, recv: torch.Tensor, step: int) -> List[int]:
        """The replicas whose payloads pass ``ops.screen`` (all replicas see the same bytes, so
        all keep the same ones); one line per node left out, or raises under on_bad_peer
        "stop"."""
        faults = {}  # replica -> [(group, tensor, kind, ratio)], in order
        for g, (params, (offset, n)) in enumerate(zip(self._trained_params, self._layouts)):
            if not params:
                continue
            gathered = recv.view(self.replicas, -1)[:, offset:offset + n].reshape(-1)
            for r, t, kind, ratio in ops.screen(gathered, self.replicas,
                                                [_local(p) for p in params],
                                                scale_bound=self.peer_scale_bound,
                                                **self._layout()):
                faults.setdefault(r, []).append((g, t, kind, ratio))
        for r, found in sorted(faults.items()):
            g, t, kind, ratio = found[0]
            what = {"corrupt": "a corrupt payload", "non-finite": "non-finite values",
                    "out of scale": "values {:.3g}x the replicas' lower median norm".format(
                        ratio)}[kind]
            line = "flexdemo: step {}: node {} (rank {}) sent tensor {} of param group {} " \
                   "with {}{}".format(step, r, dist.get_global_rank(self.replicate_group, r), t,
                                     g, what, " (and {} more tensors)".format(len(found) - 1)
                                     if len(found) > 1 else "")
            if self.on_bad_peer == "stop":
                raise RuntimeError(line + "; stopping (on_bad_peer='stop')")
            log.warning("%s; left out of this step's mean (on_bad_peer='drop')", line)
        self.peers_left_out += len(faults)
        return [r for r in range(self.replicas) if r not in faults]

    def _decode(self, recv: torch.Tensor) -> None:
        self._pending = None
        replicas = self.replicas
        if replicas > 1:
            step = next(int(self.state[p]["step"].item()) for ps in self._trained_params
                        for p in ps)
            kept = self._screen(recv, step)
            if not kept:
                return  # every node failed: the step applies nothing
            if len(kept) < replicas:
                recv = recv.view(replicas, -1)[kept].reshape(-1)
                replicas = len(kept)
        for group, params, (offset, n) in zip(self.param_groups, self._trained_params,
                                              self._layouts):
            if not params:
                continue
            gathered = recv
            if n * replicas != recv.numel():  # several param groups: this group's payloads
                gathered = recv.view(replicas, -1)[:, offset:offset + n].reshape(-1)
            locals_ = [_local(p) for p in params]
            layout = self._layout()
            if self.inner == "sgd":
                ops.decode_sgd(gathered, replicas, locals_, lr=group["lr"],
                               weight_decay=group["weight_decay"], sign=self.sign,
                               step_bound=self.step_bound, rms_cap=self.rms_cap, **layout)
            else:
                beta1, beta2 = group["betas"]
                state = [self.state[p] for p in params]
                ops.decode_adamw(gathered, replicas, locals_,
                                 [_local(s["exp_avg"]) for s in state],
                                 [_local(s["exp_avg_sq"]) for s in state], lr=group["lr"],
                                 weight_decay=group["weight_decay"], beta1=beta1, beta2=beta2,
                                 eps=group["eps"], step=int(state[0]["step"].item()) //
                                 self.exchange_every, sign=self.sign, **layout)


class DeMo(FlexDeMo):
    """A drop-in for the reference DeMo optimizer (``DeMo(params, compression_decay=0.999,
    compression_topk=32, compression_chunk=64, weight_decay=0.0, process_group=None, **kwargs)``,
    lr among the kwargs): sign-SGD on the replicas' decoded momentum, every rank of
    ``process_group`` (default: the world) a replica. Values travel as fp32 as the reference's
    do (``values=`` picks another encoding). Like the reference's users, turn off DDP's own
    all-reduce (or use no DDP). ``data_transmit`` / ``data_receive``: the last step's bytes."""

    def __init__(self, params, compression_decay: float = 0.999, compression_topk: int = 32,
                 compression_chunk: int = 64, weight_decay: float = 0.0, process_group=None,
                 lr: float = 1e-3, values: str = "fp32", **kwargs):
        for name in ("momentum", "dampening", "nesterov", "maximize"):
            if kwargs.get(name):
                raise _bad("DeMo: {}={!r}; the reference fixes it off (sign-SGD)".format(
                    name, kwargs[name]))
            kwargs.pop(name, None)
        kwargs.pop("foreach", None)
        kwargs.pop("differentiable", None)
        if kwargs:
            raise TypeError("DeMo got unexpected arguments: {}".format(", ".join(sorted(kwargs))))
        group = process_group if process_group is not None else dist.group.WORLD
        super().__init__(params, lr=lr, compression_decay=compression_decay,
                         compression_topk=compression_topk, compression_chunk=compression_chunk,
                         values=values, sign=True, rms_cap=0.0, precondition=False,
                         fold_lr=True, weight_decay=weight_decay, replicate_group=group)
        self.data_transmit = 0
        self.data_receive = 0

    @torch.no_grad()
    def step(self, closure=None):
        loss = super().step(closure)
        self.data_transmit = self.bucket_bytes
        self.data_receive = self.bucket_bytes * self.replicas
        return loss


def _check_options(lr, decay, topk, chunk, chunk_mode, values, inner, betas, eps, weight_decay,
                   exchange_every, on_nonfinite) -> None:
    def one_of(name, value, accepted):
        if value not in accepted:
            raise _bad("{} {!r}; accepted: {}".format(name, value, ", ".join(accepted)))

    if not lr > 0:
        raise _bad("lr {}; it must be > 0".format(lr))
    if not 0 <= decay < 1:
        raise _bad("compression_decay {}; it must be in [0, 1)".format(decay))
    if int(chunk) < 1:
        raise _bad("compression_chunk {}; it must be >= 1".format(chunk))
    if not 1 <= int(topk) <= int(chunk) ** 2:
        raise _bad("compression_topk {}; it must be in [1, {}] (the {}x{} chunk's coefficients)"
                   .format(topk, int(chunk) ** 2, chunk, chunk))
    one_of("chunk_mode", chunk_mode, ops.CHUNK_MODES)
    one_of("values", values, ops.VALUE_ENCODINGS)
    one_of("inner", inner, INNER)
    one_of("on_nonfinite", on_nonfinite, ON_NONFINITE)
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        raise _bad("betas {}; two numbers in [0, 1)".format(tuple(betas)))
    if not eps > 0:
        raise _bad("eps {}; it must be > 0".format(eps))
    if not (weight_decay >= 0 and lr * weight_decay < 1):
        raise _bad("weight_decay {}; it must be >= 0 with lr * weight_decay < 1".format(
            weight_decay))
    if int(exchange_every) < 1:
        raise _bad("exchange_every {}; it must be >= 1".format(exchange_every))


def _groups(mesh, replicate_group, shard_group):
    """The replicate and shard groups from a mesh or as given, checked against each other."""
    if mesh is not None:
        if replicate_group is not None or shard_group is not None:
            raise _bad("FlexDeMo: give mesh or replicate_group/shard_group, not both")
        names = mesh.mesh_dim_names or ()
        if mesh.ndim == 2 and tuple(names) == ("replicate", "shard"):
            replicate_group, shard_group = mesh.get_group("replicate"), mesh.get_group("shard")
        elif mesh.ndim == 1:
            replicate_group = mesh.get_group()
        else:
            raise _bad("FlexDeMo: mesh of dimensions {} {}; want ('replicate', 'shard') "
                       "(flexdemo.hybrid_mesh) or one dimension".format(
                           tuple(mesh.mesh.shape), tuple(names)))
    elif replicate_group is None and shard_group is None:
        replicate_group = dist.group.WORLD if dist.is_initialized() else None
    if (replicate_group is not None or shard_group is not None) and not dist.is_initialized():
        raise _bad("FlexDeMo: groups given but torch.distributed is not initialized")
    if replicate_group is not None and shard_group is not None:
        replicas, shards = _group_ranks(replicate_group), _group_ranks(shard_group)
        world = dist.get_world_size()
        if len(replicas) * len(shards) != world or set(replicas) & set(shards) != {
                dist.get_rank()}:
            raise _bad("FlexDeMo: replicate_group (ranks {}) and shard_group (ranks {}) do not "
                       "tile the world of {} ranks as nodes x ranks per node".format(
                           replicas, shards, world))
    return replicate_group, shard_group
