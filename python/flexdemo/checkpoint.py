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
        for key in list(self.state_dict):
            m = _PER_REPLICA.match(key)
            if not m:
                continue  # not FlexDeMo's: DCP's own rules
            shard = int(m["shard"])
            found = replicas.get((m["what"], shard))
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
