"""examples/python/train_gpt.py, briefly (a small model, a few steps): it trains both
optimizers under torchrun on 4 ranks, prints their validation loss and bytes between nodes, and
saves checkpoints and models transformers loads."""

import json
import os

import pytest
from torchrun import succeeded, torchrun

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_example_trains_both_and_saves(tmp_path, family):
    text = tmp_path / "text.txt"
    text.write_text("\n".join("the {} quick brown fox {} jumps over the lazy dog {}".format(
        i, i * 7 % 13, i % 5) for i in range(2000)))
    out = tmp_path / "run"
    run = torchrun(4, os.path.join(ROOT, "examples", "python", "train_gpt.py"), "--data", text,
                   "--out", out, "--steps", 8, "--eval-every", 4, "--eval-seqs", 8, "--vocab", 300,
                   "--width", 64, "--layers", 1, "--seq", 32, "--chunk", 16, "--topk", 8,
                   "--warmup", 2, "--model", family)
    assert succeeded(run)
    assert "fewer bytes between nodes" in run.stdout
    results = {r["optimizer"]: r for r in json.loads((out / "results.json").read_text())["results"]}
    assert set(results) == {"flexdemo", "adamw-hsdp"}
    for name, r in results.items():
        assert len(r["evals"]) == 2 and r["evals"][1][1] < r["evals"][0][1], (name, r)
        assert (out / name / "checkpoint" / ".metadata").exists()
    flex, hsdp = results["flexdemo"], results["adamw-hsdp"]
    assert hsdp["bytes_between_nodes_per_step_and_rank"] > 10 * flex[
        "bytes_between_nodes_per_step_and_rank"]

    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(out / "flexdemo" / "model")
    assert model.config.model_type == {"gpt": "gpt2", "llama": "llama"}[family]
    assert (out / "flexdemo" / "model" / "tokenizer.model").exists()


def test_example_trains_across_islands(tmp_path):
    """The example on 2 islands x 2 nodes x 1 rank (--ranks-per-node 1 --island-nodes 2: FSDP2
    shards across each island's two nodes, FlexDeMo between the islands) against 2 nodes x 2
    ranks, FlexDeMo (on islands AdamW-HSDP too, for the summary): the meshes make the same shard
    and replicate groups of the same ranks (the trainer's layout test, tests/islands.sh), so
    every validation loss and the bytes between replicas must be equal, bit for bit; a bad
    island size ends in one line."""
    text = tmp_path / "text.txt"
    text.write_text("\n".join("island {} sends {} to island {}".format(i, i * 3 % 11, i % 2)
                              for i in range(2000)))
    common = ["--data", text, "--steps", 8, "--eval-every", 2,
              "--eval-seqs", 8, "--vocab", 300, "--width", 64, "--layers", 1, "--seq", 32,
              "--chunk", 16, "--topk", 8, "--warmup", 2]
    script = os.path.join(ROOT, "examples", "python", "train_gpt.py")
    results = {}
    # On islands AdamW-HSDP too (FSDP2 on the islands' 2-D mesh), for the comparison's line.
    for layout, extra in (("nodes", ["--ranks-per-node", 2, "--optimizers", "flexdemo"]),
                          ("islands", ["--ranks-per-node", 1, "--island-nodes", 2,
                                       "--optimizers", "flexdemo,adamw-hsdp"])):
        out = tmp_path / layout
        run = torchrun(4, script, "--out", out, *common, *extra)
        assert succeeded(run)
        results[layout] = json.loads((out / "results.json").read_text())["results"][0]
        assert "bytes between {}/step/rank".format(layout) in run.stdout
    assert "fewer bytes between islands" in run.stdout
    nodes, islands = results["nodes"], results["islands"]
    assert len(islands["evals"]) == 4 and islands["evals"][-1][1] < islands["evals"][0][1]
    assert islands["evals"] == nodes["evals"], (islands["evals"], nodes["evals"])
    assert islands["bytes_between_nodes_per_step_and_rank"] == \
        nodes["bytes_between_nodes_per_step_and_rank"] > 0

    bad = torchrun(4, script, "--out", tmp_path / "bad", *common, "--ranks-per-node", 1,
                   "--island-nodes", 3, "--optimizers", "flexdemo")
    assert bad.returncode != 0
    assert "train_gpt: flexdemo: island_nodes 3; it must be >= 1 and divide the 4 nodes" in \
        bad.stdout + bad.stderr
