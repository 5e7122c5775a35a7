"""Elastic resume of a DCP checkpoint: FlexDeMo's state on another number of replicas.

Each replica keeps state of its own (the DeMo residual, the preconditioner's running mean square,
an exchange in flight), saved under per-replica keys (``residual.replica1.shard0``); the state
every replica shares (AdamW's moments, the step count) is saved once, as DTensors where the
parameters are. A run with as many replicas loads as it is; one with another number R' loads
with ``ElasticLoadPlanner``: replica r takes the state of the checkpoint's replica r mod R, the
rule ``flexdemo train --resume`` follows (one function of the engine's:
include/flexdemo/elastic.h). The shard group keeps its size (the trainer also re-cuts shards;
Python does not yet: a different size is refused in one line), and so does the number of nodes
of a checkpoint taken with ``overlap_step`` (its exchange in flight is the old nodes' payloads;
the trainer settles it, Python refuses).

The owners' residual (``demo_exchange="owners"`` with ``owner_feedback="owner"``, the default) is
per-replica state like the residual; a checkpoint written with another exchange or feedback has
none, and this run's starts at zero. The engine folds what an owner holds into its residual where
the owners change: in rows it no longer owns, and all of it when the checkpoint's replicas were
another number.

The second moment's kind may differ too: ``second_moment="auto"`` shares it from 4 replicas on,
so a run resized across 4 finds the other kind's state in its checkpoint (``grad_sq``: each
replica's own; ``moment_rows``/``moment_cols``/``moment_own``: the shared one). The planner then
loads the checkpoint's kind in place of this run's, and ``FlexDeMo.load_state_dict`` keeps it
(under ``second_moment="auto"``, saying so in a line, as ``flexdemo train --resume`` does) or
refuses in one line naming the ``second_moment`` to pass.

    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path, planner=flexdemo.ElasticLoadPlanner())
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
"""

from __future__ import annotations

import re
from typing import Dict, Set

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

_PER_REPLICA = re.compile(r"^(?P<what>.*)\.replica(?P<replica>\d+)\.shard(?P<shard>\d+)$")


# The owners' residual (demo_exchange "owners", owner_feedback "owner") and the replicas it was
# kept among: state that a checkpoint of another exchange or feedback lacks (then zero).
OWNER_RESIDUAL_STATE = ("owner_residual", "owner_replicas")


def _kind_of(name: str):
    """The kind of second moment ("own", "shared") whose state `name` is, or None (the engine
    says: flexdemo/elastic.h)."""
    return torch.ops.flexdemo.second_moment_of(name) or None


def second_moment_kinds(keys) -> Set[str]:
    """The second moment's kinds among FlexDeMo's state keys (``grad_sq.replica0.shard0``, ...)."""
    return {_kind_of(key) for key in keys} - {None}


class ElasticLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, with FlexDeMo's per-replica keys the checkpoint lacks read
    from replica ``r mod R`` of the same shard (R: the checkpoint's replicas)."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        saved = set(self.metadata.state_dict_metadata) if self.metadata is not None else set()
        replicas: Dict[tuple, Set[int]] = {}  # (what, shard) -> the replicas saved
        for key in saved:
            m = _PER_REPLICA.match(key)
            if m:
                replicas.setdefault((m["what"], int(m["shard"])), set()).add(int(m["replica"]))
        self._load_saved_second_moment(replicas)
        self._load_saved_owner_residual(replicas)
        for key in list(self.state_dict):
            m = _PER_REPLICA.match(key)
            if not m:
                continue  # not FlexDeMo's: DCP's own rules
            shard = int(m["shard"])
            found = replicas.get((m["what"], shard))
            if not found and m["what"].rpartition(".")[2] in OWNER_RESIDUAL_STATE:
                # Written by another exchange or owner feedback: this run's starts at zero
                # (owner_replicas 0: kept among none).
                self.state_dict.pop(key).zero_()
                if self.flatten_state_dict:
                    self.mappings.pop(key)
                continue
            if not found:
                raise ValueError(
                    "flexdemo: the checkpoint has no {} for shard {}: it was written with "
                    "shard groups of another size; resume with shard groups of the same size "
                    "(each node's ranks)".format(m["what"], shard))
            replica = torch.ops.flexdemo.resumed_from_replica(int(m["replica"]), max(found) + 1)
            source = "{}.replica{}.shard{}".format(m["what"], replica, shard)
            here = tuple(self.state_dict[key].shape)
            there = tuple(self.metadata.state_dict_metadata[source].size)
            if here != there and m["what"].endswith("pending_payloads"):
                raise ValueError(
                    "flexdemo: the checkpoint holds an exchange in flight (overlap_step) among "
                    "another number of nodes; resume it on as many nodes")
            if here != there:
                raise ValueError(
                    "flexdemo: the checkpoint's {} of shard {} has shape {}, this run's {}: it "
                    "was written with shard groups of another size; resume with shard groups of "
                    "the same size (each node's ranks)".format(m["what"], shard, there, here))
            if source != key:
                self.state_dict[source] = self.state_dict.pop(key)
                if self.flatten_state_dict:
                    self.mappings[source] = self.mappings.pop(key)

    def _load_saved_owner_residual(self, replicas: Dict[tuple, Set[int]]) -> None:
        """Where the checkpoint holds the owners' residual and this run's state has none
        (another exchange or owner feedback), its entries are added to the state to load beside
        each parameter's residual (fresh tensors, under this rank's replica and shard), so that
        ``FlexDeMo.load_state_dict`` folds it into the residuals. A flattened optimizer state
        (whose keys name the parameter) has no place for them: there it is not loaded."""
        if not self.flatten_state_dict:
            return
        for key in list(self.state_dict):
            m = _PER_REPLICA.match(key)
            path = self.mappings.get(key, ())
            # The parameter's own state dict names it path[-1] ("residual.replica0.shard0", or
            # "outer.residual..." under inner_steps); a flattened optimizer state names more.
            if not m or not path or not key.endswith("." + path[-1]):
                continue
            state_name = path[-1]
            if not state_name.partition(".replica")[0].split(".")[-1] == "residual":
                continue
            for owned in OWNER_RESIDUAL_STATE:
                new_name = state_name.replace("residual.replica", owned + ".replica")
                new_key = key[:len(key) - len(state_name)] + new_name
                what = _PER_REPLICA.match(new_key)["what"]
                found = replicas.get((what, int(m["shard"])))
                if not found or new_key in self.state_dict:
                    continue
                source = "{}.replica{}.shard{}".format(what, max(found), m["shard"])
                saved = self.metadata.state_dict_metadata[source]
                tensor = torch.empty(tuple(saved.size), dtype=saved.properties.dtype,
                                     device=self.state_dict[key].device)
                parent = self.original_state_dict
                for step in path[:-1]:
                    parent = parent[step]
                parent[new_name] = tensor
                self.state_dict[new_key] = tensor
                self.mappings[new_key] = tuple(path[:-1]) + (new_name,)

    def _load_saved_second_moment(self, replicas: Dict[tuple, Set[int]]) -> None:
        """Where this run's second moment keeps other state than the checkpoint's (the other
        kind, or the shared one summed at another interval: ``moment_own``), its keys in the
        state to load are replaced by the checkpoint's (fresh tensors of their shapes, under this
        rank's replica and shard), so that the load brings the checkpoint's statistics and
        ``FlexDeMo.load_state_dict`` decides, by the engine's rule, whether to keep them."""
        def kind_and_name(what):
            prefix, _, name = what.rpartition(".")
            return _kind_of(name), prefix, name

        held = {(kind, name) for kind, _, name in (kind_and_name(what) for what, _ in replicas)
                if kind is not None}  # the checkpoint's second moment: (kind, name)
        saved_kinds = {kind for kind, _ in held}
        wanted = {}  # key -> (kind, prefix, replica, shard) of this run's second moment
        wanted_names = set()
        for key in self.state_dict:
            m = _PER_REPLICA.match(key)
            kind, prefix, name = kind_and_name(m["what"]) if m else (None, "", "")
            if kind is not None:
                wanted[key] = (kind, prefix, int(m["replica"]), int(m["shard"]))
                wanted_names.add(name)
        if len(saved_kinds) != 1 or not wanted or wanted_names == {name for _, name in held}:
            return
        (saved_kind,) = saved_kinds
        # The swap renames a state entry within its parameter's dict: the nested optimizer state
        # (DCP's flattening, the default), not get_optimizer_state_dict's flattened one
        # (StateDictOptions(flatten_optimizer_state_dict=True)), whose keys name the parameter.
        nested = self.flatten_state_dict and all(
            self.mappings[key][-1] == key[len(prefix) + 1:]
            for key, (_, prefix, _, _) in wanted.items())
        if not nested:
            raise ValueError("flexdemo: the checkpoint holds the {} second moment and this run's "
                             "keeps other state, which a load can swap in a nested optimizer "
                             "state only (flatten_state_dict=True, flatten_optimizer_state_dict="
                             "False): pass second_moment=\"{}\"".format(saved_kind, saved_kind))
        for key, (_, prefix, replica, shard) in wanted.items():
            template = self.state_dict.pop(key)
            path = self.mappings.pop(key)
            parent = self.original_state_dict
            for step in path[:-1]:
                parent = parent[step]
            parent.pop(path[-1], None)
            for name in torch.ops.flexdemo.second_moment_state(saved_kind):
                found = replicas.get((prefix + "." + name, shard))
                new_key = "{}.{}.replica{}.shard{}".format(prefix, name, replica, shard)
                if not found or new_key in self.state_dict:
                    continue
                source = "{}.{}.replica{}.shard{}".format(prefix, name, max(found), shard)
                saved = self.metadata.state_dict_metadata[source]
                tensor = torch.empty(tuple(saved.size), dtype=saved.properties.dtype,
                                     device=template.device)
                new_path = tuple(path[:-1]) + ("{}.replica{}.shard{}".format(name, replica,
                                                                           shard),)
                parent[new_path[-1]] = tensor
                self.state_dict[new_key] = tensor
                self.mappings[new_key] = new_path
