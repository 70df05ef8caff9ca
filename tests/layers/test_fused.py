"""The StatNorm engine of BCN, GN+PN and Unitization (normdense/layers/_statnorm.py on the ATen backend, the
default) against the reference composition of each layer (``fused=False``): outputs, input and parameter
gradients and buffers over several training steps in float64, gradcheck, half precision, shared layers, empty
and 1x1 inputs, saved memory, and the removed options (``recompute``, ``compiled``)."""
import contextlib
import copy
import functools

import pytest
import torch
import torch.nn as nn

from benchmarks._timing import saved_activation_bytes as saved_bytes
from normdense.layers import set_fused
from normdense.layers.bcn import BatchChannelNorm2d
from normdense.layers.proxy_norm import GroupProxyNorm
from normdense.layers.unitization import Unitization2d

C = 8
CASES = {
    'bcn-estimate': functools.partial(BatchChannelNorm2d, C, 4, mode='estimate', update_rate=0.3),
    'bcn-estimate-channel-affine': functools.partial(BatchChannelNorm2d, C, 2, update_rate=0.3, group_affine=False),
    'bcn-batch': functools.partial(BatchChannelNorm2d, C, 4, mode='batch'),
    'bcn-batch-channel-affine': functools.partial(BatchChannelNorm2d, C, 4, mode='batch', group_affine=False),
    'gnpn-relu': functools.partial(GroupProxyNorm, C, 4),
    'gnpn-relu-no-scaling': functools.partial(GroupProxyNorm, C, 4, proxy_scaling=False),
    'gnpn-gelu': functools.partial(GroupProxyNorm, C, 2, act='gelu'),
    'gnpn-leaky-no-scaling': functools.partial(GroupProxyNorm, C, 4, act=dict(type='LeakyReLU', negative_slope=0.1),
                                               proxy_scaling=False),
    'lnpn-silu-no-proxy-affine': functools.partial(GroupProxyNorm, C, 1, act='silu', proxy_affine=False),
    'unitization-batch': functools.partial(Unitization2d, C),
    'unitization-batch-cumulative': functools.partial(Unitization2d, C, momentum=None, affine=False),
    'unitization-estimate': functools.partial(Unitization2d, C, mode='estimate', update_rate=0.3),
    'unitization-keras': functools.partial(Unitization2d, C, norm_divisor='hw_squared', var_correction='keras'),
    'unitization-fixed-n': functools.partial(Unitization2d, C, n=7.0),
}
ESTIMATE = {k for k in CASES if 'estimate' in k}


def randomized(layer):
    """``layer`` with its parameters moved by a random 0.3 sigma and statistics away from their initial values
    (the global RNG, seeded by the caller)."""
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.3)
        if hasattr(layer, 'running_mean'):
            c = layer.running_mean.numel()
            layer.running_mean.copy_(torch.linspace(-1, 1, c))
            layer.running_var.copy_(torch.linspace(0.5, 2, c))
    return layer


def make(name, dtype=torch.float64, seed=0):
    """A layer of ``name`` (training mode) with random parameters and statistics, and its reference copy."""
    torch.manual_seed(seed)
    layer = randomized(CASES[name]().to(dtype).train())
    assert layer.fused
    ref = copy.deepcopy(layer)
    ref.fused = False
    return layer, ref


def run(layer, xs, seed=1, ctx=contextlib.nullcontext):
    """Forward every input (one graph: a shared layer), one backward of a random linear loss."""
    xs = [x.detach().clone().requires_grad_(True) for x in xs]
    with ctx():
        outs = [layer(x) for x in xs]
    g = torch.Generator().manual_seed(seed)
    sum((o.double() * torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.device)).sum() for o in outs).backward()
    return dict(outs=[o.detach() for o in outs], xgrads=[x.grad for x in xs],
                pgrads={n: p.grad.clone() for n, p in layer.named_parameters()},
                buffers={n: b.clone() for n, b in layer.named_buffers()})


def assert_same(a, b, rtol=1e-10, atol=1e-10):
    for key in ('outs', 'xgrads'):
        for u, v in zip(a[key], b[key]):
            torch.testing.assert_close(u, v, rtol=rtol, atol=atol, msg=key)
    for key in ('pgrads', 'buffers'):
        assert a[key].keys() == b[key].keys()
        for n in a[key]:
            torch.testing.assert_close(a[key][n], b[key][n], rtol=rtol, atol=atol, msg=f'{key} {n}')


@pytest.mark.parametrize('name', sorted(CASES))
def test_fused_equals_reference_over_training_steps(name):
    """Three training steps (the statistics move between them) and an eval forward, float64."""
    fused, ref = make(name)
    for step in range(3):
        torch.manual_seed(10 + step)
        xs = [torch.randn(3, C, 5, 6, dtype=torch.float64) * 2 + 1]
        assert_same(run(fused, xs), run(ref, xs))
        for m in (fused, ref):  # a parameter update between steps
            with torch.no_grad():
                for p in m.parameters():
                    p.sub_(0.1 * p.grad)
                    p.grad = None
    fused.eval(), ref.eval()
    x = torch.randn(2, C, 4, 4, dtype=torch.float64) - 0.5
    assert_same(run(fused, [x]), run(ref, [x]))
    with torch.no_grad():
        torch.testing.assert_close(fused(x), ref(x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize('name', sorted(CASES))
def test_fused_gradcheck_float64(name):
    fused, _ = make(name)
    if name in ESTIMATE:
        fused.update_rate = 0.0  # estimates that move with every call make finite differences meaningless
    params = dict(fused.named_parameters())
    x = torch.randn(2, C, 3, 3, dtype=torch.float64, requires_grad=True)

    def f(inp, *ps):
        return torch.func.functional_call(fused, dict(zip(params, ps)), (inp, ))

    assert torch.autograd.gradcheck(f, (x, *params.values()))


@pytest.mark.parametrize('name', sorted(CASES))
def test_shared_layer_called_twice_before_backward(name):
    """A head shared across FPN levels: two forwards (the estimates move in between), one backward."""
    fused, ref = make(name)
    xs = [torch.randn(2, C, 5, 6, dtype=torch.float64) * 2 + 1, torch.randn(1, C, 3, 4, dtype=torch.float64) - 1]
    assert_same(run(fused, xs), run(ref, xs))


@pytest.mark.parametrize('name', sorted(CASES))
def test_2d_and_1x1_inputs(name):
    """(N, C) inputs where the layer takes them, and batch 1 on a 1x1 map where its statistics allow it."""
    fused, ref = make(name)
    shapes = [(1, C, 1, 1)] if name in ESTIMATE or name.startswith('gnpn') else [(2, C, 1, 1)]
    if not name.startswith('bcn'):
        shapes.append((4, C))
    for shape in shapes:
        x = torch.randn(*shape, dtype=torch.float64)
        assert_same(run(fused, [x]), run(ref, [x]))


@pytest.mark.parametrize('name', sorted(CASES))
def test_inputs_untouched_and_output_modifiable_in_place(name):
    """The fused path writes into its own buffers only: x and the incoming gradient are left as they were,
    and its output can be modified in place by the next layer (ReLU(inplace=True): not a view made inside
    the autograd Function)."""
    fused, ref = make(name)
    x = torch.randn(2, C, 5, 6, dtype=torch.float64) * 2 + 1
    dy = torch.randn(2, C, 5, 6, dtype=torch.float64)
    results = []
    for layer in (fused, ref):
        xi, dyi = x.clone().requires_grad_(True), dy.clone()
        layer(xi).backward(dyi)  # the Function's backward gets (a view of) dyi itself
        assert torch.equal(xi.detach(), x) and torch.equal(dyi, dy)
        xi.grad = None
        y = layer(xi)
        torch.relu_(y).backward(dyi)
        results.append((y.detach(), xi.grad))
    for u, v in zip(*results):
        torch.testing.assert_close(u, v, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize('name', sorted(CASES))
def test_empty_input_as_reference(name):
    fused, ref = make(name)
    x = torch.zeros(0, C, 7, 7, dtype=torch.float64)
    a, b = run(fused, [x]), run(ref, [x])
    assert a['outs'][0].shape == x.shape
    assert_same(a, b)


@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16])
@pytest.mark.parametrize('name', sorted(CASES))
def test_half_inputs_within_reference_error(name, dtype):
    """Half inputs (model.half()/bfloat16()): finite, and no further from the float64 result than the
    reference path in the same precision (up to one rounding of the output)."""
    exact, _ = make(name)
    fused, ref = make(name, dtype=dtype)
    x = torch.randn(2, C, 6, 6, dtype=torch.float64) * 2 + 1
    truth = run(exact, [x])['outs'][0]
    a = run(fused, [x.to(dtype)])
    assert all(torch.isfinite(t).all() for t in a['outs'] + a['xgrads'] + list(a['pgrads'].values()))
    err_fused = (a['outs'][0].double() - truth).abs().max()
    scale = torch.finfo(dtype).eps * truth.abs().max()
    try:
        b = run(ref, [x.to(dtype)])
    except RuntimeError as e:  # torch < 2.2: no fp16 GroupNorm kernel on the CPU (the reference's F.group_norm)
        if 'Half' not in str(e) or dtype != torch.float16:
            raise
        assert err_fused <= 8 * scale, err_fused  # the fused path computes in float32: a few output roundings
        return
    assert all(torch.isfinite(t).all() for t in b['outs'] + b['xgrads'] + list(b['pgrads'].values()))
    err_ref = (b['outs'][0].double() - truth).abs().max()
    assert err_fused <= err_ref + scale, (err_fused, err_ref)


@pytest.mark.parametrize('name', sorted(CASES))
def test_bf16_autocast_within_reference_error(name):
    exact, _ = make(name)
    fused, ref = make(name, dtype=torch.float32)
    x = torch.randn(2, C, 6, 6, dtype=torch.float64) * 2 + 1
    truth = run(exact, [x])['outs'][0]
    ctx = functools.partial(torch.autocast, 'cpu', dtype=torch.bfloat16)
    a, b = run(fused, [x.bfloat16()], ctx=ctx), run(ref, [x.bfloat16()], ctx=ctx)
    assert a['outs'][0].dtype == b['outs'][0].dtype
    assert all(torch.isfinite(t).all() for t in a['outs'] + a['xgrads'] + list(a['pgrads'].values()))
    err_fused = (a['outs'][0].double() - truth).abs().max()
    err_ref = (b['outs'][0].double() - truth).abs().max()
    assert err_fused <= err_ref + torch.finfo(torch.bfloat16).eps * truth.abs().max(), (err_fused, err_ref)


@pytest.mark.parametrize('name', sorted(CASES))
def test_fused_saves_one_group_norm_of_memory(name):
    """Only the input (and channel-sized statistics) is kept for backward: at most 1.05x the bytes an
    nn.GroupNorm saves on the same input."""
    fused, ref = make(name, dtype=torch.float32)
    x = torch.randn(2, C, 16, 16, requires_grad=True)
    gn = nn.GroupNorm(4, C)
    gn_bytes = saved_bytes(lambda: gn(x), list(gn.parameters()))
    assert saved_bytes(lambda: fused(x), list(fused.parameters())) <= 1.05 * gn_bytes
    if name != 'unitization-estimate':  # the reference keeps 2-3x (estimate-mode Unitization 1x already)
        assert saved_bytes(lambda: ref(x), list(ref.parameters())) > 1.5 * gn_bytes  # the check can fail


@pytest.mark.parametrize('name', sorted(CASES))
def test_double_backward_equals_the_reference(name):
    """A second differentiation through the engine's backward (tests/layers/test_nn_contracts.py: gradient penalties,
    gradgradcheck, both backends)."""
    out = []
    for layer in make(name):
        x = torch.randn(2, C, 3, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1),
                        requires_grad=True)
        (gx, ) = torch.autograd.grad(layer(x).pow(2).sum(), x, create_graph=True)
        gx.pow(2).sum().backward()
        out.append([x.grad] + [p.grad for p in layer.parameters()])
    for a, b in zip(*out):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_frozen_parameters_and_input_without_grad():
    """Only the gradients that are asked for: frozen parameters get none, an input without grad none."""
    fused, ref = make('gnpn-relu')
    for m in (fused, ref):
        m.weight.requires_grad_(False)
    x = torch.randn(2, C, 4, 4, dtype=torch.float64)
    for m in (fused, ref):
        m(x).sum().backward()
    assert fused.weight.grad is None
    torch.testing.assert_close(fused.bias.grad, ref.bias.grad)


@pytest.mark.parametrize('cls', [BatchChannelNorm2d, GroupProxyNorm, Unitization2d])
@pytest.mark.parametrize('option', ['recompute', 'compiled'])
def test_removed_options_are_refused(cls, option):
    """recompute= (the engine keeps only x) and compiled= (torch.compile the model instead) are gone."""
    with pytest.raises(TypeError, match=option):
        cls(C, **{option: True})


def test_set_fused_switches_every_layer():
    model = nn.Sequential(BatchChannelNorm2d(C, 4, update_rate=0.1), GroupProxyNorm(C, 4), Unitization2d(C),
                          nn.GroupNorm(4, C))
    assert set_fused(model, False) == 3 and not any(getattr(m, 'fused', False) for m in model)
    assert 'fused=False' in repr(model[0]) and 'fused=False' in repr(model[1]) and 'fused=False' in repr(model[2])
    assert set_fused(model, True) == 3 and all(m.fused for m in model[:3])


@pytest.mark.parametrize('name', sorted(CASES))
def test_constant_channels_and_groups(name):
    """A channel (and a whole group) constant over positions, e.g. dead ReLUs: zero variance per (n, c)."""
    fused, ref = make(name)
    x = torch.randn(2, C, 4, 4, dtype=torch.float64)
    x[:, :2] = 1.5  # with 4 groups of 2 channels the first group is constant too
    x[1, 5] = -0.25
    a, b = run(fused, [x]), run(ref, [x])
    assert all(torch.isfinite(t).all() for t in a['outs'] + a['xgrads'])
    assert_same(a, b)


@pytest.mark.parametrize('offset, size', [(0.0, 6), (20.0, 6), (20.0, 1), (300.0, 2)])
@pytest.mark.parametrize('name', sorted(CASES))
def test_float32_error_as_reference(name, offset, size):
    """float32 against the float64 result, for inputs whose channel means are large against their spread
    (incl. 1x1 maps, where x - m is exactly 0): the fused path's output, input and parameter gradients
    are as accurate as the reference's. (Forming A x + B - A m instead of A (x - m) + B in backward lost
    2 % of the gradient of batch-mode BCN at 1x1.)"""
    exact, _ = make(name)
    fused, ref = make(name, dtype=torch.float32)
    torch.manual_seed(0)
    x = torch.randn(4, C, size, size, dtype=torch.float64) + offset
    truth, a, b = run(exact, [x]), run(fused, [x.float()]), run(ref, [x.float()])

    def worst(r):
        pairs = [(r['outs'][0], truth['outs'][0]), (r['xgrads'][0], truth['xgrads'][0])]
        pairs += [(r['pgrads'][k], truth['pgrads'][k]) for k in truth['pgrads']]
        return max(((u.double() - v).norm() / (v.norm() + 1e-30)).item() for u, v in pairs)

    assert worst(a) <= 4 * worst(b) + 1e-6, (worst(a), worst(b))
