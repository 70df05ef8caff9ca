"""The pass kernels read and write the activation 16 bytes per access on an H100 (sm_90): every variant the
launchers pick at the FPN shapes (C = 256, HW of P2-P7, N = 1 and 2), in float32, float16, bf16 and float64,
contiguous and channels_last, float32 dy of a bf16 x, a bf16 y of a float32 x, compiled with Triton's
compiler on the CPU (``vec_probe.py``; no GPU). A scalar ``ld.global.b16`` / ``b32`` / ``b64`` of x, dy, y or
dx fails it (the kernels before issue 35 loaded bf16 2 bytes at a time)."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_activation_access_is_16_byte_vectors_on_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != 'TRITON_INTERPRET'}
    env['TRITON_CACHE_DIR'] = str(tmp_path / 'triton-cache')  # compiled here, not found in a cache
    env['PYTHONPATH'] = ROOT
    proc = subprocess.run([sys.executable, os.path.join(ROOT, 'tests', 'kernels', 'vec_probe.py')], env=env,
                          capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    summary = out.strip().splitlines()[-1]
    bad = '\n'.join(line for line in out.splitlines() if line.startswith('BAD'))
    assert proc.returncode == 0, bad[-4000:] or out[-4000:]
    assert summary.endswith('0 with a narrow activation access'), summary
    # the variants: moments, apply, sums, dx (x 2 batch) in both layouts, the merge; per dtype
    assert int(summary.split()[0]) >= 50, summary
