"""benchmarks/gpu.py: without a GPU it refuses in one line; ``--device cpu --quick`` runs every part of it
(nn.GroupNorm and each Triton-backed layer with both backends, launch counts, bytes against the copy
bandwidth, the IterNorm/ZCA comparison, targets, JSON and markdown). On the CPU the Triton rows run under
Triton's interpreter (``TRITON_INTERPRET=1``, tests/conftest.py)."""
import inspect
import json
import os
import os.path as osp
import subprocess
import sys

import pytest
import torch

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
SCRIPT = osp.join(ROOT, 'benchmarks', 'gpu.py')
sys.path.insert(0, ROOT)
from benchmarks import gpu  # noqa: E402

LAYERS = ('BCN estimate', 'BCN batch', 'GN+PN relu', 'Unitization batch', 'Unitization estimate')


def _run(tmp_path):
    out, md = tmp_path / 'b.json', tmp_path / 'b.md'
    results = gpu.main(['--device', 'cpu', '--quick', '--out', str(out), '--md', str(md)])
    data = json.loads(out.read_text())
    assert results['targets'] == data['targets']
    return data, md.read_text()


def _check_rows(data, measured_layers):
    assert data['conditions']['device'] == 'cpu' and data['conditions']['quick'] is True
    assert list(data['settings']) == ['tiny bf16'] and data['copy_bandwidth_gbps'] > 0
    s = data['settings']['tiny bf16']
    expected = {gpu.GN, gpu.BN} | {f'{n} [{b}]' for n in LAYERS for b in gpu.BACKENDS}
    assert set(s['rows']) | set(s['unavailable']) == expected and not set(s['rows']) & set(s['unavailable'])
    assert all(s['unavailable'].values())  # each with its reason
    assert {f'{n} [aten]' for n in measured_layers} | {gpu.GN, gpu.BN} <= set(s['rows'])
    floor = 8 * 64 * 64 * 2  # 3 + 5 passes over a bf16 1x64x8x8
    for name, row in s['rows'].items():
        assert row['fwd_ms'] > 0 and row['fwd+bwd_ms'] > 0 and row['floor_bytes'] == floor, name
        assert row['gbps'] > 0 and row['floor_fraction'] > 0 and row['gpu_kernels'] is None, name
        assert row['launches'] == row['aten_ops'] + row['triton_launches'] > 0, name
    assert s['rows'][gpu.GN]['vs_gn'] == 1.0 and s['rows'][gpu.GN]['triton_launches'] == 0
    assert s['rows'][gpu.BN]['vs_bn'] == 1.0 and s['rows'][gpu.BN]['triton_launches'] == 0
    assert len(data['targets']) == 2 * len(LAYERS) + 2
    for t in data['targets'][:-2]:  # a target without its row fails, with the reason
        assert t['passed'] is False or t['value'] is not None
        assert t['value'] is not None or t['note']
    assert data['whitening']['zca_over_iternorm'] > 0 and data['whitening']['zca_over_newton'] > 0
    assert all(row['device_ms'] is None for row in s['rows'].values())  # the kernels' own time: CUDA only
    host = data['host']  # host time per call, apart (benchmarks/host.py)
    assert host['device'] == 'cpu' and {'nn.GroupNorm', 'BCN estimate [aten]'} <= {r['name'] for r in host['results']}
    assert all(r['dy_us'] > 0 and r['python_calls'] > 0 for r in host['results'])


@pytest.mark.slow  # ~90 s on 2 cores: every Triton row in the interpreter
def test_quick_cpu_run_writes_complete_json_and_table(tmp_path):
    from normdense.layers.bcn import BatchChannelNorm2d
    data, md = _run(tmp_path)
    has_backends = 'backend' in inspect.signature(BatchChannelNorm2d.__init__).parameters
    _check_rows(data, LAYERS if has_backends else ())
    # the Triton rows run on CPU tensors in the interpreter, which tests/conftest.py sets where no GPU is seen
    if has_backends and os.environ.get('TRITON_INTERPRET') == '1':
        assert not data['settings']['tiny bf16']['unavailable']
        assert all(data['settings']['tiny bf16']['rows'][f'{n} [triton]']['triton_launches'] > 0 for n in LAYERS)
    assert md.count('\n| ') >= 12 and '| nn.GroupNorm(32) | ' in md and ('PASS' in md or 'FAIL' in md)


def test_quick_cpu_run_measures_layer_rows(tmp_path, monkeypatch):
    """The measuring path of every layer row, whether or not the layers have the ``backend`` option yet: the
    layers with their default backend (ATen on CPU tensors), the Triton rows left out with a reason."""
    def build(factory, backend, x, device):
        if backend == 'triton':
            return None, 'left out in this test'
        return factory().to(device).train(), None

    monkeypatch.setattr(gpu, 'build', build)
    data, md = _run(tmp_path)
    _check_rows(data, LAYERS)
    s = data['settings']['tiny bf16']
    assert s['unavailable'] == {f'{n} [triton]': 'left out in this test' for n in LAYERS}
    assert all(s['rows'][f'{n} [aten]']['aten_ops'] > s['rows'][gpu.GN]['aten_ops'] for n in LAYERS)
    assert '| BCN batch [aten] | ' in md and '| BCN batch [triton] | n/a | n/a |' in md
    assert all(not t['passed'] for t in data['targets'][:-2])


@pytest.mark.skipif(torch.cuda.is_available(), reason='checks the message shown without a GPU')
def test_without_gpu_exits_with_one_line():
    proc = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 1
    assert proc.stderr.strip().count('\n') == 0 and 'no GPU' in proc.stderr, proc.stderr
