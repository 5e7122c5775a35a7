"""FSDP2 + FlexDeMo on 4 real CPU ranks (torchrun, gloo): dist_flexdemo.py does the checks."""

import json

from torchrun import succeeded, torchrun


def test_fsdp2_flexdemo_2_nodes_x_2_ranks(tmp_path):
    out = tmp_path / "result.json"
    assert succeeded(torchrun(4, "dist_flexdemo.py", out, timeout=900))
    result = json.loads(out.read_text())
    print(json.dumps(result, indent=1))
    assert result["replicate_collectives"] == 20  # the DeMo all-gathers, one a step
    assert result["shard_collectives"] > 0
    assert result["hsdp_replicate_collectives"]  # the counter sees HSDP's all-reduces
    assert result["worst_relative"] < 1e-5
    assert "the parameters are sharded over ranks [0, 1]" in result["swapped_groups"]


def test_fsdp2_empty_local_shard_with_whole_tensor_rms(tmp_path):
    """dist_empty_shard.py: a parameter FSDP2 leaves empty on one rank, the RMS cap gathered."""
    run = torchrun(2, "dist_empty_shard.py", timeout=300)
    print(run.stdout)
    assert succeeded(run)


def test_hybrid_mesh_with_islands():
    """dist_islands.py: islands of nodes mesh the ranks as the trainer's --island-nodes does."""
    run = torchrun(4, "dist_islands.py", timeout=300)
    print(run.stdout)
    assert succeeded(run)
