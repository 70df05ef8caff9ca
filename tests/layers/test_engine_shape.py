"""The engine's shape, as a reader follows it (docs/engine.md): which normdense files one training step of a layer
runs code in, and how often control passes from one of them to another. Calls go one way (the layer's forward
calls the engine once, the engine asks the layer for data and the backend for passes), so the counts are small
and fixed; a hand-off added in the middle of a step shows here. The backends implement one declared contract."""
import collections
import inspect
import os
import sys

import pytest
import torch

import normdense
from normdense.kernels import backend as B
from normdense.kernels.aten import AtenBackend
from normdense.layers import BatchChannelNorm2d

ROOT = os.path.dirname(normdense.__file__)


def _entries(step):
    """The normdense files entered while ``step()`` runs, in order: a call whose nearest normdense caller (through
    torch's Function.apply, functools.partial) is in another file is an entry."""
    entries = []

    def profile(frame, event, arg):
        if event != 'call' or not frame.f_code.co_filename.startswith(ROOT):
            return
        back = frame.f_back
        while back is not None and not back.f_code.co_filename.startswith(ROOT):
            back = back.f_back
        if back is None or back.f_code.co_filename != frame.f_code.co_filename:
            entries.append(os.path.relpath(frame.f_code.co_filename, ROOT))

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    return entries


def _layer(mode, backend):
    kw = dict(update_rate=0.1) if mode == 'estimate' else {}
    layer = BatchChannelNorm2d(64, num_groups=8, mode=mode, backend=backend, **kw)
    x = torch.randn(2, 64, 6, 6, requires_grad=True)
    layer(x).sum().backward()  # warm (lazy imports, caches); the step below opens a new iteration
    return layer, x


@pytest.mark.parametrize('mode', ['estimate', 'batch'])
def test_bcn_aten_training_forward_visits_at_most_five_files(mode):
    layer, x = _layer(mode, 'aten')
    entries = _entries(lambda: layer(x))
    files = collections.Counter(entries)
    # batch mode needs no estimate bookkeeping (a recomputation is asked of autograd directly)
    assert set(files) <= {'layers/bcn.py', 'layers/_statnorm.py', 'layers/_estimate.py', 'kernels/backend.py',
                          'kernels/aten.py'}, entries
    assert {'layers/bcn.py', 'layers/_statnorm.py', 'kernels/aten.py'} <= set(files), entries
    assert len(entries) - len(files) <= 8, entries  # re-entries


def test_bcn_triton_training_step_touches_at_most_ten_files():
    """Forward and backward on the Triton backend (CPU tensors, Triton's interpreter): the layer, the engine, the
    estimates, the contract, the backend and its kernels."""
    pytest.importorskip('triton')
    if os.environ.get('TRITON_INTERPRET') != '1':
        pytest.skip('runs the Triton backend on CPU tensors under TRITON_INTERPRET=1')
    layer, x = _layer('estimate', 'triton')
    files = set(_entries(lambda: layer(x).sum().backward()))
    assert 'kernels/triton.py' in files and len(files) <= 10, sorted(files)


def _protocol_methods():
    return [n for n, v in vars(B.Backend).items() if inspect.isfunction(v) and not n.startswith('_')]


@pytest.mark.parametrize('name', ['aten', 'triton'])
def test_backends_implement_the_contract_with_its_signatures(name):
    if name == 'triton':
        pytest.importorskip('triton')
        from normdense.kernels.triton import TritonBackend as impl
    else:
        impl = AtenBackend
    assert impl.name == name and isinstance(impl.kernel_maps, bool)
    for method in _protocol_methods():
        if method == 'guard':  # a context-manager factory of one argument (ATen's is contextlib.nullcontext)
            with impl.guard(torch.zeros(1)):
                pass
            continue
        want = list(inspect.signature(getattr(B.Backend, method)).parameters)[1:]  # without self
        assert list(inspect.signature(getattr(impl, method)).parameters) == want, (name, method)
