"""``python -m normdense.self_check``'s GPU part (the engine layers' Triton kernels against the ATen backend) on
the CPU: its comparison takes the device, so here it runs on CPU tensors in Triton's interpreter
(``TRITON_INTERPRET=1``, tests/conftest.py) at a small shape, on CUDA where torch sees a GPU. The pass path on
the real layers, the fail path with a planted disagreement (exit status 1, one line naming the layer and the
workaround), the skip without a GPU, and the tolerances' verdicts on made-up tensors."""
import functools
import math
import os
import re

import pytest
import torch

from normdense import self_check as S

DEVICE = 'cpu' if os.environ.get('TRITON_INTERPRET') == '1' or not torch.cuda.is_available() else 'cuda'
# why so small: the interpreter's cost is per program (an (n, c) row), ~40 ms a pass at 8 rows
SMALL = dict(shape=(2, 4, 5, 7), groups=2)


# --- the verdict on made-up tensors (no Triton) ---------------------------------------------------------------
def test_difference_is_relative_to_the_reference_scale_and_refuses_what_cannot_agree():
    b = torch.tensor([4.0, -2.0, 1.0])
    assert S.difference(b.clone(), b) == 0.0
    assert S.difference(b + torch.tensor([0.0, 0.0, 0.4]), b) == pytest.approx(0.1)  # 0.4 of max |b| 4
    assert S.difference(torch.zeros(3), torch.zeros(3)) == 0.0
    assert S.difference(torch.tensor([0.0, 1e-9]), torch.zeros(2)) == math.inf  # no scale to be within
    for a in (torch.tensor([4.0, float('nan'), 1.0]), b.double(), b[:2], None):
        assert S.difference(a, b) == math.inf, a
    assert S.difference(None, None) == 0.0  # no gradient on either backend
    assert S.difference(torch.tensor(3), torch.tensor(3)) == 0.0  # num_batches_tracked: exact
    assert S.difference(torch.tensor(4), torch.tensor(3)) == math.inf


def _check(dtype, tri, aten):
    """A LayerCheck of one call whose tensors are ``tri`` and ``aten`` ({name: tensor})."""
    return S.LayerCheck('GN+PN', 'cuda', dtype, S.compare([tri], [aten]))


def test_tolerance_follows_each_tensors_dtype():
    """float32 tensors (also the parameter gradients and buffers of the bf16 autocast case) within 1e-4 of their
    scale, bf16 outputs and input gradients within 2^-5; the failure line names the layer, dtype, call, tensor."""
    y = torch.linspace(-3, 3, 64)
    ok32 = _check('float32', {'output': y * (1 + 5e-5)}, {'output': y})
    assert S.problem(ok32) is None and ok32.diffs['out'][:2] == (pytest.approx(5e-5, rel=1e-2), 1e-4)
    assert S.problem(_check('float32', {'output': y * (1 + 2e-4)}, {'output': y}))
    yb = y.bfloat16()
    one_ulp = {'output': yb, 'input grad': (y * (1 + 2 ** -7)).bfloat16()}
    assert S.problem(_check('bfloat16', one_ulp, {'output': yb, 'input grad': yb})) is None
    far = _check('bfloat16', {'output': (y * 1.05).bfloat16()}, {'output': yb})
    assert S.problem(far).startswith('GN+PN: the Triton kernels differ from the ATen backend on cuda (bfloat16, '
                                     'call 1, output) by ')
    # a float32 parameter gradient 1e-3 off in the bf16 case: beyond its float32 tolerance, not bf16's
    grads = {'output': yb, 'grad of weight': y}
    off = _check('bfloat16', {'output': yb, 'grad of weight': y * (1 + 1e-3)}, grads)
    assert off.worst()[2] == 'grad of weight' and 'call 1, grad of weight) by 0.001' in S.problem(off)
    line = S.report_line(off)
    assert line.split()[:3] == ['GN+PN', 'bfloat16', 'out'] and 'FAIL' in line and '\n' not in line


def test_a_backend_that_raises_is_named_in_one_line(monkeypatch):
    """A compile or launch failure is the layer's failure, said in one line; the other backend's result unused."""
    def run_backend(layer, backend, *args):
        if backend == 'triton':
            raise RuntimeError('PTXAS error\nmore')
        return layer, [{'output': torch.ones(2)}], (0, 0)
    monkeypatch.setattr(S, 'run_backend', run_backend)
    check = S.check_layer('BCN batch', None, torch.ones(2), torch.ones(2), 'float32')
    assert S.problem(check) == "BCN batch with backend='triton' fails on cpu in float32 (RuntimeError: PTXAS error)"
    assert 'FAIL' in S.report_line(check)


def test_engine_target_runs_on_a_gpu_only():
    assert S.engine_target(True, '3.7.1') == ('cuda', None)
    assert S.engine_target(False, '3.7.1')[0] is None and 'no GPU' in S.engine_target(False, '3.7.1')[1]
    assert S.engine_target(True, 'not installed')[0] is None


# --- the real layers on both backends -------------------------------------------------------------------------
def test_layers_agree_on_both_backends():
    """Every layer and dtype agrees (fp32; bf16 under autocast), every kind of tensor was compared, the Triton
    kernels ran (launches counted); on a GPU the second call took only kept launches."""
    pytest.importorskip('triton', reason='needs triton: not run')
    checks = list(S.engine_checks(DEVICE, **SMALL, dtypes=('float32', 'bfloat16'), calls=2))
    assert [(c.name, c.dtype) for c in checks] == [(n, d) for d in ('float32', 'bfloat16') for n in S.ENGINE_LAYERS]
    for c in checks:
        assert S.problem(c) is None, S.report_line(c)
        kinds = {'out', 'dx', 'dparams'} | ({'buffers'} if c.name != 'GN+PN' else set())
        assert set(c.diffs) == kinds, (c.name, c.diffs)
        # AMP as mmdet runs it: y and dx in the input's dtype, parameter gradients in the layer's float32
        assert [c.diffs[k][1] for k in ('out', 'dx', 'dparams')] == [S.TOLERANCE[c.dtype]] * 2 + [1e-4]
        total, kept = c.launches
        assert total >= 6, (c.name, c.launches)  # the Triton passes ran: not ATen twice
        assert kept == (total if DEVICE == 'cuda' else 0), (c.name, c.launches)
        assert re.match(rf'    {re.escape(c.name)} +{c.dtype} +out \S+ +dx \S+ +dparams .* ok ', S.report_line(c))


def _plant_from_second_call(monkeypatch, factor=1.1):
    """Unitization's Triton coefficient map with its A 10% off from its second call on (the first kept launch on
    a GPU): only a check that compares call 2 sees it. The layer binds the module's map when it plans."""
    from normdense.kernels import unitization as K
    original, seen = K.coeff_map, []

    def off(*args, **kwargs):
        coeffs, res = original(*args, **kwargs)
        seen.append(1)
        if len(seen) > 1:
            coeffs[0].mul_(factor)
        return coeffs, res
    monkeypatch.setattr(K, 'coeff_map', off)
    return seen


@pytest.mark.mmengine
def test_main_fails_in_one_line_naming_the_layer_and_the_workaround(monkeypatch, capsys):
    """The full command with the GPU part on this device at a small shape and a disagreement planted in call 2 of
    Unitization's Triton path: exit status 1, one stderr line naming Unitization and NORMDENSE_BACKEND=aten, the
    other layers reported ok with their times."""
    pytest.importorskip('triton', reason='needs triton: not run')
    pytest.importorskip('mmcv.ops', reason="needs mmcv's compiled ops: not installed")
    monkeypatch.setattr(S, 'engine_target', lambda gpu, triton: (DEVICE, None))
    monkeypatch.setattr(S, 'ENGINE_SETUP', dict(SMALL, dtypes=('float32', ), calls=2, repeats=1))
    seen = _plant_from_second_call(monkeypatch)
    rc = S.main([])
    out, err = capsys.readouterr()
    assert len(seen) >= 2
    assert rc == 1, out + err
    (line,) = err.splitlines()
    assert line.startswith('normdense self-check FAILED: Unitization: the Triton kernels differ from the ATen '
                           f'backend on {DEVICE} (float32, call 2, ')
    assert 'NORMDENSE_BACKEND=aten' in line
    rows = [r for r in out.splitlines() if r.startswith('    ')]
    assert [r.split()[0] for r in rows] == ['BCN', 'BCN', 'GN+PN', 'Unitization'], out
    assert all(' ok ' in r and 'nn.GroupNorm' in r for r in rows[:3]) and ' FAIL ' in rows[3], out
    assert out.splitlines()[-1].split() == ['Triton', 'kernels', 'FAIL']


@pytest.mark.mmengine
def test_main_without_a_gpu_skips_the_engine_part_and_runs_the_rest(monkeypatch, capsys):
    """No GPU: the line says skipped, the engine part is not run, mmcv's op still runs, exit status 0."""
    pytest.importorskip('mmcv.ops', reason="needs mmcv's compiled ops: not installed")
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: False)
    monkeypatch.setattr(S, 'engine_problem', lambda *a, **k: pytest.fail('the engine part ran without a GPU'))
    devices = []
    monkeypatch.setattr(S, 'run_nms', functools.partial(lambda run, device: devices.append(device) or run(device),
                                                        S.run_nms))
    rc = S.main([])
    out, err = capsys.readouterr()
    assert rc == 0, out + err
    assert devices == ['cpu'] and out.startswith('normdense self-check: the core stack imports'), out
    (skip,) = [r for r in out.splitlines() if r.strip().startswith('Triton kernels')]
    assert skip.split()[2:5] == ['skipped:', 'torch', 'sees'] and 'no GPU' in skip, out
    assert err == ''
