"""flexdemo for PyTorch: FlexDeMo (FSDP2 inside a node, DeMo's compressed exchange between
nodes) for your own training loop.

    import flexdemo
    mesh = flexdemo.hybrid_mesh(ranks_per_node=2)          # (replicate, shard) DeviceMesh
    flexdemo.shard_model(model, mesh, blocks=model.transformer.h)
    opt = flexdemo.FlexDeMo(model.parameters(), mesh=mesh, lr=1e-3)

``flexdemo.DeMo`` is a drop-in for the reference DeMo optimizer (same arguments). Both drive the
engine ``flexdemo train`` runs (``torch.classes.flexdemo.Engine``); ``flexdemo.options`` lists
its options and each step's defaults; ``flexdemo.ElasticLoadPlanner`` loads a DCP checkpoint
on another number of nodes.
"""

import os as _os

import torch as _torch

_torch.ops.load_library(_os.path.join(_os.path.dirname(__file__), "libflexdemo_ops.so"))

from . import ops, options  # noqa: E402  (the library must be loaded first)
from .checkpoint import ElasticLoadPlanner  # noqa: E402
from .fsdp import hybrid_mesh, shard_model  # noqa: E402
from .optim import DeMo, FlexDeMo  # noqa: E402

__all__ = ["DeMo", "ElasticLoadPlanner", "FlexDeMo", "hybrid_mesh", "shard_model", "ops",
           "options"]
__version__ = "0.1.0"
