import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from mmcv.cnn import build_norm_layer

import normdense  # noqa: F401  (registers GNPN)
from normdense.layers.proxy_norm import GroupProxyNorm, proxy_quantiles

ACTS = {
    'relu': lambda t: torch.clamp(t, min=0),
    'gelu': lambda t: 0.5 * t * (1 + torch.erf(t / math.sqrt(2))),
    'silu': lambda t: t / (1 + torch.exp(-t)),
    'leaky_relu': lambda t: torch.where(t > 0, t, 0.2 * t),
}
ACT_CFGS = {'relu': 'relu', 'gelu': 'GELU', 'silu': 'swish',
            'leaky_relu': dict(type='LeakyReLU', negative_slope=0.2, inplace=True)}


def group_norm64(x, groups, eps):
    """GN without affine, written out: per sample and group, over channels-in-group x positions."""
    n, c = x.shape[:2]
    xg = x.reshape(n, groups, -1)
    mean = xg.mean(-1, keepdim=True)
    var = ((xg - mean) ** 2).mean(-1, keepdim=True)
    return ((xg - mean) / torch.sqrt(var + eps)).reshape(x.shape)


def gaussian_moments_by_integration(phi, gamma, beta, proxy_beta, proxy_gamma, points=400001):
    """E and Var of phi(gamma * Y + beta), Y ~ N(proxy_beta, (1 + proxy_gamma)^2), per channel,
    by a fine trapezoid over the standard normal density on [-14, 14] (float64)."""
    t = torch.linspace(-14.0, 14.0, points, dtype=torch.float64)
    pdf = torch.exp(-0.5 * t ** 2) / math.sqrt(2 * math.pi)
    means, variances = [], []
    for g, b, pb, pg in zip(gamma, beta, proxy_beta, proxy_gamma):
        a = phi(g * (pb + (1 + pg) * t) + b)
        m = torch.trapezoid(a * pdf, t)
        means.append(m)
        variances.append(torch.trapezoid((a - m) ** 2 * pdf, t))
    return torch.stack(means), torch.stack(variances)


def eq7_reference(x, layer, phi, moments):
    """Eq. 7 in float64: (phi(gamma z + beta) - E[...]) / sqrt(Var[...] + eps_pn), z = GN(x)."""
    shape = (1, -1) + (1, ) * (x.dim() - 2)
    z = group_norm64(x, layer.num_groups, layer.eps)
    gamma, beta = layer.weight.double().view(shape), layer.bias.double().view(shape)
    mean, var = moments
    return (phi(gamma * z + beta) - mean.view(shape)) / torch.sqrt(var.view(shape) + layer.proxy_eps)


def randomize(layer, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5 + (1.0 if p is layer.weight else 0.0))
    return layer


@pytest.mark.parametrize('act', list(ACTS))
def test_matches_eq7_with_integrated_proxy_moments_and_converges(act):
    torch.manual_seed(0)
    x = torch.randn(2, 8, 5, 4, dtype=torch.float64) * 3 + 1
    errors = []
    reference = None
    for n in (25, 100, 400, 1600, 6400):
        layer = randomize(GroupProxyNorm(8, num_groups=4, act=ACT_CFGS[act], num_samples=n)).double()
        if reference is None:
            moments = gaussian_moments_by_integration(ACTS[act], layer.weight.double(), layer.bias.double(),
                                                      layer.proxy_beta.double(), layer.proxy_gamma.double())
            reference = eq7_reference(x, layer, ACTS[act], moments)
        with torch.no_grad():
            errors.append((layer(x) - reference).abs().max().item())
    # first-order convergence in 1/n (the midpoint quantiles' variance falls short of 1 by ~1.3/n)
    assert all(a > 3 * b for a, b in zip(errors, errors[1:])), errors
    assert errors[-1] < 1e-3 * reference.abs().max().item(), (errors, reference.abs().max().item())


def test_default_layer_equals_quantile_transcription():
    """n=200 quantiles sqrt(2) erfinv(2 (i + 0.5)/n - 1), mean/var over the samples (App. B)."""
    torch.manual_seed(1)
    layer = randomize(GroupProxyNorm(6, num_groups=3), seed=3).double()
    assert (layer.num_samples, layer.proxy_eps, layer.eps) == (200, 0.03, 1e-5)
    x = torch.randn(3, 6, 4, 4, dtype=torch.float64)
    q = torch.tensor([math.sqrt(2) * float(torch.special.erfinv(torch.tensor(2 * (i + 0.5) / 200 - 1,
                                                                           dtype=torch.float64)))
                      for i in range(200)], dtype=torch.float64)
    torch.testing.assert_close(proxy_quantiles(200), q, rtol=0, atol=1e-14)
    proxy = layer.proxy_beta.detach()[:, None] + (1 + layer.proxy_gamma.detach())[:, None] * q
    a = torch.relu(layer.weight.detach()[:, None] * proxy + layer.bias.detach()[:, None])
    mean = a.mean(1)
    var = ((a - mean[:, None]) ** 2).mean(1)
    expected = eq7_reference(x, layer, ACTS['relu'], (mean, var))
    with torch.no_grad():
        torch.testing.assert_close(layer(x), expected, rtol=1e-12, atol=1e-12)


def test_init_and_parameters():
    layer = GroupProxyNorm(16, num_groups=4)
    names = dict(layer.named_parameters())
    assert set(names) == {'weight', 'bias', 'proxy_beta', 'proxy_gamma'}
    assert torch.equal(layer.weight, torch.ones(16)) and torch.equal(layer.bias, torch.zeros(16))
    assert torch.equal(layer.proxy_beta, torch.zeros(16)) and torch.equal(layer.proxy_gamma, torch.zeros(16))
    assert isinstance(layer, nn.GroupNorm)  # mmengine's norm_decay_mult / Constant init see it as GN
    assert set(layer.state_dict()) == set(names)  # the proxy samples are not state


def test_proxy_scaling_off_only_centres_and_proxy_affine_off():
    torch.manual_seed(2)
    x = torch.randn(2, 8, 3, 3, dtype=torch.float64)
    full = randomize(GroupProxyNorm(8, num_groups=2)).double()
    centred = GroupProxyNorm(8, num_groups=2, proxy_scaling=False).double()
    centred.load_state_dict(full.state_dict())
    mean, var = full.proxy_statistics(torch.float64)
    with torch.no_grad():  # float64 against the composition of torch ops: round-off only
        a = torch.relu(F.group_norm(x, 2, full.weight, full.bias, full.eps))
        torch.testing.assert_close(centred(x), a - mean.view(1, -1, 1, 1), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(full(x), (a - mean.view(1, -1, 1, 1)) / torch.sqrt(var.view(1, -1, 1, 1) + 0.03),
                                   rtol=1e-12, atol=1e-12)

    no_proxy = GroupProxyNorm(8, num_groups=2, proxy_affine=False).double()
    assert set(dict(no_proxy.named_parameters())) == {'weight', 'bias'}
    zeros = GroupProxyNorm(8, num_groups=2).double()
    with torch.no_grad():  # proxy_affine=False is beta~ = gamma~ = 0: the same float64 values
        torch.testing.assert_close(no_proxy(x), zeros(x), rtol=1e-14, atol=1e-14)


def test_layer_norm_case_and_proxy_normalisation_at_init():
    """num_groups=1 is LN+PN; with Gaussian pre-activations the output is ~ standardized (Theorem 3)."""
    torch.manual_seed(3)
    x = torch.randn(8, 32, 32, 32, dtype=torch.float64)
    layer = GroupProxyNorm(32, num_groups=1).double()
    z = F.layer_norm(x, x.shape[1:], eps=layer.eps)
    mean, var = layer.proxy_statistics(torch.float64)
    with torch.no_grad():
        y = layer(x)
    torch.testing.assert_close(y, (torch.relu(z) - mean.view(1, -1, 1, 1)) / torch.sqrt(var.view(1, -1, 1, 1) + 0.03),
                               rtol=1e-12, atol=1e-12)  # float64 against F.layer_norm's composition
    per_channel = y.transpose(0, 1).reshape(32, -1)
    assert per_channel.mean(1).abs().max() < 0.03
    deviation = per_channel.var(1) - 1 / (1 + 0.03 / var)
    assert deviation.abs().max() < 0.08 and deviation.mean().abs() < 0.02


def test_gradcheck_float64():
    torch.manual_seed(4)
    layer = randomize(GroupProxyNorm(4, num_groups=2, act='silu', num_samples=16), seed=5).double()
    x = torch.randn(2, 4, 3, 2, dtype=torch.float64, requires_grad=True)
    params = {k: v.detach().clone().requires_grad_(True) for k, v in layer.named_parameters()}
    keys = sorted(params)

    def f(inp, *ps):
        return torch.func.functional_call(layer, dict(zip(keys, ps)), (inp, ))

    assert torch.autograd.gradcheck(f, (x, *[params[k] for k in keys]))
    relu_layer = randomize(GroupProxyNorm(4, num_groups=1, num_samples=16), seed=6).double()
    assert torch.autograd.gradcheck(lambda inp: relu_layer(inp), (x, ))


def test_train_eval_identical_and_batch_independent():
    torch.manual_seed(5)
    layer = randomize(GroupProxyNorm(8, num_groups=4)).double()
    x = torch.randn(3, 8, 5, 5, dtype=torch.float64)
    with torch.no_grad():
        train_out = layer.train()(x)
        eval_out = layer.eval()(x)
        single = torch.cat([layer(x[i:i + 1]) for i in range(3)])
    torch.testing.assert_close(train_out, eval_out, rtol=0, atol=0)
    torch.testing.assert_close(single, train_out, rtol=1e-12, atol=1e-12)  # float64: round-off only


def test_state_dict_round_trip_and_gn_checkpoint():
    torch.manual_seed(6)
    src = randomize(GroupProxyNorm(8, num_groups=4, act='gelu'))
    dst = GroupProxyNorm(8, num_groups=4, act='gelu')
    dst.load_state_dict(src.state_dict())
    x = torch.randn(2, 8, 3, 3)
    with torch.no_grad():
        torch.testing.assert_close(dst(x), src(x), rtol=0, atol=0)
    gn = nn.GroupNorm(4, 8)
    result = dst.load_state_dict(gn.state_dict(), strict=False)
    assert set(result.missing_keys) == {'proxy_beta', 'proxy_gamma'} and not result.unexpected_keys


def test_fp32_statistics_under_autocast():
    torch.manual_seed(7)
    layer = randomize(GroupProxyNorm(8, num_groups=2))
    x = torch.randn(2, 8, 4, 4)
    with torch.no_grad():
        plain = layer(x)
        with torch.autocast('cpu', dtype=torch.bfloat16):
            auto = layer(x)
            auto_half_in = layer(x.bfloat16())
    assert auto.dtype == torch.float32
    torch.testing.assert_close(auto, plain, rtol=0, atol=0)  # nothing ran in bf16
    assert auto_half_in.dtype == torch.bfloat16
    with torch.no_grad():
        reference = layer(x.bfloat16().float())
        half_layer = randomize(GroupProxyNorm(8, num_groups=2)).half()  # fp16 params, fp32 stats
        half_out = half_layer(x.bfloat16().float().half())
    # statistics and map in float32, one rounding at the end: exactly the float32 result rounded to bf16
    # (a loose tolerance here would hide a stage running in bf16, 8 significant bits)
    assert torch.equal(auto_half_in, reference.bfloat16())
    assert half_out.dtype == torch.float16
    # fp16 parameters: the float32 computation with those (fp16-rounded) parameters, rounded once to fp16
    with torch.no_grad():
        assert torch.equal(half_out, copy.deepcopy(half_layer).float()(x.bfloat16().float()).half())
    # against the float32 parameters too: parameters rounded to fp16 (2^-11 relative) and the output's
    # rounding move the output by a few fp16 ulps (measured <= 6.3e-3 on outputs up to ~10, 0.15 of this bound)
    torch.testing.assert_close(half_out.float(), reference, rtol=4e-3, atol=4e-3)


def test_empty_batch_and_shapes():
    layer = GroupProxyNorm(8, num_groups=4)
    assert layer(torch.randn(0, 8, 7, 7)).shape == (0, 8, 7, 7)  # RoI heads can see zero RoIs
    assert layer(torch.randn(3, 8)).shape == (3, 8)
    with pytest.raises(ValueError, match='expects input'):
        layer(torch.randn(2, 6, 3, 3))


def test_build_norm_layer_eps_names_and_requires_grad():
    name, layer = build_norm_layer(dict(type='GNPN', num_groups=8, requires_grad=False), 32, postfix=2)
    assert name == 'gn2' and isinstance(layer, GroupProxyNorm)
    assert layer.eps == 1e-5 and layer.proxy_eps == 0.03  # GN-stage eps injected by mmcv, PN eps untouched
    assert not any(p.requires_grad for p in layer.parameters())
    _, layer = build_norm_layer(dict(type='GNPN', num_groups=1, eps=1e-3, proxy_eps=0.1, act='gelu'), 16)
    assert (layer.num_groups, layer.eps, layer.proxy_eps, layer.act) == (1, 1e-3, 0.1, 'gelu')


@pytest.mark.parametrize('cfg, match', [
    (dict(type='GNPN', num_groups=5), "GNPN: num_groups=5 does not divide this layer's 32 channels; write num_groups='auto'"),
    (dict(type='GNPN', num_groups=0), 'num_groups'),
    (dict(type='GNPN', num_groups=8, act='relu7'), "unknown activation 'relu7'"),
    (dict(type='GNPN', num_groups=8, act=dict(type='ReLU', negative_slope=0.1)), 'does not accept'),
    (dict(type='GNPN', num_groups=8, num_samples=1), 'num_samples'),
    (dict(type='GNPN', num_groups=8, proxy_eps=-1.0), 'proxy_eps'),
])
def test_build_errors(cfg, match):
    with pytest.raises(ValueError, match=match):
        build_norm_layer(cfg, 32)


