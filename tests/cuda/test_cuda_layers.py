"""Every layer and mode on the accelerator (issue: normdense on CUDA).

Each test runs on ``device='cuda'`` (marked ``cuda``: reported as skipped where no GPU is available,
see tests/conftest.py) and, in a quick form, on ``device='cpu'``, so the test logic itself runs in every
CPU suite:

* forward/backward (outputs, input and parameter gradients, running statistics, eval output) in
  float32 on the device against the same layer in float64 on the CPU;
* mixed-precision training with mmengine's ``AmpOptimWrapper`` (GradScaler; fp16 and bf16 on CUDA,
  100 steps, the issue's target) or CPU bf16 autocast (4 steps): finite losses, parameters and
  statistics, statistics buffers in float32;
* ``deploy.fuse`` on the device against the unfused eval model.

TF32 is switched off (and restored after) by the ``device`` fixture: these compare formulas at float32
round-off (``FORWARD_TOL``, ``GRAD_TOL``), and TF32 convolutions and matmuls round to ~1e-3.
"""
import contextlib
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from normdense.deploy.fuse import fuse
from normdense.layers.proxy_norm import GroupProxyNorm
from tests.cuda.layer_cases import C, CASES, case_params, fuse_model

DEVICES = [pytest.param('cpu', id='cpu'), pytest.param('cuda', id='cuda', marks=pytest.mark.cuda)]


@pytest.fixture(params=DEVICES)
def device(request, monkeypatch):
    if request.param == 'cuda':
        monkeypatch.setattr(torch.backends.cudnn, 'allow_tf32', False)
        monkeypatch.setattr(torch.backends.cuda.matmul, 'allow_tf32', False)
    return request.param


def _step(module, x):
    x = x.detach().requires_grad_(True)
    out = module(x)
    weight = torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view(out.shape)
    (out * weight.to(out)).sum().backward()
    return out.detach(), x.grad


# float32 against float64, relative to the quantity's scale (max |expected|): an element's round-off is
# bounded by the magnitudes it is computed from, not by its own value, which can cancel to ~0.
# Forward quantities (outputs, running statistics, eval outputs, IterNorm's T = 5 Newton steps and ZCA's
# eigh included): measured <= 6e-7 on the CPU (8 float32 ulps), bound 1e-5.
FORWARD_TOL = 1e-5
# Gradients: batch-wide sums of products with cancellation; BCN's batch-mode backward (BatchNorm's
# dx = (dy - mean(dy) - x_hat mean(dy x_hat)) / sigma, its gamma gradient over N*H*W*C/G terms) measured
# 1.5e-5 on the CPU, the other layers <= 7e-6; bound 1e-4 (a different reduction order on the GPU).
GRAD_TOL = 1e-4


def _close(actual, expected, what, tol=FORWARD_TOL):
    expected = expected.detach().double()
    torch.testing.assert_close(actual.detach().double().cpu(), expected, rtol=tol,
                               atol=tol * float(expected.abs().max().clamp_min(1e-30)),
                               msg=lambda m: f'{what}: {m}')


@pytest.mark.parametrize('case', case_params())
def test_float32_on_device_matches_float64_cpu(case, device):
    ref = case.build().double()
    mod = copy.deepcopy(ref).float().to(device)
    assert all(t.device.type == device for t in list(mod.parameters()) + list(mod.buffers()))
    for seed in (1, 2):  # two steps: estimates / running statistics move between them
        out_ref, gx_ref = _step(ref.train(), case.input(dtype=torch.float64, seed=seed))
        out, gx = _step(mod.train(), case.input(device, seed=seed))
        assert out.device.type == device and out.dtype == torch.float32
        _close(out, out_ref, f'{case.name} output (step {seed})')
        _close(gx, gx_ref, f'{case.name} input gradient (step {seed})', GRAD_TOL)
    for (name, p), p_ref in zip(mod.named_parameters(), ref.parameters()):
        _close(p.grad, p_ref.grad, f'{case.name} gradient of {name}', GRAD_TOL)
    for (name, b), b_ref in zip(mod.named_buffers(), ref.buffers()):
        _close(b, b_ref, f'{case.name} buffer {name}')
    with torch.no_grad():
        _close(mod.eval()(case.input(device, seed=3)), ref.eval()(case.input(dtype=torch.float64, seed=3)),
               f'{case.name} eval output')


def _amp_model(case):
    """conv -> layer -> (ReLU) -> pool -> linear; a ReLU in front of EquiConv2d (non-negative inputs), none
    after GNPN (it contains its activation)."""
    torch.manual_seed(0)
    layer = case.build()
    pre = [nn.ReLU()] if case.non_negative else []
    post = [] if isinstance(layer, GroupProxyNorm) else [nn.ReLU()]
    return nn.Sequential(nn.Conv2d(8, C, 3, padding=1), *pre, layer, *post, nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(C, 4))


AMP = [pytest.param('cpu', torch.bfloat16, 4, id='cpu-bf16-4steps'),
       pytest.param('cuda', torch.float16, 100, id='cuda-fp16-100steps', marks=pytest.mark.cuda),
       pytest.param('cuda', torch.bfloat16, 100, id='cuda-bf16-100steps', marks=pytest.mark.cuda)]


@pytest.mark.mmengine
@pytest.mark.parametrize('device,dtype,steps', AMP)
@pytest.mark.parametrize('case', case_params())
def test_mixed_precision_training_stays_finite(case, device, dtype, steps):
    from mmengine.optim import AmpOptimWrapper, OptimWrapper
    model = _amp_model(case).to(device)
    layer = model[2] if case.non_negative else model[1]
    initial = {n: b.clone() for n, b in layer.named_buffers() if b.is_floating_point()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if device == 'cuda':  # GradScaler (dynamic loss scale) and autocast, as mmengine's Runner uses them
        wrapper, autocast = AmpOptimWrapper(optimizer=optimizer, dtype=dtype), None
    else:  # AmpOptimWrapper needs an accelerator; the same loop with CPU autocast
        wrapper, autocast = OptimWrapper(optimizer=optimizer), torch.autocast('cpu', dtype=dtype)
    g = torch.Generator().manual_seed(0)
    seen_dtypes = set()
    hook = layer.register_forward_hook(lambda m, i, o: seen_dtypes.add((i[0].dtype, o.dtype)))
    for it in range(steps):
        x = (torch.randn(2, 8, 12, 10, generator=g) * 3 + 1).to(device)
        target = torch.randint(0, 4, (2, ), generator=g).to(device)
        with wrapper.optim_context(model), autocast or contextlib.nullcontext():
            loss = F.cross_entropy(model(x).float(), target)
        assert torch.isfinite(loss), f'{case.name}: loss {loss} at step {it}'
        wrapper.update_params(loss)
    hook.remove()
    # the layer really got half-precision activations (the conv in front of it ran under autocast)
    assert {i for i, _ in seen_dtypes} == {dtype}, f'{case.name}: layer inputs were {seen_dtypes}'
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        assert torch.isfinite(t).all(), f'{case.name}: {name} not finite after {steps} {dtype} steps'
    for name, b in layer.named_buffers():
        if b.is_floating_point():
            assert b.dtype == torch.float32, f'{case.name}: statistics buffer {name} is {b.dtype}'
            assert not torch.equal(b, initial[name]), f'{case.name}: statistics buffer {name} never moved'
    if device == 'cuda' and dtype == torch.float16:
        assert wrapper.loss_scaler.get_scale() >= 1.0, 'GradScaler kept skipping steps (inf/NaN gradients)'


def _trained_fuse_model(device):
    model = fuse_model().to(device)
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(3):
        x = torch.randn(2, 16, 9, 9, generator=g).relu().to(device)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    return model.eval()


def test_fuse_on_device_matches_unfused(device):
    model = _trained_fuse_model(device)
    x = torch.randn(3, 16, 11, 9, generator=torch.Generator().manual_seed(5)).relu().to(device)
    with torch.no_grad():
        expected = model(x)
        stats = {}
        fused = fuse(copy.deepcopy(model), stats=stats)
        out = fused(x)
    assert stats['folded'] >= 5 and stats['standalone'] >= 2, stats
    assert {t.device.type for t in fused.state_dict().values()} == {device}
    assert out.device.type == device
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
