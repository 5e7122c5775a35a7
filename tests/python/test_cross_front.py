"""One engine behind both doors: the same parameters and gradients through the C++ API (the
Optimizer `flexdemo train` builds, under mpirun) and Python's FlexDeMo (torchrun, gloo), 2
replicas x 2 shards, every step (flexdemo, flexdemo-adamw, demo) and both exchanges (all-gather,
owners): parameters and optimizer state bit-identical. The C++ door is tests/cross_front.cpp,
built in build-cuda/ (the LibTorch of this Python's torch) by scripts/test.sh --cuda, or named by
FLEXDEMO_CROSS_FRONT."""

import os
import shutil
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SHAPES = [(48, 40), (30,), (4, 6, 5), (32, 64)]
STEPS = 4
CONFIGS = ["{} chunk=16 demo_exchange={}".format(step, exchange)
           for step in ("flexdemo", "flexdemo-adamw", "demo")
           for exchange in ("all-gather", "owners")]


def cross_front_binary():
    path = os.environ.get("FLEXDEMO_CROSS_FRONT",
                          os.path.join(ROOT, "build-cuda", "tests", "cross_front"))
    assert os.path.exists(path), (
        "{} is missing: build it (scripts/build.sh --cuda cross_front) or name it in "
        "FLEXDEMO_CROSS_FRONT".format(path))
    return path


def test_cpp_api_and_python_take_bit_identical_steps(tmp_path):
    binary = cross_front_binary()
    rng = np.random.default_rng(5)
    numel = sum(int(np.prod(s)) for s in SHAPES)
    (tmp_path / "shapes.txt").write_text("\n".join(" ".join(map(str, s)) for s in SHAPES) + "\n")
    rng.standard_normal(numel, dtype=np.float32).tofile(tmp_path / "params.f32")
    (rng.standard_normal(STEPS * 2 * numel, dtype=np.float32) * 0.1).tofile(tmp_path / "grads.f32")
    (tmp_path / "configs.txt").write_text("\n".join(CONFIGS) + "\n")
    cpp, py = tmp_path / "cpp", tmp_path / "py"
    cpp.mkdir()
    py.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    mpirun = shutil.which("mpirun")
    assert mpirun, "mpirun is missing (Debian's openmpi-bin: scripts/install-deps.sh)"
    run = subprocess.run([mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "4", binary,
                          str(tmp_path), str(cpp)], capture_output=True, text=True, timeout=600,
                         env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "4", os.path.join(HERE, "cross_front_py.py"),
                          str(tmp_path), str(py)], capture_output=True, text=True, timeout=600,
                         env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    for line, config in enumerate(CONFIGS):
        for rank in range(4):
            name = "{}.rank{}.f32".format(line, rank)
            a, b = (cpp / name).read_bytes(), (py / name).read_bytes()
            assert len(a) == len(b) > 0, (config, rank, len(a), len(b))
            assert a == b, "{}: rank {} differs (C++ against Python)".format(config, rank)
        start = np.fromfile(tmp_path / "params.f32", dtype=np.float32)
        moved = np.fromfile(cpp / "{}.rank0.f32".format(line), dtype=np.float32)[:8]
        assert not np.array_equal(moved, start[:8]), config + ": nothing moved"
