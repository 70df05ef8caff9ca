#!/usr/bin/env bash
# Builds the venv of `make test-min`: normdense's lowest declared torch / mmengine / mmcv
# (requirements/min.txt; mmcv without ops, so nothing is compiled). Idempotent like scripts/install.sh.
#   MIN_VENV=path   virtualenv to use (default .venv-min)
#   PYTHON=exe      interpreter that creates it (default python3)
set -euo pipefail
cd "$(dirname "$0")/.."
MIN_VENV=${MIN_VENV:-.venv-min}
PYTHON=${PYTHON:-python3}
PY="$MIN_VENV/bin/python"
STAMP="$MIN_VENV/.normdense-min-stamp"
key() { cat requirements/min.txt scripts/install_min.sh normdense/version.py | sha256sum | cut -d' ' -f1; }
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$(key)" ]; then
  echo "==> [install-min] $MIN_VENV is up to date"; exit 0
fi
trap 'echo "!! install-min failed: pip must reach PyPI (torch 2.1 is ~0.7 GB plus ~2.5 GB of CUDA libraries)" >&2' ERR
echo "==> [install-min] lowest supported stack into $MIN_VENV (requirements/min.txt)"
[ -x "$PY" ] || "$PYTHON" -m venv "$MIN_VENV"
"$PY" -m pip install -q -r requirements/min.txt
# the pins must be the minimums normdense declares, else this venv tests nothing of the declared range
"$PY" - <<'PYEOF'
import runpy, sys
import mmcv, mmengine, torch
v = runpy.run_path('normdense/version.py')
for name, have in (('torch', torch.__version__), ('mmengine', mmengine.__version__), ('mmcv', mmcv.__version__)):
    want = v[f'{name}_minimum_version']
    if have.split('+')[0].split('.')[:2] != want.split('.')[:2]:
        sys.exit(f'requirements/min.txt installs {name} {have}, but normdense/version.py declares {name}>={want}')
print(f'    torch {torch.__version__}, mmengine {mmengine.__version__}, mmcv {mmcv.__version__} (no ops)')
PYEOF
key > "$STAMP"
