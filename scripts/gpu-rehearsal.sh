#!/usr/bin/env bash
# Rehearses scripts/gpu-check.sh here, in an environment shaped like the GPU machine's image, so
# that the one short GPU lease is not spent on a build that fails. The environment (bubblewrap
# over a Debian minbase root, made once with debootstrap and kept in FLEXDEMO_GPU_ROOT, default
# /tmp/flexdemo-gpu-root) has at most what that image has:
#   a compiler, CMake, ninja, python3 = PyPI's torch 2.11 in a venv at /opt/torch/.venv (this
#   checkout's .venv-cuda, from install-deps.sh --cuda), CUDA's toolkit at /usr/local/cuda (nvcc;
#   no GPU), no MPI package at all (the check runs the OpenMPI it carries, PMIx and the rest
#   found through their relocated prefix), no Debian -dev package, no network
# and a copy of this checkout as the device tool sends it (tracked and unignored files, plus
# .gpu-deps/ from scripts/fetch-gpu-deps.sh). It runs gpu-check.sh --rehearse there under a
# 600 s wrapper, as the device tool runs a command (the check's deadline
# FLEXDEMO_REHEARSAL_DEADLINE, default 590 s), and prints the report, the CPU seconds the whole
# rehearsal took and from them the check's wall time estimated at the GPU machine's 16 cores
# (CPU seconds / 16, against the check's 480 s), and the files the check left in OUT (at most
# six, the device tool's limit; four by design).
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

# The root: Debian minbase with the image's tools only (made once; made again if an older
# rehearsal's root holds an MPI, which the GPU machine's image is not known to have).
if [ ! -x "$root/usr/bin/ninja" ] || [ -e "$root/usr/bin/mpirun" ]; then
  # The archive this machine's apt uses (deb822 .sources or a one-line sources.list).
  mirror=$(cat /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2> /dev/null |
    sed -n 's/^URIs: *\([^ ]*\).*/\1/p; s/^deb \(\[[^]]*\] \)\{0,1\}\([^ ]*\) .*/\2/p' |
    head -n 1 || true)
  [ -n "$mirror" ] || { echo "gpu-rehearsal: no Debian archive found in apt's sources" >&2; exit 1; }
  echo "gpu-rehearsal: making the root in $root (debootstrap minbase)"
  rm -rf "$root"
  debootstrap --variant=minbase --include=g++,make,cmake,ninja-build,python3 \
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
  timeout --kill-after=10 600 \
  bash scripts/gpu-check.sh --rehearse --deadline "${FLEXDEMO_REHEARSAL_DEADLINE:-590}" /work/out
rc=$?
set -e
[ $rc -eq 124 ] && echo "gpu-rehearsal: the check ran past the 600 s wrapper" >&2
ticks=$(getconf CLK_TCK)
after=$(awk '{print $14 + $15 + $16 + $17}' /proc/$$/stat)
cpu=$(((after - before) / ticks))
echo "gpu-rehearsal: exit $rc; CPU seconds of the whole rehearsal: $cpu; at 16 cores about" \
  "$((cpu / 16)) s (the check's deadline there: 480 s)"
python3 -c "import json; r = json.load(open('$out/gpu-check.json')); \
print('\n'.join('  {:<14} {:>8} {:>6} s'.format(n, str(s['exit']), s['seconds']) for n, s in r['steps'].items()))"
# What the device tool would bring back: the check's files in OUT (it brings back six at most).
files=$(find "$out" -type f ! -name debootstrap.log | wc -l)
echo "gpu-rehearsal: the check left $files file(s) in OUT: $(cd "$out" && find . -type f ! -name debootstrap.log | sort | tr '\n' ' ')"
[ "$files" -le 6 ] || { echo "gpu-rehearsal: more than 6 files in OUT" >&2; rc=1; }
exit $rc
