#!/usr/bin/env bash
# Rehearses scripts/gpu-check.sh here, in an environment shaped like the GPU machine's image, so
# that the one short GPU lease is not spent on a build that fails. The environment (bubblewrap
# over a Debian minbase root, made once with debootstrap and kept in FLEXDEMO_GPU_ROOT, default
# /tmp/flexdemo-gpu-root) has only what that image has:
#   a compiler, CMake, ninja, an OpenMPI runtime (mpirun; no MPI headers), python3 = PyPI's torch
#   2.11 in a venv at /opt/torch/.venv (this checkout's .venv-cuda, from install-deps.sh --cuda),
#   CUDA's toolkit at /usr/local/cuda (nvcc; no GPU), no Debian -dev package, no network
# and a copy of this checkout as the device tool sends it (tracked and unignored files, plus
# .gpu-deps/ from scripts/fetch-gpu-deps.sh). It runs gpu-check.sh --rehearse there (its deadline
# FLEXDEMO_REHEARSAL_DEADLINE, default 3000 s: two cores build what a lease's sixteen do in its
# 480) and prints the report, the CPU seconds the whole rehearsal took (the build's share / 16
# cores estimates the real check's build time), and the files the check left (at most four).
#   scripts/gpu-rehearsal.sh OUT_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/gpu-rehearsal.sh OUT_DIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
root=${FLEXDEMO_GPU_ROOT:-/tmp/flexdemo-gpu-root}
cuda=$(readlink -f /usr/local/cuda)
venv=$PWD/.venv-cuda

missing=()
command -v debootstrap > /dev/null || missing+=(debootstrap)
command -v bwrap > /dev/null || missing+=(bubblewrap)
if [ ${#missing[@]} -gt 0 ]; then
  apt-get install -y --no-install-recommends "${missing[@]}" > /dev/null
fi
[ -x "$venv/bin/python" ] || bash scripts/install-deps.sh --cuda
[ -d .gpu-deps ] || bash scripts/fetch-gpu-deps.sh
[ -x "$cuda/bin/nvcc" ] || { echo "gpu-rehearsal: no CUDA toolkit at /usr/local/cuda" >&2; exit 1; }

# The root: Debian minbase with the image's tools only (made once).
if [ ! -x "$root/usr/bin/ninja" ]; then
  # The archive this machine's apt uses (deb822 .sources or a one-line sources.list).
  mirror=$(cat /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2> /dev/null |
    sed -n 's/^URIs: *\([^ ]*\).*/\1/p; s/^deb \(\[[^]]*\] \)\{0,1\}\([^ ]*\) .*/\2/p' |
    head -n 1 || true)
  [ -n "$mirror" ] || { echo "gpu-rehearsal: no Debian archive found in apt's sources" >&2; exit 1; }
  echo "gpu-rehearsal: making the root in $root (debootstrap minbase)"
  rm -rf "$root"
  debootstrap --variant=minbase --include=g++,make,cmake,ninja-build,openmpi-bin,python3 \
    bookworm "$root" "$mirror" > "$out/debootstrap.log" 2>&1 ||
    { tail -n 20 "$out/debootstrap.log" >&2; exit 1; }
fi

# The checkout as the device tool sends it.
rm -rf "$root/work"
mkdir -p "$root/work/flexdemo" "$root/work/out"
git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t "$root/work/flexdemo"
cp -r .gpu-deps "$root/work/flexdemo/"
[ -f ../shared/DESIGN.md ] && mkdir -p "$root/work/shared" && cp ../shared/DESIGN.md "$root/work/shared/"

# The venv's interpreter lives outside it (pyvenv.cfg's home): visible at the same path.
home=$(sed -n 's/^home *= *//p' "$venv/pyvenv.cfg")
base=$(dirname "$home")
before=$(awk '{print $14 + $15 + $16 + $17}' /proc/$$/stat)
set +e
bwrap --bind "$root" / --dev /dev --proc /proc --tmpfs /tmp \
  --ro-bind "$cuda" /usr/local/cuda --ro-bind "$venv" /opt/torch/.venv --ro-bind "$base" "$base" \
  --bind "$out" /work/out --chdir /work/flexdemo --unshare-net --die-with-parent \
  --setenv PATH /opt/torch/.venv/bin:/usr/local/cuda/bin:/usr/local/bin:/usr/bin:/bin \
  --setenv HOME /tmp --unsetenv PYTHONPATH --unsetenv LD_LIBRARY_PATH \
  bash scripts/gpu-check.sh --rehearse --deadline "${FLEXDEMO_REHEARSAL_DEADLINE:-3000}" /work/out
rc=$?
set -e
ticks=$(getconf CLK_TCK)
after=$(awk '{print $14 + $15 + $16 + $17}' /proc/$$/stat)
echo "gpu-rehearsal: exit $rc; CPU seconds of the whole rehearsal: $(((after - before) / ticks))"
python3 -c "import json; r = json.load(open('$out/gpu-check.json')); \
print('\n'.join('  {:<14} {:>8} {:>6} s'.format(n, str(s['exit']), s['seconds']) for n, s in r['steps'].items()))"
# What the device tool would bring back: the check's files in OUT (at most four).
files=$(find "$out" -type f ! -name debootstrap.log | wc -l)
echo "gpu-rehearsal: the check left $files file(s) in OUT: $(cd "$out" && find . -type f ! -name debootstrap.log | sort | tr '\n' ' ')"
[ "$files" -le 4 ] || { echo "gpu-rehearsal: more than 4 files in OUT" >&2; rc=1; }
exit $rc
