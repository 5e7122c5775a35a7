"""FSDP2 + FlexDeMo on 4 real CPU ranks (torchrun, gloo): dist_flexdemo.py does the checks."""

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def test_fsdp2_flexdemo_2_nodes_x_2_ranks(tmp_path):
    out = tmp_path / "result.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
         os.path.join(HERE, "dist_flexdemo.py"), str(out)],
        capture_output=True, text=True, timeout=900, env=env, cwd=HERE)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    result = json.loads(out.read_text())
    print(json.dumps(result, indent=1))
    assert result["replicate_collectives"] == 20  # the DeMo all-gathers, one a step
    assert result["shard_collectives"] > 0
    assert result["hsdp_replicate_collectives"]  # the counter sees HSDP's all-reduces
    assert result["worst_relative"] < 1e-5
    assert "the parameters are sharded over ranks [0, 1]" in result["swapped_groups"]
