#!/usr/bin/env bash
# Installs every build and run dependency of flexdemo from Debian packages.
#   scripts/install-deps.sh --cuda   also a virtual environment .venv-cuda/ holding PyPI's torch
#                                    (a CUDA LibTorch, the GPU machine's version) for the CUDA build,
#                                    and transformers (+ sentencepiece, protobuf) for the test that
#                                    loads flexdemo's exported models in it (tests/hf_interop.py),
#                                    and scikit-build-core + pytest, which build and test the
#                                    Python package (python/, tests/python/) against that torch
# Idempotent: what is already present is skipped, so a second run does no network work.
set -euo pipefail
cd "$(dirname "$0")/.."
cuda=0
if [ "${1:-}" = "--cuda" ]; then cuda=1; fi
torch_version=2.11.0  # torch 2.11.0+cu130 on the H200 machine; PyPI's 2.11.0 is built for CUDA 13.0
interop=(transformers==5.24.0 sentencepiece==0.2.3 protobuf==7.36.2)
python_build=(scikit-build-core==1.1.2 pytest==9.2.0)

packages=(
  build-essential cmake pkg-config
  libtorch-dev                     # tensors and autograd (LibTorch 1.13 on Debian 12)
  libopenblas0-pthread             # fast BLAS for LibTorch (reference BLAS is ~4x slower)
  libopenmpi-dev openmpi-bin       # the distributed engine and mpirun
  googletest libgtest-dev          # unit and MPI tests
  libbenchmark-dev                 # micro-benchmarks
  libcli11-dev                     # command-line parsing
  nlohmann-json3-dev               # JSON output
  libfmt-dev libspdlog-dev         # formatting and logging
  zlib1g-dev                       # CRC-32 checksums of wire payloads
  libsentencepiece-dev             # BPE tokenizer, trained on the corpus
  gnuplot-nox                      # plots in `flexdemo report`
  fortunes                         # the default corpus: English text, no download
  gettext libgettextpo-dev         # --data gettext:LANG: msgunfmt, and libgettextpo to read PO
  # ... and the packages whose message catalogues gettext:LANG reads (gettext_domains() in
  # src/data/corpus.cpp), so that translation corpus is the same on every machine
  coreutils git binutils-common gnupg-l10n libc-l10n dpkg libdpkg-perl bash tar wget make apt
  diffutils findutils sed grep gettext-base procps login xz-utils adduser man-db psmisc m4
  iproute2                         # network namespaces and tc for the emulated cluster
  clang libclang-rt-14-dev         # scripts/test.sh --sanitize: ASan, UBSan, libFuzzer
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

sudo=""
if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
# One line per step; the tools' own output goes to a log, shown only when a step fails.
log=$(mktemp -t flexdemo-install-deps.XXXXXX.log)
step() {
  local what=$1
  shift
  local started=$SECONDS
  echo "install-deps: $what ..."
  if ! "$@" >> "$log" 2>&1; then
    echo "install-deps: $what failed; the last lines of $log:" >&2
    tail -n 30 "$log" >&2
    exit 1
  fi
  echo "install-deps: $what done ($((SECONDS - started)) s)"
}
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
else
  step "updating the package lists" $sudo apt-get update
  step "installing ${#missing[@]} packages (${missing[*]})" \
    $sudo apt-get install -y --no-install-recommends "${missing[@]}"
fi
if [ "$cuda" -eq 1 ]; then
  if .venv-cuda/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$torch_version')" 2>/dev/null; then
    echo "install-deps: .venv-cuda holds torch $torch_version"
  else
    [ -x .venv-cuda/bin/python ] || step "making the virtual environment .venv-cuda" python3 -m venv .venv-cuda
    step "installing torch $torch_version (CUDA LibTorch) into .venv-cuda" \
      .venv-cuda/bin/pip install --disable-pip-version-check "torch==$torch_version"
  fi
  if .venv-cuda/bin/python -c "import transformers, sentencepiece, google.protobuf" 2>/dev/null; then
    echo "install-deps: .venv-cuda holds transformers"
  else
    step "installing ${interop[*]} into .venv-cuda" \
      .venv-cuda/bin/pip install --disable-pip-version-check "${interop[@]}"
  fi
  if .venv-cuda/bin/python -c "import scikit_build_core, pytest" 2>/dev/null; then
    echo "install-deps: .venv-cuda holds scikit-build-core and pytest"
  else
    step "installing ${python_build[*]} into .venv-cuda" \
      .venv-cuda/bin/pip install --disable-pip-version-check "${python_build[@]}"
  fi
fi
rm -f "$log"
