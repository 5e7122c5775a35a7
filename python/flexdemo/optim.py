"""FlexDeMo and DeMo as torch optimizers: thin bindings of flexdemo's engine.

The step is the library's, the one ``flexdemo train`` runs (``torch.classes.flexdemo.Engine``,
over the replicate group's ``torch.distributed`` process group): every tensor's gradient (by
default first divided by the root of its running mean square) goes into its residual (decayed
momentum, kept as chunked DCT coefficients), each chunk's top-k leaves the residual as a compact
payload, the payloads cross the replicate group (one all-gather of a bucket, or the owners'
exchange), and the replicas' mean of every coefficient, transformed back, steps each parameter:
by the direction with its RMS capped per tensor (the default), by its sign (DeMo's) or by AdamW.
Every replica decodes the same bytes in the same order, so replicas stay bit-identical.

Here: parameter groups (one engine each: its weight decay, betas and eps; its learning rate read
at every step, so torch's schedulers work), FSDP2's DTensors (the step works on each rank's
local shard; the ranks of one replicate group hold the same shard index), the optimizer state as
torch's ``state_dict`` and DCP see it, and the non-finite gradient policy. The options, their
defaults and their checks are the engine's (``flexdemo.options``).
"""

from __future__ import annotations

import logging
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from . import options as _options
from .checkpoint import second_moment_kinds

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch without DTensor: plain tensors only
    DTensor = None

log = logging.getLogger("flexdemo")

ON_NONFINITE = ("skip", "stop")
# The engine's state kept once per replicate group (identical on every replica): saved as
# DTensors laid out as their parameters, the rest per rank.
_REPLICATED_STATE = ("exp_avg", "exp_avg_sq", "momentum", "committed")


def _is_dtensor(t) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if _is_dtensor(t) else t


def _bad(message: str) -> ValueError:
    return ValueError("flexdemo: " + message)


def _group_ranks(group) -> List[int]:
    return dist.get_process_group_ranks(group)


class _Exchange:
    """A step's exchange in flight: ``wait()`` completes it and applies the update."""

    def __init__(self, optimizer: "FlexDeMo", grads):
        self._optimizer, self._grads = optimizer, grads

    def wait(self) -> None:
        if self._optimizer is None:
            return
        optimizer, self._optimizer = self._optimizer, None
        optimizer._finish(self._grads)


class FlexDeMo(torch.optim.Optimizer):
    """DeMo between replicas (nodes), for parameters that are whole or FSDP2 shards.

    Args:
        params: float32 parameters (or param groups: lr, weight_decay, betas, eps per group),
            all on one device; plain tensors or the DTensors of ``fully_shard``.
        lr: learning rate (default: the step's, 1e-3 or 5e-4 with inner "adamw").
        step: the named step whose defaults apply (``flexdemo.options.STEPS``): "flexdemo" (the
            default: the direction, its RMS capped), "flexdemo-adamw" or "demo" (the reference
            DeMo's sign-SGD); by default chosen by inner.
        inner: "sgd" (the flexdemo step), "adamw" (the flexdemo-adamw step) or "nesterov".
        **options: any option of the engine by its name (``flexdemo.options.table()``, in
            docs/python.md), or by the reference DeMo's: compression_decay (decay),
            compression_topk (topk), compression_chunk (chunk), exchange_every
            (replicate_every), exchange ("all-gather" or "owners": demo_exchange), overlap
            (overlap_step), on_bad_peer (peer_policy), betas (beta1, beta2). Unset: the
            engine's default for the step, the same ``flexdemo train`` and the C++ library use.
            link_budget="auto" (and the link_* bounds) chooses top-k, values and the interval
            from the measured link and the time between two steps, as ``--link-budget auto``
            does; each choice is logged and kept in ``link_choices``.
        mesh: a DeviceMesh with dimensions ("replicate", "shard") (``flexdemo.hybrid_mesh``), or
            one dimension (replicas only). Or give the groups:
        replicate_group: the ranks that hold the same shard on other nodes (default: the world
            when neither mesh nor groups are given).
        shard_group: the ranks of this node that FSDP2 shards over (None: no sharding).
        on_nonfinite: a NaN/Inf gradient on any rank: "skip" skips the step on every rank alike
            (logged, counted in ``nonfinite_steps``; nothing is exchanged or changed), "stop"
            raises on every rank. As ``flexdemo train --on-nonfinite``.
    """

    _preset = None  # DeMo: the reference step

    def __init__(self, params, lr: Optional[float] = None, *, step: Optional[str] = None,
                 inner: Optional[str] = None, mesh=None, replicate_group=None, shard_group=None,
                 on_nonfinite: str = "skip", **options):
        if on_nonfinite not in ON_NONFINITE:
            raise _bad("on_nonfinite {!r}; accepted: {}".format(on_nonfinite,
                                                                ", ".join(ON_NONFINITE)))
        given = dict(options)
        if inner is not None:
            given["inner"] = inner
        if lr is not None:
            given["lr"] = lr
        if step is not None and step not in _options.STEPS:
            raise _bad("step {!r}; accepted: {}".format(step, ", ".join(_options.STEPS)))
        self.preset = step or self._preset or ""  # "": the engine's, by the inner rule
        self.given = _options.given(given)  # option -> value, as the user gave them
        self._second_moment_auto = self.given.get("second_moment", "auto") == "auto"
        self._spelling = _options.spelling(given)
        resolved = _options.resolve(self.preset, self.given, given)
        defaults = dict(lr=resolved["lr"], weight_decay=resolved["weight_decay"],
                        betas=(resolved["beta1"], resolved["beta2"]), eps=resolved["eps"])
        super().__init__(params, defaults)
        for name, value in resolved.items():  # the step's options, read-only by convention
            setattr(self, name, value)
        self.on_nonfinite = on_nonfinite
        self.replicate_group, self.shard_group = _groups(mesh, replicate_group, shard_group)
        self.replicas = dist.get_world_size(self.replicate_group) if self.replicate_group else 1
        self._check_params()
        # Per param group, the tensors a step updates (fixed: the engine's layout follows them)
        # and its engine; the group's lr is read at every step.
        self._trained_params = [self._trained(g) for g in self.param_groups]
        self._make_engines()
        self._pending: Optional[_Exchange] = None
        self._steps = 0
        self.link_choices: List[Dict] = []  # link_budget auto: each choice (step, topk, ...)
        self._link = self._link_budget(0)
        self._computing_since: Optional[float] = None
        self.nonfinite_steps = 0    # steps skipped for a non-finite gradient (on_nonfinite skip)
        self.peers_left_out = 0     # (node, step) pairs left out of a step's mean (on_bad_peer)

    # ====== Parameters, engines and state ======
    def _trained(self, group) -> List[torch.Tensor]:
        """The group's tensors a step updates. With a shard group every rank of it keeps the
        same ones, an empty local shard too (FSDP2 leaves one where dim 0 is shorter than the
        group): the engine gathers each tensor's sum of squares over the group by position."""
        sharded = self.shard_group is not None and dist.get_world_size(self.shard_group) > 1
        return [p for p in group["params"]
                if p.requires_grad and (sharded or _local(p).numel() > 0)]

    def _check_params(self) -> None:
        """What the binding adds to the engine's checks: a DTensor's sharding matches the
        shard group."""
        params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        if not params:
            raise _bad("FlexDeMo: no parameter requires grad")
        for p in params:
            if _is_dtensor(p) and self.shard_group is not None:
                sharded_over = _group_ranks(p.device_mesh.get_group())
                if p.device_mesh.ndim != 1 or sharded_over != _group_ranks(self.shard_group):
                    raise _bad("FlexDeMo: the parameters are sharded over ranks {} (their "
                               "DeviceMesh {}), shard_group holds ranks {}; give the group FSDP "
                               "shards over (flexdemo.shard_model: mesh['shard'])".format(
                                   sharded_over, tuple(p.device_mesh.mesh.shape),
                                   _group_ranks(self.shard_group)))

    def _make_engines(self) -> None:
        """Per param group its engine (None: no tensor it trains), its state bound."""
        self._engines = [self._engine(g, params) if params else None
                         for g, params in zip(self.param_groups, self._trained_params)]
        self._bind_state()
        self.bucket_bytes = sum(e.wire_bytes() for e in self._engines if e is not None)

    def _engine(self, group, params):
        given = dict(self.given, weight_decay=group["weight_decay"], beta1=group["betas"][0],
                     beta2=group["betas"][1], eps=group["eps"], lr=group["lr"])
        local = [_local(p).detach() for p in params]
        device = local[0].device
        def named(group):  # the group's name and where its collectives want buffers
            if group is None or dist.get_world_size(group) == 1:
                return "", "cpu"
            return group.group_name, (str(device) if "nccl" in str(dist.get_backend(group))
                                      else "cpu")

        return torch.classes.flexdemo.Engine(local, self.preset, _options.words(given),
                                             self._spelling, *named(self.replicate_group),
                                             *named(self.shard_group))

    def _link_budget(self, start_step: int):
        """link_budget auto: the engine's link budget over every engine (one schedule for all),
        agreeing over the shard group and then the replicate group (together the ranks that
        step, as the non-finite check agrees)."""
        engines = [e for e in self._engines if e is not None]
        self._link_steps = start_step  # step() calls, skipped ones too: the trainer's count
        if self.link_budget != "auto" or not engines:
            return None
        device = str(_local(next(ps[0] for ps in self._trained_params if ps)).device)
        groups, devices = [], []
        for group in (self.shard_group, self.replicate_group):
            if group is not None and dist.get_world_size(group) > 1:
                groups.append(group.group_name)
                devices.append(device if "nccl" in str(dist.get_backend(group)) else "cpu")
        return torch.classes.flexdemo.LinkBudget(engines, groups, devices, start_step)

    def _bind_state(self) -> None:
        """Every engine's state tensors in ``self.state`` (handles: loading copies into them),
        keyed by what they are: per parameter, and per rank where replicas differ."""
        where = "replica{}.shard{}".format(
            dist.get_rank(self.replicate_group) if self.replicate_group else 0,
            dist.get_rank(self.shard_group) if self.shard_group else 0)
        self._handles = []  # (param, key, engine tensor)
        for group, params, engine in zip(self.param_groups, self._trained_params, self._engines):
            for p in group["params"]:
                if p.requires_grad:
                    self.state[p]["step"] = torch.tensor(0.0)
            if engine is None:
                continue
            for name, t in zip(engine.state_names(), engine.state_tensors()):
                what, _, index = name.rpartition(".")
                if what and index.isdigit():
                    p = params[int(index)]
                else:  # the engine's own (the exchange in flight): kept with its first tensor
                    p, what = params[0], name
                if what in _REPLICATED_STATE and _is_dtensor(p):
                    key = what
                    value = DTensor.from_local(t.view(_local(p).shape), p.device_mesh,
                                               p.placements, run_check=False, shape=p.shape,
                                               stride=p.stride())
                elif what in _REPLICATED_STATE:
                    key, value = what, t
                else:
                    key, value = "{}.{}".format(what, where), t
                self.state[p][key] = value
                self._handles.append((p, key, t))

    def state_dict(self):
        """torch's, each parameter's "step" the steps taken (kept as one count while stepping);
        under link_budget auto also each engine's schedule ("link_schedule", with its first
        parameter: the same on every rank)."""
        # Bound again: the engine's tensors now (a schedule the link budget changed resizes the
        # exchange in flight's; the engine lets that exchange arrive first: it is state).
        self._bind_state()
        for g in self.param_groups:
            for p in g["params"]:
                if p.requires_grad:
                    self.state[p]["step"].fill_(self._steps)
        if self._link is not None:
            for params, engine in zip(self._trained_params, self._engines):
                if engine is not None:
                    self.state[params[0]]["link_schedule"] = torch.tensor(
                        engine.schedule_state(), dtype=torch.int64)
        state_dict = super().state_dict()
        # Under overlap, "previewed" is the parameters themselves (each replica's own: the
        # committed ones plus its preview): given as a copy, so that a load that also writes the
        # model (DCP: one replica's weights for all) does not overwrite it through the alias.
        # The exchange in flight's payloads are sized by its schedule: under link_budget auto
        # given at the most any schedule takes, so that a fresh optimizer's state (DCP's
        # template) has the shape of any checkpoint's.
        capacity = max((e.in_flight_capacity() for e in self._engines if e is not None),
                       default=0) if self._link is not None else 0

        def exported(key, value):
            if key.startswith("previewed."):
                return value.clone()
            if capacity and key.startswith("pending_payloads."):
                padded = value.new_zeros(capacity)
                padded[:value.numel()] = value
                return padded
            return value

        for index, state in state_dict["state"].items():
            if any(key.startswith(("previewed.", "pending_payloads.")) for key in state):
                state_dict["state"][index] = {key: exported(key, value)
                                              for key, value in state.items()}
        return state_dict

    def load_state_dict(self, state_dict) -> None:
        """torch's, then every engine tensor loaded from it and bound again (under link_budget
        auto after the schedule that sized the exchange in flight). A second moment of the other
        kind than this optimizer's (``ElasticLoadPlanner`` loads the checkpoint's) is kept under
        ``second_moment="auto"``, as ``flexdemo train --resume`` keeps it, and refused in one line
        under an explicit kind."""
        # torch.distributed.checkpoint's set_optimizer_state_dict hands over this optimizer's own
        # per-parameter dicts, loaded in place: held apart from self.state, which binding anew
        # overwrites.
        state_dict = dict(state_dict, state={index: dict(state)
                                             for index, state in state_dict["state"].items()})
        remade = self._keep_saved_second_moment(state_dict)
        super().load_state_dict(state_dict)
        steps = [self.state[p]["step"] for g in self.param_groups for p in g["params"]
                 if p.requires_grad]
        self._steps = int(steps[0].item()) if steps else 0
        # (torch's load casts state to the parameter's dtype: float32 holds these counts exactly
        # up to 2^24)
        schedules = [self.state[params[0]].get("link_schedule") if engine is not None else None
                     for params, engine in zip(self._trained_params, self._engines)]
        schedules = [None if s is None else [int(round(v)) for v in s.tolist()] for s in schedules]
        loaded = [self.state[p][key] for p, key, _ in self._handles]
        if any(s is not None for s in schedules):
            for engine, schedule in zip(self._engines, schedules):
                if schedule is not None:
                    engine.set_schedule_in_flight(schedule)
            self._bind_state()  # the exchange in flight's payloads sized by its schedule
        for (p, key, t), value in zip(self._handles, loaded):
            value = _local(value)
            if key.startswith("pending_payloads.") and value.numel() > t.numel():
                value = value[:t.numel()]  # given at the most any schedule takes (state_dict)
            t.copy_(value.reshape(t.shape))
            if remade and value.numel() == t.numel():
                # The loaded tensors belong to the engines made before (the caller's state dict
                # holds them): pointed at the new engines' instead, so that one copy of the
                # state stays in memory.
                value.set_(t.view(value.shape))
        self._fold_saved_owner_residual()
        for engine, schedule in zip(self._engines, schedules):
            if engine is None:
                continue
            if schedule is not None:
                engine.restore_schedule(schedule, self._steps)
            else:
                engine.restore_steps(self._steps)
        self._link = self._link_budget(self._steps)
        self._bind_state()
        for g in self.param_groups:
            for p in g["params"]:
                if p.requires_grad:
                    self.state[p]["step"].fill_(self._steps)

    def _fold_saved_owner_residual(self) -> None:
        """A checkpoint's owners' residual where this optimizer keeps none (another exchange or
        owner feedback; ``ElasticLoadPlanner`` loads it beside the residuals): added to each
        residual, ``owner_residual_weight`` times over (the engine's rule,
        src/optim/owner_replicator.cpp), as ``flexdemo train --resume`` does; then dropped."""
        handles = {(id(p), key): t for p, key, t in self._handles}
        for params, engine in zip(self._trained_params, self._engines):
            if engine is None:
                continue
            first = self.state[params[0]]
            for p in params:
                state = self.state[p]
                for key in [k for k in state
                            if "owner_residual." in k and (id(p), k) not in handles]:
                    value = state.pop(key)
                    what, _, where = key.partition(".replica")
                    residual = handles.get((id(p), what.replace("owner_residual", "residual") +
                                            ".replica" + where))
                    replicas = first.get(what.replace("owner_residual", "owner_replicas") +
                                         ".replica" + where)
                    kept_among = int(round(float(replicas.item()))) if replicas is not None else 0
                    if residual is not None and kept_among > 0:
                        replica = int(where.partition(".")[0])  # "replica{r}.shard{s}" here
                        weight = torch.ops.flexdemo.owner_residual_weight(
                            replica, self.replicas, kept_among)
                        residual.add_(_local(value).reshape(residual.shape).to(residual),
                                      alpha=weight)
            for key in [k for k in first
                        if "owner_replicas." in k and (id(params[0]), k) not in handles]:
                del first[key]

    def _keep_saved_second_moment(self, state_dict) -> bool:
        """second_moment auto chooses by the replicas a run starts on (shared from 4 on), so a
        checkpoint written on another number of nodes can hold the other kind: under auto the
        engines are made again with the checkpoint's kind, which stays this optimizer's (and so
        its checkpoints'); another kind given is refused in one line. The engine's rule, the
        trainer's too (flexdemo/elastic.h). Whether they were made again."""
        saved_keys = [key for state in state_dict.get("state", {}).values() for key in state]
        # (second_moment as constructed: auto stays auto over several loads)
        asked = dict(self.given, second_moment="auto") if self._second_moment_auto else self.given
        try:
            changed = _options.parsed(torch.ops.flexdemo.resumed_options(
                self.preset, _options.words(asked), self._spelling, saved_keys, self.replicas))
        except ValueError:
            self._drop_loaded_second_moment()
            raise
        given = dict(asked, **changed)
        resolved = _options.resolve(self.preset, given)
        if resolved == _options.resolve(self.preset, self.given):
            return False
        ours = second_moment_kinds(key for _, key, _ in self._handles)
        self.given = given
        for name, value in resolved.items():
            setattr(self, name, value)
        self._link = None  # one engine's state in memory at a time
        self._engines = [None] * len(self._engines)
        self._make_engines()
        if changed and (not dist.is_initialized() or dist.get_rank() == 0):
            log.warning("flexdemo: second_moment auto: the checkpoint's %s second moment kept "
                        "(auto chooses by the replicas a run starts on; this run alone would "
                        "take %s)", changed["second_moment"], "/".join(sorted(ours)))
        return True

    def _drop_loaded_second_moment(self) -> None:
        """Before a refusal: this optimizer's state as its engines hold it (ElasticLoadPlanner
        put the checkpoint's kind into the dicts DCP loads, which are this optimizer's own)."""
        for state in self.state.values():
            for key in [k for k in state if second_moment_kinds([k])]:
                del state[key]
        self._bind_state()

    # ====== Counters ======
    @property
    def exchanges(self) -> int:
        """Exchanges so far."""
        return next((e.exchanges() for e in self._engines if e is not None), 0)

    @property
    def bytes_sent(self) -> int:
        """This rank's bytes put on the replicate group (comm.h's count, as the trainer's)."""
        return sum(e.traffic()[0] for e in self._engines if e is not None)

    @property
    def bytes_received(self) -> int:
        return sum(e.traffic()[1] for e in self._engines if e is not None)

    def tamper_next_exchange(self, how: str, factor: float = 1.0) -> None:
        """A test aid: this rank's next payloads go out as a faulty node's would ("scale" by
        factor, NaN for non-finite values, or "corrupt")."""
        for engine in self._engines:
            if engine is not None:
                engine.tamper_next_exchange(how, float(factor))

    # ====== The step ======
    def _grads(self, params: List[torch.Tensor]) -> List[Optional[torch.Tensor]]:
        return [None if p.grad is None else _local(p.grad) for p in params]

    def _finite(self, grads: List[Optional[torch.Tensor]]) -> bool:
        """Whether every rank's gradients are finite (agreed over the shard and replicate
        groups: together the world)."""
        present = [g for g in grads if g is not None]
        finite = torch.tensor(int(torch.ops.flexdemo.all_finite(present)), dtype=torch.int32)
        for group in (self.shard_group, self.replicate_group):
            if group is not None and dist.get_world_size(group) > 1:
                on = present[0].device if present and "nccl" in str(
                    dist.get_backend(group)) else "cpu"
                t = finite.to(on)
                dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
                finite = t.cpu()
        return bool(finite.item())

    @torch.no_grad()
    def step(self, closure=None):
        """One step; with an exchange due, it waits for it and applies the update.
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
        """Starts this step's exchange (non-blocking where the exchange allows) and returns it;
        its ``wait()`` applies the update. None when the step was skipped. Until then the
        parameters are not updated and the gradients must not change: do other work (data,
        logging), not the next forward."""
        if self._pending is not None:
            raise RuntimeError("flexdemo: FlexDeMo.step_async: the previous exchange was not "
                               "waited for")
        if self._link is not None:
            self._follow_link()
        grads = [self._grads(params) for params in self._trained_params]
        step = self._steps + 1
        if not self._finite([g for gs in grads for g in gs]):
            if self.on_nonfinite == "stop":
                raise FloatingPointError(
                    "flexdemo: non-finite gradient at step {} (on_nonfinite='stop')".format(step))
            self.nonfinite_steps += 1
            self._computing_since = time.perf_counter()
            log.warning("flexdemo: step %d: non-finite gradient on some rank; the step is "
                        "skipped on every rank (on_nonfinite='skip')", step)
            return None
        for group, engine, gs in zip(self.param_groups, self._engines, grads):
            if engine is not None:
                engine.start(gs, group["lr"])
        self._pending = _Exchange(self, grads)
        return self._pending

    def _follow_link(self) -> None:
        """link_budget auto: a choice when one is due before this step (collective), then this
        step's compute (since the last step ended, the choice's own measuring left out)
        counted. Steps count as the trainer's do, skipped ones too."""
        now = time.perf_counter()
        step = self._link_steps
        self._link_steps += 1
        choice = self._link.before_step(step)
        if choice:
            line, topk, values, every = choice
            self.link_choices.append(dict(step=step + 1, topk=int(topk), values=values,
                                          every=int(every)))
            if not dist.is_initialized() or dist.get_rank() == 0:
                log.info("flexdemo: %s", line)
        # The first step of a run is not counted (it allocates): the budget drops the first.
        since = self._computing_since
        self._link.add_compute(0.0 if since is None else now - since)

    def _finish(self, grads) -> None:
        self._pending = None
        self._steps += 1
        for group, engine, gs in zip(self.param_groups, self._engines, grads):
            if engine is not None:
                engine.step(gs, group["lr"])
        self._report_peers()
        self._computing_since = time.perf_counter()

    def _report_peers(self) -> None:
        """One line per node whose payloads were left out of this step's mean."""
        faults: Dict[int, List] = {}
        for g, engine in enumerate(self._engines):
            if engine is not None:
                for replica, tensor, what in engine.take_peer_faults():
                    faults.setdefault(replica, []).append((g, tensor, what))
        for r, found in sorted(faults.items()):
            g, t, what = found[0]
            log.warning("flexdemo: step %d: node %d (rank %d) sent tensor %d of param group %d "
                        "with %s%s; left out of this step's mean (on_bad_peer='drop')",
                        self._steps, r, dist.get_global_rank(self.replicate_group, r), t, g,
                        what, " (and {} more tensors)".format(len(found) - 1)
                        if len(found) > 1 else "")
        self.peers_left_out += len(faults)


class DeMo(FlexDeMo):
    """A drop-in for the reference DeMo optimizer (``DeMo(params, compression_decay=0.999,
    compression_topk=32, compression_chunk=64, weight_decay=0.0, process_group=None, **kwargs)``,
    lr among the kwargs): the ``demo`` step (sign-SGD on the replicas' decoded momentum, values
    as fp32), every rank of ``process_group`` (default: the world) a replica. Like the
    reference's users, turn off DDP's own all-reduce (or use no DDP). ``data_transmit`` /
    ``data_receive``: the last step's bytes."""

    _preset = "demo"

    def __init__(self, params, compression_decay: float = 0.999, compression_topk: int = 32,
                 compression_chunk: int = 64, weight_decay: float = 0.0, process_group=None,
                 lr: float = 1e-3, **kwargs):
        for name in ("momentum", "dampening", "nesterov", "maximize"):
            if kwargs.get(name):
                raise _bad("DeMo: {}={!r}; the reference fixes it off (sign-SGD)".format(
                    name, kwargs[name]))
            kwargs.pop(name, None)
        kwargs.pop("foreach", None)
        kwargs.pop("differentiable", None)
        group = process_group if process_group is not None else (
            dist.group.WORLD if dist.is_initialized() else None)
        super().__init__(params, lr=lr, compression_decay=compression_decay,
                         compression_topk=compression_topk, compression_chunk=compression_chunk,
                         weight_decay=weight_decay, replicate_group=group, **kwargs)
        self.data_transmit = 0
        self.data_receive = 0

    @torch.no_grad()
    def step(self, closure=None):
        loss = super().step(closure)
        self.data_transmit = self.bucket_bytes
        self.data_receive = self.bucket_bytes * self.replicas
        return loss


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
