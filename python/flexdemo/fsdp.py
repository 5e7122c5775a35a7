"""Hybrid sharding for FlexDeMo with FSDP2: shard inside the node, DeMo between nodes.

FSDP2's own hybrid mode (``fully_shard`` on a 2-D mesh) all-reduces every gradient across the
replicate dimension, and no public switch turns off only that. So the model is sharded on the
node's shard sub-mesh alone: FSDP2 all-gathers parameters and reduce-scatters gradients inside
the node, the parameters are ``Shard(0)`` DTensors there, and FlexDeMo owns the exchange over
the mesh's replicate group. Ranks of one replicate group hold the same shard index, so their
shards have the same shapes.
"""

from __future__ import annotations

import os
from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn


def hybrid_mesh(ranks_per_node: Optional[int] = None, device_type: Optional[str] = None,
                island_nodes: int = 1):
    """The (replicate, shard) DeviceMesh of ``world / ranks_per_node`` nodes of
    ``ranks_per_node`` ranks each (default: torchrun's LOCAL_WORLD_SIZE); consecutive ranks
    form a node. With ``island_nodes`` > 1, consecutive nodes form islands of that many (the
    trainer's ``--island-nodes``): the shard dimension spans an island's ranks, the replicate
    dimension the islands."""
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        raise ValueError("flexdemo: hybrid_mesh needs torch.distributed initialized "
                         "(dist.init_process_group, e.g. under torchrun)")
    world = dist.get_world_size()
    if ranks_per_node is None:
        ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if ranks_per_node < 1 or world % ranks_per_node != 0:
        raise ValueError("flexdemo: ranks_per_node {}; it must divide the world of {} "
                         "ranks".format(ranks_per_node, world))
    nodes = world // ranks_per_node
    if island_nodes < 1 or nodes % island_nodes != 0:
        raise ValueError("flexdemo: island_nodes {}; it must be >= 1 and divide the {} "
                         "nodes".format(island_nodes, nodes))
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    island_ranks = ranks_per_node * island_nodes
    return init_device_mesh(device_type, (world // island_ranks, island_ranks),
                            mesh_dim_names=("replicate", "shard"))


@torch.no_grad()
def broadcast_from_rank0(model: nn.Module, group=None) -> None:
    """Every parameter and buffer as global rank 0 holds it (the replicas start equal)."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    for t in list(model.parameters()) + list(model.buffers()):
        dist.broadcast(t.data, src=src, group=group)


def shard_model(model: nn.Module, mesh, blocks: Optional[Iterable[nn.Module]] = None,
                reshard_after_forward: bool = True, mp_policy=None) -> nn.Module:
    """Makes the replicas equal (rank 0's weights everywhere), then, with more than one rank per
    node, shards ``model`` over ``mesh["shard"]`` with FSDP2: each of ``blocks`` (e.g. the
    transformer's layers) its own unit, the rest the root's. With one rank per node the model
    stays whole (DeMo between all ranks). Returns the model; pass ``mesh`` to FlexDeMo."""
    from torch.distributed.fsdp import fully_shard

    if tuple(mesh.mesh_dim_names or ()) != ("replicate", "shard"):
        raise ValueError("flexdemo: shard_model wants the (replicate, shard) mesh of "
                         "flexdemo.hybrid_mesh, got dimensions {}".format(mesh.mesh_dim_names))
    broadcast_from_rank0(model)
    shard = mesh["shard"]
    if shard.size() == 1:
        return model
    kwargs = dict(mesh=shard, reshard_after_forward=reshard_after_forward)
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    for block in blocks or ():
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model
