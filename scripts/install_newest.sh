#!/usr/bin/env bash
# Builds the venv of `make test-newest`: the newest torch and torchvision that pip serves (no pins: whatever
# pip's configuration allows; Triton is the one that torch requires) and the newest numpy, mmcv 2.1.0 with its
# ops built for that torch (scripts/install.sh's mmcv step, MMCV_ONLY=1: with -std=c++20 where torch's headers
# need C++20), the OpenMMLab stack of requirements/runtime.txt, the test tools and normdense (editable).
# Idempotent like scripts/install.sh: every run asks pip for a newer torch/torchvision first (seconds), and the
# other steps run again only when those, or the files that define this venv, changed.
#   NEWEST_VENV=path  virtualenv to use (default .venv-newest)
#   PYTHON=exe        interpreter that creates it (default python3)
#   FORCE=1           re-run every step
# Where mmcv's ops cannot be built for this torch, it says why, installs mmcv-lite (normdense's layers need no
# op) and writes $NEWEST_VENV/.normdense-no-mmcv-ops: `make test-newest` then leaves out the tests marked
# `codebases` (they build mmdet/mmseg models) and prints the reason.
set -euo pipefail
cd "$(dirname "$0")/.."
NEWEST_VENV=${NEWEST_VENV:-.venv-newest}
PYTHON=${PYTHON:-python3}
PY="$NEWEST_VENV/bin/python"
STAMP="$NEWEST_VENV/.normdense-newest-stamp"
NO_OPS="$NEWEST_VENV/.normdense-no-mmcv-ops"
CONSTRAINTS="$NEWEST_VENV/constraints-newest.txt"
trap 'echo "!! install-newest failed (above); re-run make test-newest: finished steps are skipped" >&2' ERR

echo "==> [install-newest] the newest torch / torchvision pip serves, into $NEWEST_VENV"
[ -x "$PY" ] || "$PYTHON" -m venv "$NEWEST_VENV"
"$PY" -m pip install -q -U torch torchvision numpy
versions() {
  "$PY" -c "import importlib.metadata as m
print(' '.join(f'{p}=={m.version(p)}' for p in ('torch', 'torchvision', 'triton', 'numpy')))"
}
key() {
  { cat requirements/*.txt setup.py pyproject.toml scripts/install.sh scripts/install_newest.sh; versions; } |
    sha256sum | cut -d' ' -f1
}
if [ -z "${FORCE:-}" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$(key)" ]; then
  echo "==> [install-newest] $NEWEST_VENV is up to date: $(versions)"
  exit 0
fi
echo "    $(versions)"

# later steps keep what pip served above, and take the test tools' pins of requirements/constraints.txt
{ versions | tr ' ' '\n'; grep -vE '^(torch|torchvision)==' requirements/constraints.txt; } > "$CONSTRAINTS"
PIP=("$PY" -m pip install -c "$CONSTRAINTS")

echo; echo "==> [install-newest] build tools for mmcv (requirements/build.txt)"
"${PIP[@]}" -q -r requirements/build.txt

echo; echo "==> [install-newest] mmcv 2.1.0 with ops for this torch (scripts/install.sh, MMCV_ONLY=1)"
rm -f "$NO_OPS"
LOG=$(mktemp)
if MMCV_ONLY=1 VENV="$NEWEST_VENV" PYTHON="$PYTHON" bash scripts/install.sh 2>&1 | tee "$LOG"; then
  echo; echo "==> [install-newest] OpenMMLab stack (requirements/runtime.txt)"
  "${PIP[@]}" -q -r requirements/runtime.txt
else
  {
    echo "mmcv 2.1.0's ops could not be built for torch $("$PY" -c 'import torch; print(torch.__version__)'):"
    grep -E 'error|!!' "$LOG" | tail -5
  } > "$NO_OPS"
  echo "!! $(head -1 "$NO_OPS") installing mmcv-lite 2.1.0 instead; make test-newest leaves out the tests marked codebases" >&2
  "$PY" -m pip uninstall -q -y mmcv || true
  "${PIP[@]}" -q "mmcv-lite==2.1.0" "$(grep -E '^mmengine' requirements/runtime.txt)"
fi
rm -f "$LOG"

echo; echo "==> [install-newest] test tools (requirements/tests.txt) and normdense (editable)"
"${PIP[@]}" -q -r requirements/tests.txt
"${PIP[@]}" -q --no-build-isolation --no-deps -e .

echo; echo "==> [install-newest] self-check"
"$PY" -m normdense.self_check
key > "$STAMP"
echo; echo "==> [install-newest] done: $(versions)"
