#!/usr/bin/env bash
# The GPU check: the one command to run on a machine with an NVIDIA GPU (made for the H200 one:
# CUDA, PyPI's torch in python3, CMake and ninja, no package manager). Builds flexdemo there
# against that python's LibTorch, with what the machine lacks taken from .gpu-deps/ (made here by
# scripts/fetch-gpu-deps.sh, unpacked there into a prefix of its own), runs the GPU tests and
# measurements, and writes OUT_DIR/gpu-check.json (and gpu-check.log):
#   payload_identical_cpu_gpu  the CUDA kernels' payloads, residuals and updates equal the CPU's
#                              portable kernels' bit for bit (test_gpu, every value encoding)
#   demo_step_ms, adamw_fused_step_ms   GPT-2 small shapes, top-k 32, chunk 64, bf16 values,
#                              measured in the same run (flexdemo bench optimizer --device cuda)
#   gpu_2x2 / cpu_2x2          2 nodes x 2 ranks sharing the GPU (MPI inside and between nodes),
#                              50 steps: final loss and whether the replicas stayed bit-identical,
#                              next to the same run on the CPU
#   nccl_smoke                 one rank per GPU, NCCL inside and between nodes
#   tokens_per_s, pytorch_tokens_per_s  gpt2-small training on one GPU against PyTorch eager on
#                              the same shapes and batch (bench/pytorch_gpt.py), same script
#   python_gpu_ops_identical   the Python package (python/, built against that torch): its torch
#                              ops on the GPU equal the CPU's portable kernels bit for bit, every
#                              encoding, and FlexDeMo trains there (tests/python/test_gpu_ops.py)
#   python_bench               python -m flexdemo.bench --scale 1 on the device: the ops' DeMo
#                              step, torch AdamW (foreach, fused), the plain-torch DeMo step
#   scripts/gpu-check.sh OUT_DIR
#   scripts/gpu-check.sh --rehearse OUT_DIR   the same steps on the CPU, a small model for the
#                                            speed runs: checks the script itself without a GPU
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
device=cuda speed_model=gpt2-small
if [ "${1:-}" = "--rehearse" ]; then
  shift
  device=cpu speed_model=gpt-nano
fi
out=${1:?usage: scripts/gpu-check.sh [--rehearse] OUT_DIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
log="$out/gpu-check.log"
: > "$log"
started=$SECONDS
python=${PYTHON:-python3}
say() { echo "gpu-check: $* ($((SECONDS - started)) s)" | tee -a "$log"; }
fail() { say "FAILED: $*"; exit 1; }

# ====== 1. Dependencies: the machine's own first, the carried packages for the rest ======
torch_root=$($python -c 'import os, torch; print(os.path.dirname(torch.__file__))') ||
  fail "no torch in $python"
prefix=/tmp/flexdemo-gpu-deps
rm -rf "$prefix"
mkdir -p "$prefix"
if compgen -G ".gpu-deps/*.deb" > /dev/null; then
  for f in .gpu-deps/*.deb; do dpkg -x "$f" "$prefix" || fail "unpacking $f"; done
fi
libdir=$prefix/usr/lib/x86_64-linux-gnu
export PATH="$PATH:$prefix/usr/bin"  # the machine's own tools win
export PKG_CONFIG_PATH="$libdir/pkgconfig:$prefix/usr/share/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
export LD_LIBRARY_PATH="$libdir:$libdir/openmpi/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
if [[ "$(command -v mpicxx)" == "$prefix"/* ]]; then
  export OPAL_PREFIX=$prefix/usr  # the carried OpenMPI, relocated
  say "OpenMPI: carried (Debian's, in $prefix)"
else
  say "OpenMPI: the machine's ($(command -v mpicxx || echo 'no mpicxx'))"
fi
{
  echo "== probe"; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  $python -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())'
  command -v nvcc cmake ninja mpirun mpicxx pkg-config
} >> "$log" 2>&1

# ====== 2. Build (ninja, every core) ======
build="build-gpu"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLEXDEMO_CUDA=ON \
  -DTorch_DIR="$torch_root/share/cmake/Torch" -DCMAKE_PREFIX_PATH="$torch_root;$prefix/usr" \
  >> "$log" 2>&1 || fail "configure (see $log)"
cmake --build "$build" -j "$(nproc)" --target flexdemo_cli flexdemo_tokenize test_gpu \
  >> "$log" 2>&1 || fail "build (see $log)"
say "built"

# ====== 3. Measurements ======
mpirun=(mpirun --allow-run-as-root --oversubscribe -x OMP_NUM_THREADS=1 -x LD_LIBRARY_PATH
        -x PATH)
[ -n "${OPAL_PREFIX:-}" ] && mpirun+=(-x OPAL_PREFIX)
work=$(mktemp -d)
corpus=$work/corpus.txt  # real English text that every checkout has
cat README.md docs/*.md ../shared/DESIGN.md 2> /dev/null > "$corpus"
export FLEXDEMO_TOKENIZE=$PWD/$build/flexdemo-tokenize

payload_identical=false
if "$build/tests/test_gpu" > "$work/test_gpu.txt" 2>&1 && ! grep -q "SKIPPED" "$work/test_gpu.txt"; then
  payload_identical=true  # passed, and not skipped (a skip means no GPU was seen)
fi
cat "$work/test_gpu.txt" >> "$log"
say "payloads identical: $payload_identical"

"$build/flexdemo" bench optimizer --device "$device" --scale 1 --topk 32 --chunk 64 --values bf16 \
  --steps 20 --json > "$work/bench.json" 2>> "$log" || say "bench optimizer failed (see $log)"
say "bench: $(cat "$work/bench.json")"

# A small GPT on the corpus, 2 nodes x 2 ranks sharing the GPU (MPI: NCCL cannot put two ranks of
# one communicator on one GPU); --check-replicas stops the run if any replica differs.
small=(train --model gpt-nano --tokenizer bytes --data "$corpus" --seq 64 --batch 16 --steps 50
       --eval-seqs 16 --check-replicas 10 --progress lines --ranks-per-node 2)
train_2x2() {  # DEVICE -> its run folder
  "${mpirun[@]}" -np 4 "$build/flexdemo" "${small[@]}" --device "$1" --intra-backend mpi \
    --inter-backend mpi --out "$work/$1" >> "$log" 2>&1
}
train_2x2 "$device"; gpu_rc=$?
train_2x2 cpu; cpu_rc=$?
say "2x2 runs: $device exit $gpu_rc, cpu exit $cpu_rc"

"${mpirun[@]}" -np 1 "$build/flexdemo" train --model gpt-nano --tokenizer bytes --data "$corpus" \
  --seq 64 --batch 8 --steps 5 --eval-seqs 8 --progress lines --device "$device" --intra-backend nccl \
  --inter-backend nccl --out "$work/nccl" >> "$log" 2>&1
nccl_rc=$?
say "NCCL smoke: exit $nccl_rc"

big=(--seq 256 --batch 16)
[ "$speed_model" = gpt-nano ] && big=(--seq 64 --batch 16)
"$build/flexdemo" train --model "$speed_model" --tokenizer bytes --data "$corpus" "${big[@]}" \
  --steps 30 --warmup 0 --eval-seqs 16 --optimizer adamw --device "$device" --progress lines \
  --out "$work/speed" >> "$log" 2>&1 || say "$speed_model training failed (see $log)"
vocab=$($python -c "import json; print(json.load(open('$work/speed/config.json'))['vocab_size'])" \
  2> /dev/null || echo 257)
shape=(--width 768 --layers 12 --heads 12 --context 1024)
[ "$speed_model" = gpt-nano ] && shape=(--width 128 --layers 4 --heads 4 --context 128)
$python bench/pytorch_gpt.py --device "$device" --vocab "$vocab" "${big[@]}" "${shape[@]}" \
  --steps 30 > "$work/pytorch.json" 2>> "$log" || say "PyTorch baseline failed"
say "speed runs done"

# The Python package against this python's torch, installed into the scratch folder only.
python_ops=false
if $python -m pip install --no-build-isolation --no-deps --target "$work/python" ./python \
    >> "$log" 2>&1; then
  if PYTHONPATH="$work/python" $python tests/python/test_gpu_ops.py > "$work/python_ops.txt" 2>&1 &&
    ! grep -q "SKIPPED" "$work/python_ops.txt"; then
    python_ops=true
  fi
  cat "$work/python_ops.txt" >> "$log"
  PYTHONPATH="$work/python" $python -m flexdemo.bench --device "$device" --scale 1 \
    --json "$work/python_bench.json" >> "$log" 2>&1 || say "python bench failed (see $log)"
else
  say "python package: build failed (see $log)"
fi
say "python package: ops identical $python_ops"

# ====== 4. The report ======
$python - "$work" "$payload_identical" "$gpu_rc" "$cpu_rc" "$nccl_rc" "$out/gpu-check.json" \
  "$((SECONDS - started))" "$device" "$python_ops" << 'EOF'
import json, os, sys
work, identical, gpu_rc, cpu_rc, nccl_rc, path, seconds, device, python_ops = sys.argv[1:]
def load(*parts):
    try:
        return json.load(open(os.path.join(work, *parts)))
    except (OSError, ValueError):
        return {}
bench = load("bench.json")
report = {
    "payload_identical_cpu_gpu": identical == "true",
    "demo_step_ms": bench.get("demo_ms"),
    "adamw_fused_step_ms": bench.get("adamw_fused_ms"),
    "adamw_step_ms": bench.get("adamw_ms"),
    "demo_over_fused": bench.get("ratio_fused"),
    "params": bench.get("params"),
    "gpu_2x2": {"replicas_identical": gpu_rc == "0",
                "final_val_loss": load(device, "summary.json").get("final_val_loss")},
    "cpu_2x2": {"replicas_identical": cpu_rc == "0",
                "final_val_loss": load("cpu", "summary.json").get("final_val_loss")},
    "nccl_smoke": nccl_rc == "0",
    "tokens_per_s": load("speed", "summary.json").get("tokens_per_s"),
    "pytorch_tokens_per_s": load("pytorch.json").get("tokens_per_s"),
    "python_gpu_ops_identical": python_ops == "true",
    "python_bench": load("python_bench.json"),
    "seconds": int(seconds),
    "device": device,  # cpu: a rehearsal (--rehearse), no GPU measured
}
report["replicas_identical"] = report["gpu_2x2"]["replicas_identical"]
json.dump(report, open(path, "w"), indent=2)
print(json.dumps(report, indent=2))
EOF
rm -rf "$work"
ok=$($python -c "import json; r = json.load(open('$out/gpu-check.json')); print(r['payload_identical_cpu_gpu'] and r['replicas_identical'] and r['nccl_smoke'] and (r['demo_step_ms'] or 1e9) <= 2.0)")
say "done: $([ "$ok" = True ] && echo passed || echo 'NOT passed') (report: $out/gpu-check.json)"
[ "$ok" = True ]
