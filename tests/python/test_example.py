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
