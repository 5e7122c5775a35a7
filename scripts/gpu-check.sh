#!/usr/bin/env bash
# The GPU check: the one command to run on a machine with an NVIDIA GPU (made for the lent H100 or
# H200: CUDA, PyPI's torch in python3, CMake and ninja, OpenMPI's mpirun, no -dev packages, no
# network). It has one deadline (--deadline, default 480 s: a lease's command may run 600 s),
# and every step's limit is clamped to what is left of it; a step with under 15 s left is
# skipped. OUT_DIR/gpu-check.json (every step's exit, seconds and limit, a failure's last lines,
# and what was measured) is rewritten after each step, so a lease that ends early still leaves
# everything measured so far. OUT_DIR holds at most four files: gpu-check.json, gpu-check.log
# (every step's output), encode.ncu-rep (one profile) and mismatch.tar.gz (test_gpu's dumps of
# a bucket that differs). The steps, by what they tell (what needs no GPU runs before the lease:
# the model's prediction is docs/results/data/gpu-model-h100.json or -h200.json, the CPU's
# training is CI's):
#   probe            GPU, driver, compute mode, torch, CUDA, NCCL, nvcc, OpenMPI, CMake versions
#   builds, at once: python_build, the Python package (python/) against python3's torch (needs
#                    only torch, a compiler, CMake and nvcc); unpack, configure, build: the C++
#                    library, CLI and GPU tests against that torch, with what the machine lacks
#                    taken from .gpu-deps/ (scripts/fetch-gpu-deps.sh, unpacked into a prefix of
#                    its own); the nvcc command line of the kernels goes to the log
#   test_gpu         the CUDA kernels' payloads, residuals and updates equal the CPU's portable
#                    kernels' bit for bit (every value encoding), every launch checked at once
#                    (FLEXDEMO_CUDA_SYNC=1)
#   bench            flexdemo bench optimizer --device cuda, GPT-2 small shapes, top-k 32, chunk
#                    64, bf16: demo_step_ms and each kernel's time beside the model's prediction,
#                    and torch's fused AdamW in the same run
#   train_gpu        2 nodes x 1 rank sharing the GPU (MPI), 20 steps, the replicas checked
#   train_gpu_owners the same with the owners' exchange (buckets of some tensors decoded)
#   python_ops       the package's engine on the GPU equals the CPU's portable kernels bit for
#                    bit, every encoding, and FlexDeMo trains there (tests/python/test_gpu_ops.py)
#   python_bench     python -m flexdemo.bench --scale 1: DeMo.step and FlexDeMo.step against torch
#                    AdamW (foreach, fused) and the plain-torch DeMo step
#   nccl_smoke       one rank, NCCL inside and between nodes: the communicator's life
#   then, while time is left: memcheck, racecheck (compute-sanitizer over one encoding's kernel
#   test), ncu_encode (one Nsight Compute profile of the encode kernel, --clock-control none),
#   speed and pytorch (gpt2-small training tokens/s against PyTorch eager on the same shapes)
#
#   scripts/gpu-check.sh [--deadline SECONDS] OUT_DIR
#   scripts/gpu-check.sh --rehearse [--deadline SECONDS] OUT_DIR   the same steps on the CPU
#       (small speed model, no sanitizer or profiler): checks the script itself without a GPU;
#       scripts/gpu-rehearsal.sh runs it in an environment shaped like the GPU machine's
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
usage="usage: scripts/gpu-check.sh [--rehearse] [--deadline SECONDS] OUT_DIR"
device=cuda speed_model=gpt2-small bench_scale=1 deadline=480
while [ $# -gt 1 ]; do
  case "$1" in
    --rehearse) device=cpu speed_model=gpt-nano bench_scale=0.25; shift ;;
    --deadline)
      [[ "${2:-}" =~ ^[0-9]+$ ]] && [ "$2" -gt 0 ] ||
        { echo "gpu-check: --deadline '${2:-}': expected a whole number of seconds > 0" >&2; exit 2; }
      deadline=$2; shift 2 ;;
    *) echo "gpu-check: unknown option '$1'; $usage" >&2; exit 2 ;;
  esac
done
out=${1:?$usage}
mkdir -p "$out"
out=$(cd "$out" && pwd)
rm -f "$out/gpu-check.json" "$out"/.gpu-check.json.* "$out/encode.ncu-rep" "$out/mismatch.tar.gz"
log="$out/gpu-check.log"
: > "$log"
started=$SECONDS
python=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
say() { echo "gpu-check: $* ($((SECONDS - started)) s)" | tee -a "$log"; }
say "deadline $deadline s"

# ====== Steps and the report ======
# step NAME SECONDS COMMAND...: runs COMMAND under a timeout of SECONDS or what is left before
# the deadline (10 s kept: 5 for a timed-out step's kill, 5 for the report), whichever is less,
# with its output in the log; records
# its exit status (124: timed out) and time, and rewrites the report. Under 15 s left: skipped.
step() {
  local name=$1 limit=$2 begin=$SECONDS rc
  shift 2
  local left=$((deadline - (SECONDS - started) - 10))
  if [ "$left" -lt 15 ]; then
    skip "$name" "no time left before the $deadline s deadline"
    return 125
  fi
  [ "$left" -lt "$limit" ] && limit=$left
  say "$name: started (limit $limit s)"
  timeout --kill-after=5 "$limit" "$@" > "$work/$name.txt" 2>&1
  rc=$?
  { echo "== $name (exit $rc)"; cat "$work/$name.txt"; } >> "$log"
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - begin))" "$limit" >> "$work/steps.tsv"
  say "$name: exit $rc$([ $rc -eq 124 ] && echo ' (timed out)')"
  report
  return $rc
}
skip() {  # NAME WHY
  printf '%s\tskipped\t0\t0\n' "$1" >> "$work/steps.tsv"
  say "$1: skipped ($2)"
  report
}
report() {
  $python scripts/gpu_check_report.py "$work" "$out" "$device" "$((SECONDS - started))" \
    "$deadline" > /dev/null 2>> "$log" || say "report: failed (see $log)"
}
passed() {  # NAME: whether the step ran and exited 0
  grep -q "^$1	0	" "$work/steps.tsv" 2> /dev/null
}

# ====== 1. What the machine is ======
probe() {
  command -v nvidia-smi > /dev/null &&
    nvidia-smi --query-gpu=name,driver_version,memory.total,compute_mode --format=csv
  $python -c 'import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())
if torch.cuda.is_available():
    print("nccl", ".".join(map(str, torch.cuda.nccl.version())))'
  command -v nvcc > /dev/null && nvcc --version | tail -n 2
  command -v mpirun > /dev/null && mpirun --version 2>&1 | head -n 1
  cmake --version | head -n 1
  echo "cores $(nproc)"
  command -v nvcc cmake ninja mpirun mpicxx compute-sanitizer ncu || true
}
export python work device
export -f probe
step probe 60 bash -c probe

# ====== 2. The builds, at once: the Python package (torch, a compiler, CMake and nvcc are all it
# needs) beside the C++ one ======
# --target: installed into the scratch folder only, never into the machine's Python.
python_build() {
  CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) $python -m pip install -v --no-build-isolation --no-deps \
    --target "$work/python" ./python || return 1
  PYTHONPATH="$work/python" $python -c 'import sys, flexdemo.ops as o
print("flexdemo ops: CUDA kernels built:", o.cuda_built())
sys.exit(0 if o.cuda_built() else 1)'
}
export -f python_build
step python_build 900 bash -c python_build &
python_builder=$!

# The C++ build: the machine's own libraries first, the carried packages for the rest.
torch_root=$($python -c 'import os, torch; print(os.path.dirname(torch.__file__))')
prefix=/tmp/flexdemo-gpu-deps
unpack() {
  rm -rf "$prefix"
  mkdir -p "$prefix"
  compgen -G ".gpu-deps/*.deb" > /dev/null || { echo "no .gpu-deps/*.deb"; return 0; }
  for f in .gpu-deps/*.deb; do dpkg -x "$f" "$prefix" || return 1; done
  # dpkg -x relocates files, not what points at them: absolute links (zlib1g-dev's libz.so ->
  # /lib/...) and the pkg-config files' prefix=/usr are made to point into the prefix.
  find "$prefix" -type l -lname '/*' | while read -r link; do
    ln -sfn "$prefix$(readlink "$link")" "$link"
  done
  find "$prefix" -name '*.pc' -exec sed -i "s|^prefix=/usr|prefix=$prefix/usr|" {} +
  echo "unpacked $(find .gpu-deps -name '*.deb' | wc -l) packages into $prefix"
}
export prefix
export -f unpack
step unpack 120 bash -c unpack
libdir=$prefix/usr/lib/x86_64-linux-gnu
export PATH="$PATH:$prefix/usr/bin"  # the machine's own tools win
export PKG_CONFIG_PATH="$libdir/pkgconfig:$prefix/usr/share/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
export LD_LIBRARY_PATH="$libdir:$libdir/openmpi/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# The machine's OpenMPI when it can build (mpicxx with its mpi.h), else the carried one, whole:
# its compiler wrapper and its mpirun (dpkg -x runs no update-alternatives: named here), relocated.
machine_mpi=false
if command -v mpicxx > /dev/null; then
  for dir in $(mpicxx --showme:incdirs 2> /dev/null); do
    [ -f "$dir/mpi.h" ] && machine_mpi=true
  done
fi
if ! $machine_mpi && [ -x "$prefix/usr/bin/mpicxx.openmpi" ]; then
  mkdir -p "$prefix/bin"
  for tool in mpicc mpicxx mpirun mpiexec orted; do
    [ -e "$prefix/usr/bin/$tool.openmpi" ] && ln -sfn "$prefix/usr/bin/$tool.openmpi" "$prefix/bin/$tool"
    [ -e "$prefix/usr/bin/$tool" ] && ln -sfn "$prefix/usr/bin/$tool" "$prefix/bin/$tool"
  done
  export PATH="$prefix/bin:$PATH"
  export OPAL_PREFIX=$prefix/usr
  # PMIx (libpmix.so.2 links into libdir) relocated the same way: its prefix (the variable this
  # libpmix reads) and its plugins.
  export PMIX_PREFIX=$libdir/pmix2 PMIX_MCA_mca_base_component_path=$libdir/pmix2/lib/pmix
  carried_mpi=true
  say "OpenMPI: carried (Debian's, relocated to $prefix)"
else
  say "OpenMPI: the machine's ($(command -v mpicxx || echo 'no mpicxx'))"
fi

# Without ssh or rsh OpenMPI 4's default launcher refuses to start even on one node (mpirun and
# a singleton alike: "plm_rsh_agent ... could not be found"); its isolated one forks locally.
if ! command -v ssh > /dev/null && ! command -v rsh > /dev/null; then
  export OMPI_MCA_plm=isolated
fi

build="build-gpu"
step configure 300 cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLEXDEMO_CUDA=ON \
  -DTorch_DIR="$torch_root/share/cmake/Torch" -DCMAKE_PREFIX_PATH="$torch_root;$prefix/usr" &&
  step build 1200 cmake --build "$build" -j "$(nproc)" --target flexdemo_cli flexdemo_tokenize test_gpu
{
  echo "== nvcc command line of the kernels"
  ninja -C "$build" -t commands flexdemo 2> /dev/null | grep -m 1 'nvcc.*\.cu'
} >> "$log" 2>&1
built=false
passed build && built=true
wait "$python_builder"
report  # both builds' steps in it (the background one may have reported before the foreground's)

# ====== 3. On the GPU, by what each step tells ======
mpirun=(mpirun --allow-run-as-root --oversubscribe -x OMP_NUM_THREADS=1 -x LD_LIBRARY_PATH
        -x PATH)
${carried_mpi:-false} && mpirun+=(-x OPAL_PREFIX -x PMIX_PREFIX -x PMIX_MCA_mca_base_component_path)
[ -n "${OMPI_MCA_plm:-}" ] && mpirun+=(-x OMPI_MCA_plm)
corpus=$work/corpus.txt  # real English text that every checkout has
cat README.md docs/*.md ../shared/DESIGN.md 2> /dev/null > "$corpus"
export FLEXDEMO_TOKENIZE=$PWD/$build/flexdemo-tokenize
one_encoding=(--gtest_filter='*Bf16*:*bf16*')

if $built; then
  mkdir -p "$work/mismatch"
  step test_gpu 300 env FLEXDEMO_CUDA_SYNC=1 FLEXDEMO_MISMATCH_DIR="$work/mismatch" \
    "$build/tests/test_gpu"
  if compgen -G "$work/mismatch/*" > /dev/null; then
    tar -czf "$out/mismatch.tar.gz" -C "$work" mismatch
  fi
  step bench 300 sh -c "'$build/flexdemo' bench optimizer --device $device --scale $bench_scale --step demo --topk 32 \
    --chunk 64 --values bf16 --steps 20 --json > '$work/bench.json'"
  # Two nodes of one rank sharing the GPU (MPI: NCCL cannot put two ranks of one communicator on
  # one GPU), DeMo's exchange between them; --check-replicas stops the run if they differ.
  step train_gpu 180 "${mpirun[@]}" -np 2 "$build/flexdemo" train --model gpt-nano \
    --tokenizer bytes --data "$corpus" --seq 64 --batch 16 --steps 20 --eval-seqs 16 \
    --check-replicas 10 --progress lines --ranks-per-node 1 --comm-timeout 120 \
    --device "$device" --intra-backend mpi --inter-backend mpi --out "$work/$device"
  # The same with the owners' exchange: each owner's share of the payloads and every owner's
  # return are buckets of some of the tensors, screened and decoded by the kernels.
  step train_gpu_owners 180 "${mpirun[@]}" -np 2 "$build/flexdemo" train --model gpt-nano \
    --tokenizer bytes --data "$corpus" --seq 64 --batch 16 --steps 20 --eval-seqs 16 \
    --check-replicas 10 --progress lines --ranks-per-node 1 --comm-timeout 120 \
    --demo-exchange owners --device "$device" --intra-backend mpi --inter-backend mpi \
    --out "$work/$device-owners"
fi
if passed python_build; then
  step python_ops 300 env PYTHONPATH="$work/python" $python tests/python/test_gpu_ops.py
  step python_bench 300 env PYTHONPATH="$work/python" OMP_NUM_THREADS=1 $python -m flexdemo.bench \
    --device "$device" --scale $bench_scale --rounds 1 --json "$work/python_bench.json"
fi
if $built; then
  if [ "$device" = cuda ]; then
    step nccl_smoke 120 "${mpirun[@]}" -np 1 "$build/flexdemo" train --model gpt-nano \
      --tokenizer bytes --data "$corpus" --seq 64 --batch 8 --steps 5 --eval-seqs 8 \
      --progress lines --device "$device" --intra-backend nccl --inter-backend nccl \
      --comm-timeout 120 --out "$work/nccl"
  else
    skip nccl_smoke "no GPU"
  fi

  # What is left time for.
  if [ "$device" = cuda ] && command -v compute-sanitizer > /dev/null; then
    step memcheck 300 compute-sanitizer --tool memcheck --error-exitcode 1 "$build/tests/test_gpu" \
      "${one_encoding[@]}"
    step racecheck 300 compute-sanitizer --tool racecheck --error-exitcode 1 \
      "$build/tests/test_gpu" "${one_encoding[@]}"
  else
    skip memcheck "no GPU or no compute-sanitizer"
    skip racecheck "no GPU or no compute-sanitizer"
  fi
  if [ "$device" = cuda ] && command -v ncu > /dev/null; then
    step ncu_encode 300 ncu --clock-control none --kernel-name regex:encode --launch-count 1 \
      --set full -f -o "$out/encode" "$build/tests/test_gpu" "${one_encoding[@]}"
  else
    skip ncu_encode "no GPU or no ncu"
  fi
  big=(--seq 256 --batch 16)
  shape=(--width 768 --layers 12 --heads 12 --context 1024)
  if [ "$speed_model" = gpt-nano ]; then
    big=(--seq 64 --batch 16)
    shape=(--width 128 --layers 4 --heads 4 --context 128)
  fi
  if step speed 300 "$build/flexdemo" train --model "$speed_model" --tokenizer bytes \
      --data "$corpus" "${big[@]}" --steps 30 --warmup 0 --eval-seqs 16 --optimizer adamw \
      --device "$device" --progress lines --out "$work/speed"; then
    vocab=$($python -c "import json; print(json.load(open('$work/speed/config.json'))['vocab_size'])")
    step pytorch 300 sh -c "$python bench/pytorch_gpt.py --device $device --vocab $vocab \
      ${big[*]} ${shape[*]} --steps 30 > '$work/pytorch.json'"
  fi
fi

# The model's prediction against what the bench measured, per phase and for the whole step.
$python - "$out/gpu-check.json" << 'PY' 2>&1 | tee -a "$log"
import json, sys
r = json.load(open(sys.argv[1]))
def ms(x):
    return "-" if x is None else "{:.3f} ms".format(x)
print("gpu-check: predicted ({}) against measured:".format(r.get("model_of")))
for phase, p in r.get("kernels_predicted_vs_measured_ms", {}).items():
    print("  {:<12} {:>10} {:>10}".format(phase, ms(p.get("predicted")), ms(p.get("measured"))))
print("  {:<12} {:>10} {:>10}".format("whole step", ms(r.get("predicted_demo_step_ms")),
                                      ms(r.get("demo_step_ms"))))
PY
ok=$($python -c "import json; print(json.load(open('$out/gpu-check.json'))['passed'])" 2> /dev/null)
say "done: $([ "$ok" = True ] && echo passed || echo 'NOT passed') (report: $out/gpu-check.json)"
[ "$ok" = True ]
