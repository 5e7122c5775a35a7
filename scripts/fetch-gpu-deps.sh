#!/usr/bin/env bash
# Downloads, here, the Debian packages that scripts/gpu-check.sh may need on a GPU machine that has
# CUDA, LibTorch (PyPI's torch) and CMake but none of flexdemo's other libraries and no way to
# fetch them: the headers and libraries of the build, pkg-config, and OpenMPI with mpirun. They go
# to .gpu-deps/ (ignored by git; carry it to the GPU machine); gpu-check.sh unpacks them there
# with dpkg -x into a prefix of its own, never into /.
set -euo pipefail
cd "$(dirname "$0")/.."
packages=(
  libcli11-dev nlohmann-json3-dev libfmt-dev libfmt9 libgtest-dev
  libbenchmark-dev libbenchmark1debian
  libsentencepiece-dev libsentencepiece0 libprotobuf-lite32 zlib1g-dev zlib1g
  libgettextpo-dev libgettextpo0
  pkgconf pkgconf-bin libpkgconf3
  libopenmpi-dev libopenmpi3 openmpi-common openmpi-bin
  libhwloc15 libevent-core-2.1-7 libevent-pthreads-2.1-7 libevent-2.1-7 libpmix2 libfabric1
  libucx0 libibverbs1 librdmacm1 libpsm2-2 libpsm-infinipath1 libnl-3-200 libnl-route-3-200
  libmunge2 libnuma1 libltdl7 libpciaccess0 libxnvctrl0
)
mkdir -p .gpu-deps
cd .gpu-deps
rm -f ./*.deb
apt-get download "${packages[@]}" 2>&1 | { grep -v "^W: Download is performed unsandboxed" || true; }
echo "fetch-gpu-deps: $(find . -name '*.deb' | wc -l) packages, $(du -sh . | cut -f1) in .gpu-deps/"
