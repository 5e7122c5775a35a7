"""The suites' one launcher of real ranks: a script under torchrun on this machine's CPUs."""

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def torchrun(ranks, script, *args, env=None, timeout=600):
    """``python -m torch.distributed.run --standalone --nproc-per-node RANKS SCRIPT ARGS...``
    from tests/python, one thread a rank (OMP_NUM_THREADS=1, then `env` added); returns the
    finished process, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         str(ranks), os.path.join(HERE, script)] + [str(a) for a in args],
        capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, cwd=HERE)


def succeeded(run) -> bool:
    """Asserts the run exited 0, showing the ends of its output where it did not."""
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    return True
