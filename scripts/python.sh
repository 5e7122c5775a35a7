#!/usr/bin/env bash
# The Python package (python/): flexdemo's DeMo step as torch ops, FlexDeMo and DeMo optimizers,
# FSDP2 hybrid sharding. Runs in .venv-cuda/ (scripts/install-deps.sh --cuda makes it: PyPI's
# torch, transformers, scikit-build-core, pytest), or in the Python named by FLEXDEMO_PYTHON.
#   scripts/python.sh install   builds the package against that Python's torch and installs it
#                               (pip install --no-build-isolation ./python; reuses python/build/)
#   scripts/python.sh test      its tests (tests/python/): the ops against float64 DeMo, opcheck,
#                               the optimizers, bad input, torchrun on 4 CPU ranks
#   scripts/python.sh example [ARGS]   examples/python/train_gpt.py under torchrun, 2 nodes x 2
#                               ranks: FlexDeMo against AdamW-HSDP (ARGS go to the script)
#   scripts/python.sh bench [ARGS]     python -m flexdemo.bench (one thread)
#   scripts/python.sh project [ARGS]   python -m flexdemo.project: step time and bytes per node
#                               of each exchange on many nodes (docs/results/many-nodes.md)
set -euo pipefail
cd "$(dirname "$0")/.."
python="${FLEXDEMO_PYTHON:-.venv-cuda/bin/python}"
if [ -z "${FLEXDEMO_PYTHON:-}" ]; then bash scripts/install-deps.sh --cuda; fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
what="${1:-}"
shift || true
case "$what" in
  install)
    CMAKE_BUILD_PARALLEL_LEVEL="${FLEXDEMO_JOBS:-2}" "$python" -m pip install \
      --disable-pip-version-check --no-build-isolation --no-deps ./python ;;
  test)
    exec "$python" -m pytest -q tests/python "$@" ;;
  example)
    exec "$python" -m torch.distributed.run --standalone --nproc-per-node 4 \
      examples/python/train_gpt.py "$@" ;;
  bench)
    exec "$python" -m flexdemo.bench "$@" ;;
  project)
    exec "$python" -m flexdemo.project "$@" ;;
  *)
    echo "python.sh: unknown command '$what'; accepted: install, test, example, bench, project" >&2
    exit 2 ;;
esac
