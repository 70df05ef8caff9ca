#!/usr/bin/env bash
# Installs normdense and its pinned OpenMMLab stack into a virtualenv. Idempotent: finished steps are
# detected and skipped, so `make test` / `make demo` can call it every time.
#   VENV=path     virtualenv to use (default .venv)
#   PYTHON=exe    interpreter that creates it (default python3)
#   FORCE=1       re-run every step even if the install stamp matches
#   MMCV_ONLY=1   only build and install mmcv 2.1.0 with its ops into an existing VENV, for the torch already
#                 there (any torch; scripts/install_newest.sh uses it): `MMCV_ONLY=1 VENV=path bash scripts/install.sh`
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
PY="$VENV/bin/python"
PIP=("$PY" -m pip install -c requirements/constraints.txt)
STAMP="$VENV/.normdense-install-stamp"
STEP="start"
HINT=""

step() { STEP="$1"; HINT="$2"; echo; echo "==> [install] $1"; }
fail() {
  echo >&2
  echo "!! make install failed during step: $STEP" >&2
  [ -n "$HINT" ] && echo "!! what to do: $HINT" >&2
  echo "!! re-run 'make install' after fixing it; finished steps are skipped." >&2
}
trap fail ERR

stamp_key() { cat requirements/*.txt setup.py pyproject.toml scripts/install.sh | sha256sum | cut -d' ' -f1; }

if [ -z "${MMCV_ONLY:-}" ] && [ -z "${FORCE:-}" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$(stamp_key)" ]; then
  echo "==> [install] $VENV is up to date (FORCE=1 make install to redo every step)"
  exit 0
fi

if [ -n "${MMCV_ONLY:-}" ]; then
  echo "==> [install] mmcv 2.1.0 with its ops for the torch in $VENV (MMCV_ONLY; the first build: 15-35 minutes on 2 cores)"
else
  echo "==> [install] installing normdense into $VENV"
  echo "    NOTE: the first install builds mmcv 2.1.0 from source with its compiled ops:"
  echo "    about 15 minutes on 2 CPU cores. pip caches the wheel, so later installs are fast."
fi

step "create virtualenv $VENV" "check that '$PYTHON -m venv' works (Debian: apt-get install python3-venv)"
if [ ! -x "$PY" ]; then "$PYTHON" -m venv "$VENV"; else echo "    exists"; fi

step "torch and torchvision (requirements/torch.txt)" "the pinned torch/torchvision wheels must be reachable from PyPI"
if [ -n "${MMCV_ONLY:-}" ]; then
  "$PY" -c "import torch, torchvision; print(f'    MMCV_ONLY: keeping torch {torch.__version__} / torchvision {torchvision.__version__}')"
elif "$PY" -c "import torch, torchvision, sys; sys.exit(not (torch.__version__.split('+')[0]=='2.12.1' and torchvision.__version__.split('+')[0]=='0.27.1'))" 2>/dev/null; then
  echo "    torch 2.12.1 / torchvision 0.27.1 already installed"
else
  "${PIP[@]}" -r requirements/torch.txt
fi

step "build tools for mmcv (requirements/build.txt)" "pip must reach PyPI for setuptools<81, wheel and ninja"
"${PIP[@]}" -q -r requirements/build.txt

step "CUDA toolkit for mmcv's GPU ops (only where torch sees a GPU)" \
     "install the CUDA toolkit whose nvcc matches torch's CUDA (put it on PATH or set CUDA_HOME), or use OpenMMLab's prebuilt mmcv: pip install -U openmim && mim install mmcv==2.1.0"
TORCH_CUDA=$("$PY" -c "import torch; print(torch.version.cuda if torch.cuda.is_available() else '')")
MMCV_ENV=(MMCV_WITH_OPS=1)
if [ -z "$TORCH_CUDA" ]; then
  echo "    torch sees no CUDA GPU: mmcv's ops are built for CPU"
else
  NVCC="${CUDA_HOME:+$CUDA_HOME/bin/}nvcc"
  if ! command -v "$NVCC" >/dev/null; then
    echo "    torch sees a GPU (CUDA $TORCH_CUDA) but there is no nvcc (PATH, \$CUDA_HOME/bin): mmcv's CUDA ops cannot be built" >&2
    false
  fi
  NVCC_CUDA=$("$NVCC" --version | sed -n 's/.*release \([0-9]*\.[0-9]*\).*/\1/p')
  if [ "$NVCC_CUDA" != "$TORCH_CUDA" ]; then
    echo "    $NVCC is CUDA $NVCC_CUDA but torch was built with CUDA $TORCH_CUDA: mmcv's CUDA ops must be built with the same CUDA" >&2
    false
  fi
  echo "    torch and $NVCC: CUDA $TORCH_CUDA; mmcv's ops are built with CUDA (FORCE_CUDA=1)"
  MMCV_ENV+=(FORCE_CUDA=1)
fi

# mmcv 2.1.0 whose ops run under this torch (nms on CPU, and on CUDA where torch sees a GPU): a wheel built
# for another torch can import and still fail every op ("nms_impl: implementation for device ... not found")
mmcv_ok() {
  "$PY" -c "import mmcv, sys, torch; from mmcv.ops import nms, get_compiling_cuda_version as cuda
gpu = torch.cuda.is_available()
if mmcv.__version__ != '2.1.0' or (gpu and cuda() == 'not available'): sys.exit(1)
for d in ['cpu'] + (['cuda'] if gpu else []):
    b = torch.tensor([[0., 0., 10., 10.], [1., 1., 11., 11.]], device=d)
    assert nms(b, torch.tensor([0.9, 0.8], device=d), 0.5)[1].tolist() == [0]" 2>/dev/null
}
step "mmcv 2.1.0 with compiled ops (source build, ~15 min the first time)" \
     "needs gcc/g++ (one with -std=c++20 for torch >= 2.14) and the Python headers"
# torch >= 2.14's headers need C++20 (std::strong_ordering in c10), and mmcv 2.1.0's setup.py passes -std=c++17,
# which comes after torch's own flag and wins. Where a c10 header does not compile as C++17 but does as C++20,
# mmcv's sdist is built with that one flag changed. That build, and any MMCV_ONLY build, is a wheel kept in a
# folder of its own per torch build: pip's wheel cache keys a wheel by its source, not by the torch it was built
# against (see below), so another torch's venv would take, then remove, the pinned stack's cached wheel.
cxx_ok() { echo '#include <c10/core/TensorImpl.h>' | "${CXX:-c++}" -std="$2" -fsyntax-only -x c++ -I"$1" - 2>/dev/null; }
needs_cxx20() {
  local inc
  inc=$("$PY" -c "import torch.utils.cpp_extension as e; print(e.include_paths()[0])" 2>/dev/null)
  ! cxx_ok "$inc" c++17 && cxx_ok "$inc" c++20
}
MMCV_WHEELS=${MMCV_WHEELS:-${XDG_CACHE_HOME:-$HOME/.cache}/normdense/mmcv-wheels}
mmcv_own_wheel() {  # $1: c++20 to build with -std=c++20, else mmcv's own flags
  local key dir src
  key=$("$PY" -c "import torch; print(f'torch-{torch.__version__}-' + ('cuda-ops' if '$TORCH_CUDA' else 'cpu-ops'))")
  dir="$MMCV_WHEELS/mmcv-2.1.0-$key${1:+-cxx20}"
  if compgen -G "$dir/mmcv-2.1.0-*.whl" >/dev/null; then
    echo "    the mmcv 2.1.0 wheel built for $key: $dir"
    "${PIP[@]}" --force-reinstall --no-deps "$dir"/mmcv-2.1.0-*.whl
    "${PIP[@]}" "$dir"/mmcv-2.1.0-*.whl  # its dependencies
    if mmcv_ok; then return 0; fi
    echo "    that wheel does not run its ops here: rebuilding it"
    rm -f "$dir"/mmcv-2.1.0-*.whl
  fi
  src=$(mktemp -d)
  "$PY" -m pip download -q --no-deps --no-binary :all: --no-build-isolation -d "$src" mmcv==2.1.0
  tar -xzf "$src"/mmcv-2.1.0.tar.gz -C "$src"
  if [ -n "${1:-}" ]; then
    sed -i 's/-std=c++17/-std=c++20/g; s|/std:c++17|/std:c++20|g' "$src"/mmcv-2.1.0/setup.py
    echo "    building mmcv 2.1.0 with -std=c++20 (its setup.py says c++17) into $dir"
  else
    echo "    building mmcv 2.1.0 into $dir"
  fi
  mkdir -p "$dir"
  env "${MMCV_ENV[@]}" MAX_JOBS="${MAX_JOBS:-$(nproc)}" "$PY" -m pip wheel --no-build-isolation --no-deps \
    --no-cache-dir -w "$dir" "$src"/mmcv-2.1.0
  rm -rf "$src"
  "${PIP[@]}" --force-reinstall --no-deps "$dir"/mmcv-2.1.0-*.whl
  "${PIP[@]}" "$dir"/mmcv-2.1.0-*.whl
}
if mmcv_ok; then
  echo "    mmcv 2.1.0 with ops already installed"
elif needs_cxx20; then
  echo "    torch $("$PY" -c 'import torch; print(torch.__version__)')'s headers need C++20: mmcv 2.1.0 is built with -std=c++20"
  mmcv_own_wheel c++20
  mmcv_ok
elif [ -n "${MMCV_ONLY:-}" ]; then
  mmcv_own_wheel
  mmcv_ok
else
  env "${MMCV_ENV[@]}" MAX_JOBS="${MAX_JOBS:-$(nproc)}" "${PIP[@]}" --no-build-isolation mmcv==2.1.0
  if ! mmcv_ok; then
    # pip's wheel cache ignores the torch version and the CUDA build: a wheel built against another torch
    # fails with undefined symbols in mmcv._ext or in every op, one built on a CPU machine lacks the CUDA kernels.
    echo "    cached mmcv wheel does not run under this torch or lacks CUDA ops: rebuilding without pip's cache"
    "$PY" -m pip cache remove mmcv || true
    env "${MMCV_ENV[@]}" MAX_JOBS="${MAX_JOBS:-$(nproc)}" "${PIP[@]}" --no-build-isolation --no-cache-dir \
      --force-reinstall --no-deps mmcv==2.1.0
    mmcv_ok
  fi
fi

if [ -n "${MMCV_ONLY:-}" ]; then
  echo; echo "==> [install] MMCV_ONLY: mmcv 2.1.0 with ops is installed in $VENV"; exit 0
fi

step "OpenMMLab stack (requirements/runtime.txt)" "pip must reach PyPI; see the pip error above"
"${PIP[@]}" -r requirements/runtime.txt

step "ONNX export: the [deploy] extra (requirements/deploy.txt)" "pip must reach PyPI for onnx, onnxruntime, onnxscript"
"${PIP[@]}" -q -r requirements/deploy.txt

step "mmdeploy 1.3.1 for the tests of its route (docs/deploy.md)" "pip must reach PyPI for mmdeploy and its pure-Python deps"
# --no-deps: mmdeploy declares protobuf<=3.20.2, which onnx >= 1.15 cannot use (it runs with today's protobuf)
"${PIP[@]}" -q --no-deps mmdeploy==1.3.1
"${PIP[@]}" -q aenum multiprocess prettytable terminaltables six

step "test tools (requirements/tests.txt)" "pip must reach PyPI"
"${PIP[@]}" -q -r requirements/tests.txt

step "normdense (editable)" "setup.py must be importable; see the error above"
"${PIP[@]}" -q --no-build-isolation --no-deps -e .

step "self-check" "an import failed: FORCE=1 make install; if mmcv._ext has undefined symbols, 'pip cache remove mmcv' first"
"$PY" -m normdense.self_check --all

stamp_key > "$STAMP"
echo
echo "==> [install] done: activate with 'source $VENV/bin/activate'"
