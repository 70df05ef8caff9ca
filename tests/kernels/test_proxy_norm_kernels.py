"""GN+PN's Triton coefficient map and VJP (normdense/kernels/proxy_norm.py, through the layer's
``_coeff_maps(True)``) against the layer's torch ``coeff_map`` / ``coeff_vjp``: every
activation, proxy scaling and proxy affine on and off, channels per group 1, 4, 16 and LN+PN (one group),
random moments (some v = 0) and parameters, float64 to ~1e-12 and float32 to ~1e-5; one launch each."""
import copy
import functools

import pytest
import torch

triton = pytest.importorskip('triton')

from normdense.kernels import proxy_norm as K  # noqa: E402
from normdense.layers.proxy_norm import GroupProxyNorm  # noqa: E402

ACTS = ['relu', 'relu6', dict(type='leaky_relu', negative_slope=0.2), 'leaky_relu', dict(type='elu', alpha=0.5),
        dict(type='celu', alpha=2.0), 'selu', 'gelu', dict(type='gelu', approximate='tanh'), 'silu', 'mish',
        'softplus', dict(type='softplus', beta=2.0, threshold=1.5), 'hardswish', 'sigmoid', 'tanh']
# (act, proxy_scaling, proxy_affine)
OPTIONS = [('relu', True, True), ('relu', False, True), ('relu', True, False), ('relu', False, False),
           ('gelu', True, True), (dict(type='leaky_relu', negative_slope=0.2), False, True), ('silu', True, False),
           (dict(type='softplus', beta=2.0, threshold=1.5), False, False), ('elu', True, True),
           ('hardswish', True, False)]
# (N, C, groups, num_samples): channels per group 1, 4, 16, 12 (LN+PN)
SHAPES = [(1, 4, 4, 7), (2, 16, 4, 13), (3, 48, 3, 30), (2, 12, 1, 9)]
# several programs (more groups than a block holds), several sample blocks, a group wider than 64 channels
BIG = [(3, 150, 150, 50), (2, 192, 12, 200), (1, 100, 1, 33)]
TOL = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=1e-5, atol=1e-5)}


@pytest.fixture(autouse=True)
def _seeded():
    """The same draws whatever ran before (the global generator's state depended on the test order)."""
    torch.manual_seed(0)


def _layer(act, scaling, affine, c, groups, samples, param_dtype, device):
    layer = GroupProxyNorm(c, num_groups=groups, act=act, proxy_scaling=scaling, proxy_affine=affine,
                           num_samples=samples, eps=1e-3).to(device=device, dtype=param_dtype)
    with torch.no_grad():  # not the init values (gamma = 1, the rest 0)
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, dtype=torch.float64) * 0.7 + 0.3)
    return layer


def _moments(n, c, dtype, device):
    m = torch.randn(n, c, dtype=torch.float64) * 2
    v = torch.rand(n, c, dtype=torch.float64) * 3
    v[0, :c // 2 + 1] = 0.0  # constant (n, c): v = 0
    if n > 1:
        v[1] = 0.0
    return m.to(dtype).to(device), v.to(dtype).to(device)


def _close(actual, expected, tol):
    assert (actual is None) == (expected is None)
    if expected is not None:
        assert torch.isfinite(actual).all()
        # float32: relative to the tensor's scale too (sums over N and the samples cancel)
        scale = max(1.0, expected.abs().max().item()) if expected.dtype == torch.float32 else 1.0
        torch.testing.assert_close(actual.cpu(), expected.expand_as(actual), rtol=tol['rtol'], atol=tol['atol'] * scale)


def _check(act, scaling, affine, shape, dtype, device, param_dtype=None, strided=False):
    n, c, groups, samples = shape
    layer = _layer(act, scaling, affine, c, groups, samples, param_dtype or dtype, device)
    m, v = _moments(n, c, dtype, device)
    params = tuple(layer._statnorm_params())
    # the torch form on the CPU: ATen's CUDA hardswish multiplies by a float 1/6 (3e-8 off in float64)
    ref = copy.deepcopy(layer).cpu()
    coeffs, res = ref._coeff_maps(False)[0](m.cpu(), v.cpu(), None, None, tuple(ref._statnorm_params()), 11, None)
    t_coeffs, t_res = layer._coeff_maps(True)[0](m, v, None, None, params, 11, None)
    assert len(t_coeffs) == 4 and all(t.shape == (n, c) and t.dtype == dtype for t in t_coeffs)
    for actual, expected in zip(t_coeffs, coeffs):
        _close(actual, expected, TOL[dtype])
    grads = [torch.randn(n, c, dtype=torch.float64).to(dtype).to(device) for _ in range(4)]
    if strided:  # transposed and expanded gradients: the kernel takes strides
        grads[0] = grads[0].t().contiguous().t()
        grads[2] = torch.randn(c, dtype=dtype, device=device).expand(n, c)
    expected = ref._coeff_maps(False)[1](res, [g.cpu() for g in grads], False)
    actual = layer._coeff_maps(True)[1](t_res, grads, False)
    for a, e in zip(actual[:4], expected[:4]):
        _close(a, e, TOL[dtype])
    assert len(actual[4]) == 4
    for a, e, p in zip(actual[4], expected[4], params):  # parameter gradients in the parameters' dtypes
        if p is None:  # no proxy affine
            assert a is None and e is None
            continue
        assert a is None or a.dtype == p.dtype
        # rounded once to the parameter dtype where it is coarser than the compute dtype
        coarse = p.dtype if p.dtype.itemsize < torch.finfo(dtype).bits // 8 else dtype
        tol = dict(rtol=1e-2, atol=1e-2) if coarse in (torch.float16, torch.bfloat16) else TOL[coarse]
        _close(None if a is None else a.to(dtype), e, tol)


@pytest.mark.parametrize('dtype', [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize('scaling,affine', [(True, True), (False, True), (True, False), (False, False)], ids=str)
@pytest.mark.parametrize('act', ACTS, ids=str)
def test_every_activation(act, scaling, affine, dtype, device):
    _check(act, scaling, affine, (2, 8, 2, 11), dtype, device)


@pytest.mark.parametrize('dtype', [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize('shape', SHAPES, ids=str)
@pytest.mark.parametrize('act,scaling,affine', OPTIONS, ids=str)
def test_options_and_shapes(act, scaling, affine, shape, dtype, device):
    _check(act, scaling, affine, shape, dtype, device)


@pytest.mark.parametrize('dtype', [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize('shape', BIG, ids=str)
@pytest.mark.parametrize('act,scaling,affine', [OPTIONS[0], OPTIONS[5], OPTIONS[6]], ids=str)
def test_several_programs_and_sample_blocks(act, scaling, affine, shape, dtype, device):
    chunked, bn, bg, bp, bs, _ = K._blocks(shape[0], shape[2], shape[1] // shape[2], shape[3])
    assert triton.cdiv(shape[2], bg) > 1 or shape[3] > bs
    _check(act, scaling, affine, shape, dtype, device)


def test_large_batch_in_sample_blocks(device):
    """N = 70 in sample blocks of 8 (the last one partial): 9 map programs per group block; 2 group blocks of
    16 groups of 4 (the second one partial). The VJP spread over the groups and the samples: 20 programs of one
    group (not 2) x 5 sample blocks of 16 (the last one of 6), summed by the second stage."""
    from normdense.kernels.common import sample_blocks
    chunked, bn, bg, bp, bs, _ = K._blocks(70, 20, 4, 13)
    assert (chunked, bn, bg, bp) == (False, 8, 16, 4) and 70 % bn
    chunked, bn, bg, bp, bs, _ = K._blocks(70, 20, 4, 13, vjp=True)
    assert (chunked, bn, bg, bp) == (False, 16, 1, 4)
    assert sample_blocks(70, 16, 20) == (5, 16)
    _check('gelu', True, True, (70, 80, 20, 13), torch.float64, device)


@pytest.mark.parametrize('dtype', [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize('shape', [(5, 13, 1, 9), (3, 27, 3, 7)], ids=['1x13', '3x9'])
@pytest.mark.parametrize('act,scaling,affine', [OPTIONS[0], OPTIONS[5], OPTIONS[6]], ids=str)
def test_groups_in_chunks(act, scaling, affine, shape, dtype, device, monkeypatch):
    """Groups wider than the kernels' ``chunk`` (4 here; 256 by default, e.g. LN+PN of 4096 channels) are walked
    in chunks: 13 channels in 4 chunks (the last one of 1), one VJP program per (group, chunk) with the group's
    sums; one group and three."""
    for name in ('coeff_map', 'coeff_vjp'):
        monkeypatch.setattr(K, name, functools.partial(getattr(K, name), chunk=4))
    blocks, chunked = K._blocks, []
    K._launch_config.cache_clear()  # kept per configuration: made anew here
    monkeypatch.setattr(K, '_blocks', lambda *a, **k: chunked.append(blocks(*a, **k)[0]) or blocks(*a, **k))
    n, c, groups, samples = shape
    chunked_, bn, bg, bp, bs, _ = K._blocks(n, groups, c // groups, samples, chunk=4)
    assert chunked_ and (bg, bp) == (1, 4)
    _check(act, scaling, affine, shape, dtype, device)
    # the call above, then the map's and the VJP's configs, planned once for both launches
    assert all(chunked) and len(chunked) == 3, chunked


def test_layer_norm_of_4096_channels_is_chunked():
    """LN+PN of 4096 channels (formerly one 4096-wide tile row): chunks of CHUNK, tiles of at most _TILE."""
    from normdense.kernels.common import CHUNK
    chunked, bn, bg, bp, bs, _ = K._blocks(256, 1, 4096, 200)
    assert chunked and bg == 1 and bp == CHUNK < 4096 and bn * bg * bp <= K._TILE


@pytest.mark.parametrize('dtype,param_dtype', [(torch.float64, torch.float32), (torch.float32, torch.float16),
                                               (torch.float32, torch.bfloat16)], ids=str)
def test_parameters_in_another_dtype(dtype, param_dtype, device):
    _check('gelu', True, True, (2, 16, 4, 13), dtype, device, param_dtype=param_dtype)


def test_gradients_with_strides(device):
    _check('silu', True, True, (3, 16, 4, 13), torch.float64, device, strided=True)


def test_one_launch_each(monkeypatch, device):
    kernels = (K._coeff_map_kernel, K._coeff_vjp_kernel)
    kinds = {type(k) for k in kernels}
    assert len(kinds) == 1  # InterpretedFunction under the interpreter, JITFunction on a GPU
    launches = []
    run = kinds.pop().run

    def counted(self, *args, **kwargs):
        launches.append(self)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(type(kernels[0]), 'run', counted)
    layer = _layer('gelu', True, True, 24, 3, 17, torch.float32, device)
    m, v = _moments(3, 24, torch.float32, device)
    coeffs, res = layer._coeff_maps(True)[0](m, v, None, None, tuple(layer._statnorm_params()), 5, None)
    assert launches == [kernels[0]]
    layer._coeff_maps(True)[1](res, [torch.randn_like(m) for _ in range(4)], False)
    assert launches == [kernels[0], kernels[1]]


def test_kernels_import_nothing_above_them():
    import ast
    from normdense.kernels import activations
    for module in (K, activations):
        tree = ast.parse(open(module.__file__).read())
        names = {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
        names |= {'.' * node.level + (node.module or '') for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert names <= {'functools', 'typing', 'torch', 'triton', 'triton.language', '.activations', '.common',
                         '.first_stage', '.launch'}, names
