"""benchmarks/gpu.py: without a GPU it refuses in one line; ``--device cpu --quick`` runs every part of
it (all layers, both precisions, fwd and fwd+bwd, the whitening comparison, targets, JSON)."""
import json
import os.path as osp
import subprocess
import sys

import pytest
import torch

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
SCRIPT = osp.join(ROOT, 'benchmarks', 'gpu.py')


def test_quick_cpu_run_writes_complete_json(tmp_path):
    sys.path.insert(0, ROOT)
    from benchmarks import gpu
    out = tmp_path / 'gpu.json'
    results = gpu.main(['--device', 'cpu', '--quick', '--out', str(out)])
    data = json.loads(out.read_text())
    assert data['conditions']['device'] == 'cpu' and data['conditions']['quick'] is True
    (key, setting), = data['settings'].items()
    assert key == '1x64x8x8'
    names = set(gpu.candidates(64))
    assert {'nn.GroupNorm(32)', 'nn.BatchNorm2d', 'IterNorm g64 T5', 'ZCA g64 (eigh)', 'WSConv2d 3x3'} <= names
    for precision in ('fp32', 'amp'):
        assert set(setting[precision]) == names
        for row in setting[precision].values():
            assert row['fwd_ms'] > 0 and row['fwd+bwd_ms'] > 0 and row['peak_bytes'] is None
    assert setting['whitening']['zca_over_newton'] > 0
    assert len(data['targets']) == 2 + 2 * len(gpu.TARGET_LAYERS)
    assert results['targets'] == data['targets']


@pytest.mark.skipif(torch.cuda.is_available(), reason='checks the message shown without a GPU')
def test_without_gpu_exits_with_one_line():
    proc = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 1
    assert proc.stderr.strip().count('\n') == 0 and 'no GPU' in proc.stderr, proc.stderr
