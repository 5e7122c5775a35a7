"""One engine behind both doors: the same parameters and gradients through the C++ API (the
Optimizer `flexdemo train` builds, under mpirun) and Python's FlexDeMo (torchrun, gloo), 2
replicas x 2 shards, every step (flexdemo, flexdemo-adamw, demo), both exchanges (all-gather,
owners) and the shared second moment: parameters and optimizer state bit-identical. The C++ door
is tests/cross_front.cpp, built in build-cuda/ (the LibTorch of this Python's torch) by
scripts/test.sh --cuda, or named by FLEXDEMO_CROSS_FRONT."""

import os
import shutil
import subprocess

import numpy as np
from torchrun import succeeded, torchrun

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SHAPES = [(48, 40), (30,), (4, 6, 5), (32, 64)]
STEPS = 4
CONFIGS = ["{} chunk=16 demo_exchange={}".format(step, exchange)
           for step in ("flexdemo", "flexdemo-adamw", "demo")
           for exchange in ("all-gather", "owners")] + [
    # The second moment shared by the replicas (summed every 3 of the 4 steps: the last one's
    # own statistics are state), and with the owners' exchange (every step).
    "flexdemo chunk=16 second_moment=shared second_moment_every=3",
    "flexdemo chunk=16 demo_exchange=owners second_moment=shared"]


def cross_front_binary():
    path = os.environ.get("FLEXDEMO_CROSS_FRONT",
                          os.path.join(ROOT, "build-cuda", "tests", "cross_front"))
    assert os.path.exists(path), (
        "{} is missing: build it (scripts/build.sh --cuda cross_front) or name it in "
        "FLEXDEMO_CROSS_FRONT".format(path))
    return path


def run_both(tmp_path, configs, shards, replicas):
    """Both doors on the same data: per config line and rank, the C++ door's and the Python
    door's files (parameters and state; bytes sent)."""
    binary = cross_front_binary()
    rng = np.random.default_rng(5)
    numel = sum(int(np.prod(s)) for s in SHAPES)
    (tmp_path / "shapes.txt").write_text("\n".join(" ".join(map(str, s)) for s in SHAPES) + "\n")
    rng.standard_normal(numel, dtype=np.float32).tofile(tmp_path / "params.f32")
    (rng.standard_normal(STEPS * replicas * numel, dtype=np.float32) * 0.1).tofile(
        tmp_path / "grads.f32")
    (tmp_path / "configs.txt").write_text("\n".join(configs) + "\n")
    cpp, py = tmp_path / "cpp", tmp_path / "py"
    cpp.mkdir()
    py.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    mpirun = shutil.which("mpirun")
    assert mpirun, "mpirun is missing (Debian's openmpi-bin: scripts/install-deps.sh)"
    ranks = str(shards * replicas)
    run = subprocess.run([mpirun, "--allow-run-as-root", "--oversubscribe", "-np", ranks, binary,
                          str(tmp_path), str(cpp), str(shards)], capture_output=True, text=True,
                         timeout=600, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert succeeded(torchrun(ranks, "cross_front_py.py", tmp_path, py, shards))
    return cpp, py


def test_cpp_api_and_python_take_bit_identical_steps(tmp_path):
    cpp, py = run_both(tmp_path, CONFIGS, shards=2, replicas=2)
    start = np.fromfile(tmp_path / "params.f32", dtype=np.float32)
    for line, config in enumerate(CONFIGS):
        for rank in range(4):
            name = "{}.rank{}.f32".format(line, rank)
            a, b = (cpp / name).read_bytes(), (py / name).read_bytes()
            assert len(a) == len(b) > 0, (config, rank, len(a), len(b))
            assert a == b, "{}: rank {} differs (C++ against Python)".format(config, rank)
        moved = np.fromfile(cpp / "{}.rank0.f32".format(line), dtype=np.float32)[:8]
        assert not np.array_equal(moved, start[:8]), config + ": nothing moved"


def test_owners_bytes_a_node_equal_the_cpp_doors_at_4_replicas(tmp_path):
    """4 replicas x 1: the owners' exchange through Python sends what it sends through the C++
    door (bytes and results), and less than the all-gather's 3 payloads a node (each replica's
    own second moment in both). Then the shared second moment at 4 replicas, summed every step:
    its sum adds in rank order on MPI and gloo alike (src/comm/rank_order_sum.h), so both doors
    still agree bit for bit; with the statistics at fp32, at bf16 (half their bytes) and at log8
    (a quarter), which is the owners' default (second_moment_values auto)."""
    configs = ["flexdemo chunk=16 demo_exchange=owners second_moment=own",
               "flexdemo chunk=16 second_moment=own",
               "flexdemo chunk=16 demo_exchange=owners second_moment_values=fp32",
               "flexdemo chunk=16 demo_exchange=owners second_moment_values=bf16",
               "flexdemo chunk=16 demo_exchange=owners second_moment_values=log8",
               "flexdemo chunk=16 demo_exchange=owners"]
    cpp, py = run_both(tmp_path, configs, shards=1, replicas=4)
    sent = {}
    for line, config in enumerate(configs):
        for rank in range(4):
            stem = "{}.rank{}".format(line, rank)
            assert (cpp / (stem + ".f32")).read_bytes() == (py / (stem + ".f32")).read_bytes(), (
                config, rank)
            a, b = int((cpp / (stem + ".bytes")).read_text()), int((py / (stem + ".bytes")).read_text())
            assert a == b > 0, (config, rank, a, b)
            sent.setdefault(line, []).append(a)
    owners, all_gather = sum(sent[0]), sum(sent[1])
    assert owners < all_gather * 2 / 3 + 1, (owners, all_gather)
    assert sum(sent[3]) < sum(sent[2]), (sent[3], sent[2])  # the statistics at half the bytes
    assert sum(sent[4]) < sum(sent[3]), (sent[4], sent[3])  # and at a quarter
    assert sent[5] == sent[4]  # the default
