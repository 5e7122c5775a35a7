"""Sizes of flexdemo's payloads, and what this build has. The step itself is the engine's
(``torch.classes.flexdemo.Engine``, driven by ``flexdemo.FlexDeMo``)."""

from __future__ import annotations

from typing import List, Sequence

import torch

VALUE_ENCODINGS = ("fp32", "bf16", "int8", "1bit", "2bit", "fp8")
CHUNK_MODES = ("divisor", "padded")

_ops = torch.ops.flexdemo


def payload_bytes(params: Sequence[torch.Tensor], chunk: int, chunk_mode: str, topk: int,
                  values: str) -> List[int]:
    """Each tensor's payload in bytes (36-byte header and checksum included), chunked by its
    own shape."""
    return list(_ops.payload_bytes(list(params), chunk, chunk_mode, topk, values))


def cuda_built() -> bool:
    """Whether this build has the CUDA kernels."""
    return bool(_ops.cuda_built())
