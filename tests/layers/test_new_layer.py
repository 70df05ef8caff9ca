"""A new engine layer written here from the documented contract alone (CONTRIBUTING, "Add a normalization layer";
docs/engine.md): a per-sample group norm with its own coefficient map and closed-form VJP, and no Triton
transcription. It runs on both backends (the Triton passes around its torch maps; under the interpreter here)
equal to a float64 reference, with gradcheck and a double backward. Its declaration (``normdense.layers.declare``)
gives the engine tests one more case: tests/kernels/test_host_path.py and test_launch.py take it up unedited."""
import functools
from typing import NamedTuple

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from normdense.layers._statnorm import StatNorm2d
from normdense.layers.declare import declare

BACKENDS = ['aten', 'triton']


class Config(NamedTuple):
    num_groups: int
    eps: float


class Residuals(NamedTuple):
    d: torch.Tensor  # m minus its group's mean (N, G, per)
    r: torch.Tensor  # 1 / sigma_g (N, G, 1)
    w: torch.Tensor


def coeff_map(cfg, m, v, mean, var, params, positions, count):
    """Group norm per sample as y = A (x - m) + B: sigma_g^2 = mean over the group of v + (m - mu_g)^2 (the law of
    total variance), A = gamma / sigma_g, B = beta + A (m - mu_g)."""
    w, b = (p.to(m.dtype) for p in params)
    n, c = m.shape
    g = cfg.num_groups
    per = c // g
    m3 = m.view(n, g, per)
    d = m3 - m3.mean(2, keepdim=True)
    r = torch.rsqrt((v.view(n, g, per) + d * d).mean(2, keepdim=True) + cfg.eps)
    a = r * w.view(g, per)
    return (a.view(n, c), (b.view(g, per) + a * d).view(n, c)), Residuals(d=d, r=r, w=w)


def coeff_vjp(cfg, res, grads, wants_stats):
    """The closed-form VJP of :func:`coeff_map`: (dm, dv, None, None, (d gamma, d beta))."""
    d, r, w = res.d, res.r, res.w
    ga, gb = grads
    n, c = ga.shape
    g = cfg.num_groups
    per = c // g
    ga3, gb3 = ga.view(n, g, per), gb.view(n, g, per)
    gt = ga3 + gb3 * d  # through A = w r and the A d of B
    dw = (gt * r).sum(0).view(c)
    dvar = (gt * w.view(g, per)).sum(2, keepdim=True) * r.pow(3) * (-0.5 / per)
    gd = gb3 * w.view(g, per) * r + 2.0 * d * dvar
    dm = (gd - gd.mean(2, keepdim=True)).view(n, c)
    dv = dvar.expand(n, g, per).reshape(n, c)
    return dm, dv, None, None, (dw, gb.sum(0))


@declare('PerSampleGroupNorm', cases={'per-sample-gn': {}})
class PerSampleGroupNorm(StatNorm2d):
    _FIRST_STAGE = False  # no per-channel statistics before the map

    def __init__(self, num_channels, num_groups, eps=1e-5, fused=True, backend=None):
        super().__init__()
        self.num_channels, self.num_groups, self.eps = num_channels, num_groups, eps
        self.weight = nn.Parameter(torch.ones(num_channels))
        self.bias = nn.Parameter(torch.zeros(num_channels))
        self._init_statnorm(num_channels, None, False, fused, backend)

    def _statnorm_params(self):
        return self.weight, self.bias

    def _coeff_maps(self, kernel):
        if kernel:
            return None  # no Triton transcription: the Triton backend runs the torch maps
        cfg = Config(self.num_groups, self.eps)
        return functools.partial(coeff_map, cfg), functools.partial(coeff_vjp, cfg)

    def _reference(self, x):
        return F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)


def reference(x, weight, bias, num_groups, eps):
    """The float64 transcription: normalize each group of each sample over its channels and positions."""
    n, c = x.shape[:2]
    xg = x.reshape(n, num_groups, -1)
    mu = xg.mean(2, keepdim=True)
    var = ((xg - mu) ** 2).mean(2, keepdim=True)
    shape = (1, c) + (1, ) * (x.dim() - 2)
    return ((xg - mu) / torch.sqrt(var + eps)).view(x.shape) * weight.view(shape) + bias.view(shape)


def make(backend, fused=True):
    if backend == 'triton':
        pytest.importorskip('triton', reason='needs triton: not run')
    torch.manual_seed(0)
    layer = PerSampleGroupNorm(6, 3, fused=fused, backend=backend).double()
    with torch.no_grad():
        layer.weight.uniform_(0.5, 1.5)
        layer.bias.uniform_(-0.5, 0.5)
    return layer


def test_coeff_vjp_equals_autograd_of_the_map():
    cfg = Config(3, 1e-5)
    g = torch.Generator().manual_seed(1)
    m, v = torch.randn(2, 6, generator=g, dtype=torch.float64), torch.rand(2, 6, generator=g, dtype=torch.float64)
    w, b = torch.rand(6, generator=g, dtype=torch.float64) + 0.5, torch.randn(6, generator=g, dtype=torch.float64)
    inputs = [t.requires_grad_() for t in (m, v, w, b)]
    (a, bb), res = coeff_map(cfg, m, v, None, None, (w, b), 4, None)
    ga, gb = torch.randn(2, 6, generator=g, dtype=torch.float64), torch.randn(2, 6, generator=g, dtype=torch.float64)
    want = torch.autograd.grad((a * ga + bb * gb).sum(), inputs)
    dm, dv, _, _, (dw, db) = coeff_vjp(cfg, res, (ga, gb), False)
    for got, w_ in zip((dm, dv, dw, db), want):
        torch.testing.assert_close(got, w_, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize('backend', BACKENDS)
def test_the_engine_runs_it_equal_to_the_float64_reference(backend):
    layer = make(backend)
    x = torch.randn(2, 6, 3, 4, dtype=torch.float64, requires_grad=True)
    y = layer(x)
    torch.testing.assert_close(y, reference(x, layer.weight, layer.bias, 3, 1e-5), rtol=1e-12, atol=1e-12)
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, layer.weight, layer.bias], dy)
    want = torch.autograd.grad(reference(x, layer.weight, layer.bias, 3, 1e-5), [x, layer.weight, layer.bias], dy)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    # the engine's Function (the ATen path views its (N, C, L) output in x's shape), not the reference composition
    fns = [y.grad_fn] + [f for f, _ in y.grad_fn.next_functions if f is not None]
    assert '_StatNormFnBackward' in {type(f).__name__ for f in fns}


@pytest.mark.parametrize('backend', BACKENDS)
def test_gradcheck_and_gradgradcheck(backend):
    layer = make(backend)
    x = torch.randn(2, 6, 1, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(layer, (x, ), fast_mode=backend == 'triton')
    assert torch.autograd.gradgradcheck(layer, (x, ), fast_mode=backend == 'triton')


def test_the_engine_tests_take_its_declared_case():
    """What the host-path and launch-key tests loop over (tests/engine_cases.py) holds this layer's case."""
    from tests.engine_cases import engine_cases
    cases = engine_cases(8, 2, backend='aten')
    layer = cases['per-sample-gn']()
    assert isinstance(layer, PerSampleGroupNorm) and layer.num_groups == 2 and layer.backend == 'aten'
