"""The layers' channel-sized coefficient kernels (BCN, Unitization, GN+PN: map and VJP) compiled for an H100
(sm_90) on the CPU (tests/kernels/coeff_sm90.py): float64 variants hold no approximate instruction
(``tl.rsqrt`` is ``rsqrt.approx.f64`` there: the interpreter's float64 results would not hold on a GPU), and no
variant spills registers (bundled ptxas -v), at the largest tiles and a chunked group of 4096 channels (the
full sweep over channels per group, C and N: ``python tests/kernels/coeff_sm90.py``)."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow  # 24-43 s on 2 shared cores: compiles the coefficient kernels for sm_90 in a subprocess
def test_coefficient_kernels_exact_in_float64_and_without_spills(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != 'TRITON_INTERPRET'}
    env['TRITON_CACHE_DIR'] = str(tmp_path / 'triton-cache')  # compiled here, not found in a cache
    env['PYTHONPATH'] = ROOT
    proc = subprocess.run([sys.executable, os.path.join(ROOT, 'tests', 'kernels', 'coeff_sm90.py'), '--quick',
                           '--dtypes', 'float64'], env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    summary = proc.stdout.strip().splitlines()[-1]  # stderr may hold a warning (triton 3.9: TRITON_DEFAULT_FP_FUSION)
    assert summary.endswith(' 0 failed') and int(summary.split()[0]) >= 20, summary
