"""flexdemo's engine through the package: on 3 real replicas (torchrun, gloo) against float64
DeMo (engine_checks.py does the checks), the options as the engine declares them, and payload
sizes in closed form."""

import os

import pytest
import torch
from torchrun import succeeded, torchrun

import flexdemo
from flexdemo import ops

HERE = os.path.dirname(os.path.abspath(__file__))


def test_engine_on_3_replicas_follows_float64_demo():
    run = torchrun(3, "engine_checks.py")
    assert succeeded(run)
    assert "engine checks: all passed" in run.stdout


def test_payload_bytes_closed_form():
    # fp32, 1-byte positions (chunks of <= 256 coefficients): 36 + chunks * k * (1 + 4).
    p = torch.zeros(48, 40)  # 3 x 4 chunks of 16 x 10
    assert ops.payload_bytes([p], 16, "divisor", 6, "fp32") == [36 + 12 * 6 * 5]
    assert ops.payload_bytes([p], 16, "divisor", 6, "bf16") == [36 + 12 * 6 * 3]


def test_bad_layouts_are_named():
    p = [torch.zeros(8, 8)]
    with pytest.raises(ValueError, match="value encoding 'fp16'; accepted: fp32, bf16"):
        ops.payload_bytes(p, 4, "divisor", 2, "fp16")
    with pytest.raises(ValueError, match="chunk 0 and topk 2 must be > 0"):
        ops.payload_bytes(p, 0, "divisor", 2, "bf16")


def test_options_are_the_engines_declaration():
    """Every option the engine declares, once; each step's defaults read from it (not copied
    here): the three steps differ where their declaration says."""
    table = flexdemo.options.table()
    names = [name for name, _, _, _ in table]
    assert len(names) == len(set(names)) and all(help_ for _, _, _, help_ in table)
    accepts = {name: accepted for name, _, accepted, _ in table}
    assert (accepts["topk"], accepts["decay"], accepts["lr"]) == (">= 1", "[0, 1)", "> 0")
    flex = flexdemo.options.defaults("flexdemo")
    adamw = flexdemo.options.defaults("flexdemo-adamw")
    demo = flexdemo.options.defaults("demo")
    assert set(flex) == set(names)
    assert (flex["inner"], flex["sign"], flex["precondition"], flex["fold_lr"], flex["rms_cap"],
            flex["topk"], flex["values"]) == ("sgd", False, True, False, 1.0, 112, "fp8")
    assert (adamw["inner"], adamw["beta1"], adamw["topk"], adamw["values"]) == (
        "adamw", 0.0, 32, "bf16")
    assert (demo["sign"], demo["topk"], demo["values"], demo["fold_lr"]) == (True, 32, "fp32",
                                                                           True)
    # FlexDeMo and DeMo start from them.
    p = [torch.nn.Parameter(torch.zeros(8, 8))]
    opt = flexdemo.FlexDeMo(p)
    assert {name: getattr(opt, name) for name in names} == flex
    assert flexdemo.FlexDeMo(p, inner="adamw").beta1 == 0.0
    assert flexdemo.DeMo(p).sign is True


def test_owner_and_overlap_options_reach_the_engine():
    """Every capability of the trainer's step is an option here: one replica runs each."""
    torch.manual_seed(0)
    for options in (dict(exchange="owners"), dict(overlap=True), dict(inner_steps=4),
                    dict(exchange_every=2)):
        p = torch.nn.Parameter(torch.randn(16, 16))
        opt = flexdemo.FlexDeMo([p], compression_chunk=8, **options)
        before = p.detach().clone()
        for _ in range(4):
            p.grad = torch.randn(16, 16)
            opt.step()
        assert not torch.equal(p.detach(), before), options


def test_docs_hold_the_generated_options_table():
    """docs/python.md and docs/library.md carry `python -m flexdemo.options_doc`'s table."""
    root = os.path.dirname(os.path.dirname(HERE))
    for doc in ("python.md", "library.md"):
        text = open(os.path.join(root, "docs", doc)).read()
        begin, end = text.index(flexdemo.options.BEGIN), text.index(flexdemo.options.END)
        held = text[begin + len(flexdemo.options.BEGIN) + 1:end]
        assert held == flexdemo.options.markdown(), (
            "docs/{} is not current: regenerate with python -m flexdemo.options_doc".format(doc))
