"""BCN's Triton coefficient map and VJP (normdense/kernels/bcn.py) against the torch methods of
BatchChannelNorm2d (Eq. 40-42 of arXiv:1903.10520, tested against autograd in tests/layers/test_statnorm.py):
every affine layout x statistics mode, channels per group 1 to 64, odd group counts and batch sizes, float64
and float32 (and half parameters), several programs and n-loop iterations; one launch per call."""
import functools

import pytest
import torch

from normdense.layers.bcn import BatchChannelNorm2d

# (N, num_groups, channels per group): per-group tiles of 1 to 64 channels (padded where not a power of 2),
# one program holding padded groups, and (G, per) = (12, 16), (32, 5), (3, 64) spanning two programs
SHAPES = [(1, 1, 1), (2, 3, 4), (3, 5, 16), (2, 32, 1), (3, 7, 3), (1, 2, 64), (3, 12, 16), (2, 32, 5),
          (3, 3, 64)]
MODES = [(group_affine, wants) for group_affine in (True, False) for wants in (False, True)]
CASES = [(shape, ga, wants) for shape in SHAPES for ga, wants in MODES]
TOL = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=1e-5, atol=1e-5)}


def _inputs(shape, group_affine, dtype, device, seed, param_dtype=None):
    n, g, per = shape
    c = g * per
    gen = torch.Generator().manual_seed(seed)

    def rnd(*size, positive=False):
        t = torch.randn(*size, generator=gen, dtype=torch.float64)
        return (t.abs() + 0.2 if positive else t * 2 + 0.5).to(dtype).to(device)

    layer = BatchChannelNorm2d(c, num_groups=g, group_affine=group_affine, eps=1e-3)
    m, v = rnd(n, c), rnd(n, c, positive=True)
    v[0, ::3] = 0  # constant (n, c) rows: v == 0
    mean, var = rnd(c), rnd(c, positive=True)
    params = [(rnd(*p.shape) * 0.7).to(param_dtype or dtype) for p in layer._statnorm_params()]
    grads = [rnd(n, c), rnd(n, c)]
    return layer, (m, v, mean, var, params), grads


@pytest.fixture(autouse=True)
def nan_filled_empty():
    """torch.empty fills with NaN in deterministic mode (fill_uninitialized_memory): an output element the
    kernels leave unwritten shows as NaN."""
    before = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    assert torch.empty(3, dtype=torch.float64).isnan().all()
    yield
    torch.use_deterministic_algorithms(before[0])
    torch.utils.deterministic.fill_uninitialized_memory = before[1]


@pytest.fixture
def launches(monkeypatch):
    """Counts kernel launches: kernel[grid](...) ends in the kernel class's run (JITFunction on a GPU,
    InterpretedFunction under TRITON_INTERPRET=1)."""
    from normdense.kernels import bcn as kernels
    cls = type(kernels._bcn_map_kernel)
    assert type(kernels._bcn_vjp_kernel) is cls
    calls = []
    run = cls.run

    def counted(self, *args, **kwargs):
        calls.append(self)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(cls, 'run', counted)
    return calls


def _check(layer, inputs, grads, wants, tol, launches):
    m, v, mean, var, params = inputs
    count = m.shape[0] * 7 if wants else None
    (a_t, b_t), res_t = layer._coeff_maps(False)[0](m, v, mean, var, params, 7, count)
    (a_k, b_k), res_k = layer._coeff_maps(True)[0](m, v, mean, var, params, 7, count)
    assert len(launches) == 1
    for got, want in ((a_k, a_t), (b_k, b_t)):
        assert got.dtype == m.dtype and not got.isnan().any()
        torch.testing.assert_close(got, want, **tol)
    expected = layer._coeff_maps(False)[1](res_t, grads, wants)
    got = layer._coeff_maps(True)[1](res_k, grads, wants)
    assert len(launches) == 2
    names = ('dm', 'dv', 'dmean', 'dvar', 'd batch_weight', 'd batch_bias', 'd weight', 'd bias')
    dtypes = [m.dtype] * 4 + [p.dtype for p in params]  # parameter gradients in the parameters' dtypes
    for name, g, e, dt in zip(names, got[:4] + tuple(got[4]), expected[:4] + tuple(expected[4]), dtypes):
        if e is None:
            assert g is None, name
            continue
        assert g.dtype == dt and g.shape == e.shape and not g.isnan().any(), name
        half = dict(rtol=1e-2, atol=1e-2 * e.abs().max().item())  # rounded to the half parameter dtype once
        torch.testing.assert_close(g.to(e.dtype), e, **(half if dt in (torch.float16, torch.bfloat16) else tol),
                                   msg=lambda s: f'{name}: {s}')


@pytest.mark.parametrize('dtype', [torch.float64, torch.float32], ids=['f64', 'f32'])
@pytest.mark.parametrize('shape, group_affine, wants', CASES,
                         ids=[f'{n}x{g}x{p}-{"group" if ga else "channel"}-{"batch" if w else "fixed"}'
                              for (n, g, p), ga, w in CASES])
def test_triton_coeff_map_and_vjp_equal_torch(shape, group_affine, wants, dtype, device, launches):
    layer, inputs, grads = _inputs(shape, group_affine, dtype, device, seed=sum(shape))
    _check(layer, inputs, grads, wants, TOL[dtype], launches)


@pytest.mark.parametrize('param_dtype', [torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_parameters_in_another_dtype(param_dtype, device, launches):
    """A module cast to half (or kept in float64) with float32 moments: the kernels cast on load, as the
    torch method's p.to(m.dtype)."""
    layer, inputs, grads = _inputs((3, 4, 4), True, torch.float32, device, seed=5, param_dtype=param_dtype)
    _check(layer, inputs, grads, True, TOL[torch.float32], launches)


def test_several_programs_and_loop_iterations(device, launches):
    """C = 512 over 64 groups of 8, N = 5: 4 group blocks of 16 groups x 2 sample blocks of 4 in the map."""
    from normdense.kernels.bcn import _blocks
    assert _blocks(5, 512, 64)[:5] == (8, False, 4, 16, 8)
    layer, inputs, grads = _inputs((5, 64, 8), False, torch.float64, device, seed=9)
    _check(layer, inputs, grads, True, TOL[torch.float64], launches)


@pytest.mark.parametrize('group_affine, wants', MODES, ids=[f'{"group" if ga else "channel"}-{"batch" if w else "fixed"}'
                                                           for ga, w in MODES])
def test_large_batch_in_sample_blocks(group_affine, wants, device, launches):
    """N = 70 in sample blocks of 4 (the last one partial): 18 map programs per group block; 2 group blocks of
    32 groups of 4 (the second one partial). The VJP, spread over the groups and the samples: 40 programs of
    one group x 3 sample blocks of 32 samples (the last one of 6), in tiles of 16."""
    from normdense.kernels.bcn import _blocks
    from normdense.kernels.common import sample_blocks
    per, chunked, block_n, block_g, block_p, _ = _blocks(70, 160, 40)
    assert (per, chunked, block_n, block_g, block_p) == (4, False, 4, 32, 4)
    assert _blocks(70, 160, 40, vjp=True)[2:5] == (16, 1, 4)
    assert sample_blocks(70, 16, 40) == (3, 32)
    layer, inputs, grads = _inputs((70, 40, 4), group_affine, torch.float64, device, seed=11)
    _check(layer, inputs, grads, wants, TOL[torch.float64], launches)


@pytest.mark.parametrize('group_affine, wants', MODES, ids=[f'{"group" if ga else "channel"}-{"batch" if w else "fixed"}'
                                                           for ga, w in MODES])
def test_vjp_spread_over_groups_with_sample_iterations(group_affine, wants, device, launches):
    """Classification batch sizes: the VJP takes one group per program (at least min(G, 32) programs share the
    sums over N instead of one) and tiles of 16 samples, each sample its own block here (N = 70: 5 blocks, the
    last one of 6)."""
    from normdense.kernels.bcn import _blocks
    from normdense.kernels.common import sample_blocks
    assert _blocks(70, 32, 2)[2:5] == (16, 2, 16)  # the map: 5 sample blocks of both groups
    assert _blocks(70, 32, 2, vjp=True)[2:5] == (16, 1, 16)
    assert sample_blocks(70, 16, 2) == (5, 16)
    # N = 256, C = 64: 32 group programs x 4 sample blocks of 64 (was one program looping over N)
    assert _blocks(256, 64, 32, vjp=True)[2:5] == (64, 1, 2)
    assert sample_blocks(256, 64, 32) == (4, 64)
    layer, inputs, grads = _inputs((70, 2, 16), group_affine, torch.float64, device, seed=12)
    _check(layer, inputs, grads, wants, TOL[torch.float64], launches)


@pytest.mark.parametrize('dtype', [torch.float64, torch.float32], ids=['f64', 'f32'])
@pytest.mark.parametrize('shape', [(5, 1, 13), (3, 3, 9)], ids=['1x13', '3x9'])
@pytest.mark.parametrize('group_affine, wants', MODES, ids=[f'{"group" if ga else "channel"}-{"batch" if w else "fixed"}'
                                                           for ga, w in MODES])
def test_groups_in_chunks(group_affine, wants, shape, dtype, device, launches, monkeypatch):
    """Groups wider than the kernels' ``chunk`` (4 here; 256 by default, e.g. one group of 4096 channels) are
    walked in chunks: 13 channels in 4 chunks (the last one of 1), one program per (group, chunk) in the
    VJP, each with the group's sums; one group and three."""
    from normdense.kernels import bcn as kernels
    for name in ('coeff_map', 'coeff_vjp'):
        monkeypatch.setattr(kernels, name, functools.partial(getattr(kernels, name), chunk=4))
    blocks, chunked = kernels._blocks, []
    kernels._launch_config.cache_clear()  # kept per configuration and shape: made anew here
    monkeypatch.setattr(kernels, '_blocks', lambda *a, **k: chunked.append(blocks(*a, **k)[1]) or blocks(*a, **k))
    n, g, per = shape
    assert kernels._blocks(n, g * per, g, chunk=4)[1:5:3] == (True, 4)
    layer, inputs, grads = _inputs(shape, group_affine, dtype, device, seed=13)
    _check(layer, inputs, grads, wants, TOL[dtype], launches)
    assert chunked == [True] * 3, chunked  # the call above, the map's and the VJP's


def test_one_group_of_4096_channels_is_chunked():
    """LN-like BCN (one group of 4096 channels, formerly the limit of a tile row): chunks of the default CHUNK,
    tiles of at most _TILE elements."""
    from normdense.kernels import bcn as kernels
    from normdense.kernels.common import CHUNK
    per, chunked, block_n, block_g, block_p, _ = kernels._blocks(256, 4096, 1)
    assert chunked and block_g == 1 and block_p == CHUNK < per == 4096
    assert block_n * block_g * block_p <= kernels._TILE
