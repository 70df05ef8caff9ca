"""Unitization's Triton coefficient map and VJP (normdense/kernels/unitization.py) against the torch methods
``Unitization2d.coeff_map`` / ``coeff_vjp``: every option combination (affine, batch or fixed statistics,
n / norm_divisor, var_correction), float64 to ~1e-12 and float32 to ~1e-5, odd shapes with v == 0 rows, a
shape spanning several programs and loop iterations of the kernels' blocks, and one launch per call."""
import itertools

import pytest
import torch

from normdense.layers import Unitization2d

# (n, norm_divisor): the divisor of the per-sample squared norm (Algorithm 2 line 9)
DIVISORS = [(None, 'hw'), (None, 'hw_squared'), (10.0, 'hw')]
CASES = list(itertools.product((True, False), ('batch', 'fixed'), DIVISORS, ('none', 'keras')))
IDS = [f'{"affine" if a else "noaffine"}-{s}-n{n}-{d}-{vc}' for a, s, (n, d), vc in CASES]
TOL = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=1e-5, atol=1e-5)}
SHAPES = [(1, 1), (2, 5), (3, 64)]  # (N, C)
POSITIONS = 7


def _layer(channels, affine, n, norm_divisor, var_correction, mode='batch', seed=0):
    torch.manual_seed(seed)
    layer = Unitization2d(channels, eps=1e-3, affine=affine, n=n, mode=mode, norm_divisor=norm_divisor,
                          var_correction=var_correction)
    with torch.no_grad():  # random parameters, not the init values
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    return layer


def _inputs(N, C, dtype, device, seed=1):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, positive=False):
        t = torch.randn(*shape, generator=g, dtype=torch.float64)
        return (t.abs() + 0.2 if positive else t * 2 + 0.5).to(dtype).to(device)

    m, v = rnd(N, C), rnd(N, C, positive=True)
    v[:, ::3] = 0  # constant (n, c) rows: 1x1 maps
    mean, var = rnd(C), rnd(C, positive=True)
    grads = (rnd(N, C), rnd(N, C))
    return m, v, mean, var, grads


def _params(layer, dtype, device):
    return [None if p is None else p.detach().to(dtype).to(device) for p in layer._statnorm_params()]


def _check(layer, N, C, dtype, device, stats, param_dtype=None):
    m, v, mean, var, grads = _inputs(N, C, dtype, device)
    params = _params(layer, param_dtype or dtype, device)
    count = N * POSITIONS if stats == 'batch' else None
    wants = stats == 'batch'
    tol = TOL[dtype]
    coeffs, res = layer._coeff_maps(False)[0](m, v, mean, var, params, POSITIONS, count)
    t_coeffs, t_res = layer._coeff_maps(True)[0](m, v, mean, var, params, POSITIONS, count)
    assert len(t_coeffs) == len(coeffs)
    for i, (got, want) in enumerate(zip(t_coeffs, coeffs)):
        assert got.dtype == dtype and not got.isnan().any(), i
        torch.testing.assert_close(got, want, **tol, msg=f'coefficient {i}')
    dm, dv, dmean, dvar, dparams = layer._coeff_maps(False)[1](res, grads, wants)
    t_dm, t_dv, t_dmean, t_dvar, t_dparams = layer._coeff_maps(True)[1](t_res, grads, wants)
    want = [dm, dv, dmean, dvar, *dparams]
    got = [t_dm, t_dv, t_dmean, t_dvar, *t_dparams]
    dtypes = [dtype] * 4 + [None if p is None else p.dtype for p in params]  # parameters' grads in their dtype
    for i, (g_, w_, dt) in enumerate(zip(got, want, dtypes)):
        if w_ is None:
            assert g_ is None, i
            continue
        assert g_.dtype == dt and not g_.isnan().any(), i
        half = dict(rtol=1e-2, atol=1e-2 * w_.abs().max().item())  # rounded once to a half parameter dtype
        torch.testing.assert_close(g_.to(w_.dtype), w_, **(half if dt in (torch.float16, torch.bfloat16) else tol),
                                   msg=f'gradient {i} (dm, dv, dmean, dvar, dalpha, dw, db)')
    assert (t_dmean is None) == (not wants) and (t_dparams[1] is None) == (not layer.affine)


@pytest.mark.parametrize('dtype', [torch.float64, torch.float32], ids=['f64', 'f32'])
@pytest.mark.parametrize('affine, stats, divisor, var_correction', CASES, ids=IDS)
def test_triton_coeff_map_and_vjp_equal_torch(affine, stats, divisor, var_correction, dtype, device):
    """Odd shapes (N in 1..3, C up to 64), random moments (some v == 0), statistics, parameters, grads."""
    n, norm_divisor = divisor
    for N, C in SHAPES:
        layer = _layer(C, affine, n, norm_divisor, var_correction)
        _check(layer, N, C, dtype, device, stats)


SEVERAL = [(True, 'batch', (None, 'hw_squared'), 'keras'), (False, 'fixed', (10.0, 'hw'), 'none'),
           (True, 'fixed', (None, 'hw'), 'none')]


@pytest.mark.parametrize('affine, stats, divisor, var_correction', SEVERAL)
def test_several_programs_and_blocks(affine, stats, divisor, var_correction, device):
    """C = 300 (three channel blocks of 128: three VJP programs per sample block, each summing p's terms over
    all channel blocks) and N = 17 (float64: 9 blocks of 2 samples, in the map and in the VJP, whose partial
    sums the second stage adds)."""
    from normdense.kernels.common import sample_blocks
    from normdense.kernels.unitization import _blocks
    block_n, block_c = _blocks(300, torch.float64)
    assert 300 > 2 * block_c and 17 > 2 * block_n
    assert sample_blocks(17, block_n, 3) == (9, 2)
    layer = _layer(300, affine, divisor[0], divisor[1], var_correction)
    _check(layer, 17, 300, torch.float64, device, stats)


def test_parameters_in_another_dtype(device):
    """float32 moments with bfloat16 parameters (cast inside the kernels, as the torch method does)."""
    layer = _layer(12, True, None, 'hw', 'none')
    _check(layer, 3, 12, torch.float32, device, 'batch', param_dtype=torch.bfloat16)


@pytest.mark.parametrize('affine, stats', [(True, 'batch'), (False, 'fixed')])
def test_one_launch_each(affine, stats, device, monkeypatch):
    """coeff_map and coeff_vjp are one kernel launch each (the path the launch takes: JITFunction.run on
    a GPU, InterpretedFunction.run under the interpreter)."""
    from normdense.kernels import unitization as kernels
    cls = type(kernels._coeff_map_kernel)
    assert type(kernels._coeff_vjp_kernel) is cls
    launches = []
    run = cls.run

    def counting_run(self, *args, **kwargs):
        launches.append(self)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(cls, 'run', counting_run)
    layer = _layer(20, affine, None, 'hw', 'none')
    m, v, mean, var, grads = _inputs(3, 20, torch.float32, device)
    count = 21 if stats == 'batch' else None
    _, res = layer._coeff_maps(True)[0](m, v, mean, var, _params(layer, torch.float32, device), POSITIONS, count)
    assert launches == [kernels._coeff_map_kernel]
    layer._coeff_maps(True)[1](res, grads, stats == 'batch')
    assert launches == [kernels._coeff_map_kernel, kernels._coeff_vjp_kernel]
