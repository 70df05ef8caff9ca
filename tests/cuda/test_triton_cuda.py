"""The Triton backend on a GPU against the ATen backend, at FPN shapes (issue 27).

For BCN (estimate, batch), GN+PN (relu, gelu) and Unitization (batch, estimate) at the FPN levels P3-P7 of
two 800x1216 images in fp32, fp16 and bf16 (P2, 2x256x200x304, in bf16 only, to keep the time), three
training steps of the same layer built with ``backend='triton'``, with ``backend='aten'`` and, as the truth,
with ``backend='aten'`` in float64: after each step the output, the input gradient, the parameter gradients
and the buffers (running statistics / estimates).

Tolerance, per quantity, relative to its scale (max |float64 value|): Triton's deviation from float64 is at
most twice ATen's own plus ``tol``: 1e-4 for float32 quantities (fp32 inputs; buffers and parameter
gradients, float32 for every input dtype) and the dtype's epsilon for fp16/bf16 outputs and input gradients.
Half inputs come with float32 parameters, as under autocast.

Inputs are drawn off the activation's kinks (:func:`off_kinks`): where the float64 pre-activation of an element
lies within float32's rounding of a kink of relu, a float32 path may take either side (a subgradient choice:
both are right), and that one element then moves the input gradient by a tenth of its scale. The first GPU run's
"GN+PN relu P3 fp16" failure had this signature; on the CPU the generator's seed 8 gives such an element
(|z| = 3e-10), where ATen's CPU path takes the other side.

The GPU test is marked ``cuda``: reported as "needs CUDA: not run" without a GPU (nothing from triton is
imported at collection, so the file collects everywhere). Run it with ``TRITON_INTERPRET`` unset: the kernels
must be compiled for the GPU. The comparison itself runs on the CPU in every suite, with the ATen layer in
both roles (and a perturbed one, which it must reject).
"""
import copy

import pytest
import torch
import torch.nn.functional as F

from normdense.layers.bcn import BatchChannelNorm2d
from normdense.layers.proxy_norm import GroupProxyNorm
from normdense.layers.unitization import Unitization2d

LEVELS = {'P2': (2, 256, 200, 304), 'P3': (2, 256, 100, 152), 'P4': (2, 256, 50, 76), 'P5': (2, 256, 25, 38),
          'P6': (2, 256, 13, 19), 'P7': (2, 256, 7, 10),
          'N256': (256, 256, 7, 7)}  # a classification batch: the VJPs' sample blocks and dx's second stage
DTYPES = {'fp32': torch.float32, 'fp16': torch.float16, 'bf16': torch.bfloat16}
LAYERS = {
    'BCN-estimate': lambda backend: BatchChannelNorm2d(256, 32, mode='estimate', update_rate=0.1, backend=backend),
    'BCN-batch': lambda backend: BatchChannelNorm2d(256, 32, mode='batch', backend=backend),
    'GNPN-relu': lambda backend: GroupProxyNorm(256, 32, act='relu', backend=backend),
    'GNPN-gelu': lambda backend: GroupProxyNorm(256, 32, act='gelu', backend=backend),
    'Unitization-batch': lambda backend: Unitization2d(256, backend=backend),
    'Unitization-estimate': lambda backend: Unitization2d(256, mode='estimate', update_rate=0.1, backend=backend),
}
SETTINGS = [pytest.param(level, dname, id=f'{level}-{dname}') for level in LEVELS for dname in DTYPES
            if level != 'P2' or dname == 'bf16']
STEPS = 3
FP32_TOL = 1e-4


def _build(factory, device):
    """(triton, aten, float64 aten) copies of one layer with the same, non-trivial parameters."""
    torch.manual_seed(0)
    base = factory('aten')
    with torch.no_grad():
        for p in base.parameters():
            p.add_(torch.empty_like(p).uniform_(-0.3, 0.3))
    triton = factory('triton')
    triton.load_state_dict(base.state_dict())
    return (triton.to(device).train(), copy.deepcopy(base).to(device).train(),
            copy.deepcopy(base).double().to(device).train())


def _step(module, x, dy):
    x = x.detach().requires_grad_(True)
    module.zero_grad(set_to_none=True)
    out = module(x)
    out.backward(dy)
    grads = {f'grad of {n}': p.grad for n, p in module.named_parameters()}
    buffers = {f'buffer {n}': b.clone() for n, b in module.named_buffers() if b.is_floating_point()}
    return dict(output=out.detach(), **{'input gradient': x.grad}, **grads, **buffers)


def _tolerance(t):
    return FP32_TOL if t.dtype in (torch.float32, torch.float64) else torch.finfo(t.dtype).eps


def _check(got, aten, ref, what):
    assert set(got) == set(aten) == set(ref), (sorted(got), sorted(ref))
    for key in ref:
        r = ref[key].double()
        scale = float(r.abs().max().clamp_min(1e-30))
        assert got[key].dtype == aten[key].dtype, f'{what} {key}: {got[key].dtype} vs {aten[key].dtype}'
        assert torch.isfinite(got[key]).all(), f'{what} {key}: not finite'
        err_triton = float((got[key].double() - r).abs().max()) / scale
        err_aten = float((aten[key].double() - r).abs().max()) / scale
        bound = 2 * err_aten + _tolerance(got[key])
        assert err_triton <= bound, (f'{what} {key}: Triton {err_triton:.2e} from float64, ATen {err_aten:.2e} '
                                     f'(bound {bound:.2e})')


KINKS = {'relu': (0.0, ), 'relu6': (0.0, 6.0), 'leaky_relu': (0.0, ), 'hardswish': (-3.0, 3.0)}
KINK_BAND = 1e-4  # |z - kink| within which a float32 evaluation may take either side (z is O(1); fp32 ~1e-7)


@torch.no_grad()
def pre_activation(ref, x):
    """The float64 pre-activation z = GN(x) of GN+PN layer ``ref`` (Eq. 7's argument of phi)."""
    return F.group_norm(x.double(), ref.num_groups, ref.weight.double(), ref.bias.double(), ref.eps)


@torch.no_grad()
def near_kinks(ref, x):
    """(mask of the elements whose float64 pre-activation z = GN(x) of GN+PN layer ``ref`` lies within
    KINK_BAND of a kink of its activation, +-1: the side of it they lie on, dz/dx), or None without kinks."""
    kinks = KINKS.get(getattr(ref, 'act', None), ())
    if not kinks:
        return None
    xd = x.double()
    z = pre_activation(ref, x)
    n, c = x.shape[:2]
    g = xd.reshape(n, ref.num_groups, -1)
    rstd = torch.rsqrt(g.var(-1, unbiased=False) + ref.eps).repeat_interleave(c // ref.num_groups, 1)
    slope = (rstd * ref.weight.double()).view(n, c, *(1, ) * (x.dim() - 2)).expand_as(z)
    near, side = torch.zeros_like(z, dtype=torch.bool), torch.ones_like(z)
    for k in kinks:
        hit = (z - k).abs() < KINK_BAND
        near |= hit
        side = torch.where(hit & (z < k), -1.0, side)
    return near, side, slope


def off_kinks(ref, x, tries=8):
    """``x`` with each element near a kink (:func:`near_kinks`) moved away from it along z, by at least one ulp of
    x's dtype; the rest unchanged (the group statistics move by ~1e-7: checked again until none is near)."""
    for _ in range(tries):
        found = near_kinks(ref, x)
        if found is None or not found[0].any():
            return x
        near, side, slope = found
        step = torch.maximum(3 * KINK_BAND / slope.abs(), x.double().abs() * torch.finfo(x.dtype).eps * 2 + 1e-30)
        moved = (x.double() + side * slope.sign() * step).to(x.dtype)
        x = torch.where(near, moved, x)
    raise AssertionError(f'inputs still near a kink after {tries} moves')


def compare(factory, shape, dtype, device, selected_backend=None, what='', seed=1, steps=STEPS):
    """Training steps of ``factory('triton')`` against ``factory('aten')`` and its float64 copy."""
    triton, aten, ref = _build(factory, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    for step in range(steps):
        x = (torch.randn(shape, generator=gen, device=device) * 2 + 0.5).to(dtype)
        dy = torch.randn(shape, generator=gen, device=device).to(dtype)
        x = off_kinks(ref, x)
        if step == 0 and selected_backend is not None:  # the rows compare what they are named after
            assert selected_backend(triton, x) == 'triton' and selected_backend(aten, x) == 'aten'
        _check(_step(triton, x, dy), _step(aten, x, dy), _step(ref, x.double(), dy.double()), f'{what} step {step}')


@pytest.mark.cuda
@pytest.mark.parametrize('level,dname', SETTINGS)
@pytest.mark.parametrize('name', list(LAYERS))
def test_triton_matches_aten_on_cuda(name, level, dname):
    from normdense.kernels.backend import selected_backend
    compare(LAYERS[name], LEVELS[level], DTYPES[dname], 'cuda', selected_backend, f'{name} {level} {dname}')


def _aten_only(make, bias_shift=0.0):
    """A factory of the layer ``make()`` (its default backend: ATen on CPU tensors) for both roles; the
    'triton' one with its output shifted by ``bias_shift``."""
    def factory(backend):
        module = make()
        if backend == 'triton' and bias_shift:
            module.register_forward_hook(lambda m, i, o: o + bias_shift)
        return module
    return factory


@pytest.mark.parametrize('dname', ['fp32', 'bf16'])
def test_comparison_accepts_equal_paths_and_rejects_a_deviation_cpu(dname):
    make = lambda: GroupProxyNorm(256, 32, act='gelu')  # noqa: E731
    compare(_aten_only(make), LEVELS['P7'], DTYPES[dname], 'cpu', what='same path')
    make = lambda: BatchChannelNorm2d(256, 32, mode='estimate', update_rate=0.1)  # noqa: E731
    compare(_aten_only(make), LEVELS['P7'], DTYPES[dname], 'cpu', what='same path')
    shift = 1e-3 if dname == 'fp32' else 0.1  # above fp32's 1e-4, above bf16's eps (2**-7) of the scale
    with pytest.raises(AssertionError, match='output: Triton'):
        compare(_aten_only(make, shift), LEVELS['P7'], DTYPES[dname], 'cpu', what='shifted')


class _Float64Path(GroupProxyNorm):
    """GN+PN computed in float64, its result rounded to x's dtype: a path that takes float64's side of a kink."""

    def forward(self, x):
        return super().forward(x.double()).to(x.dtype)


def test_comparison_moves_inputs_off_relu_kinks_cpu():
    """Issue 52: seed 8's second step holds an element with |z| = 3e-10, where ATen's CPU path takes the other side
    of relu's kink than float64 (1.1e-1 of the input gradient's scale): the comparison draws its inputs off the
    kinks, so ATen (in the 'triton' role) passes against a path that rounds only its result."""
    make = lambda backend: (GroupProxyNorm if backend == 'triton' else _Float64Path)(256, 32, act='relu')  # noqa
    shape = LEVELS['P3']
    gen = torch.Generator().manual_seed(8)
    for _ in range(2):  # the precondition: the raw data of step 1 hold such an element (else this tests nothing)
        x = (torch.randn(shape, generator=gen) * 2 + 0.5).to(torch.float16)
        torch.randn(shape, generator=gen)
    ref = make('aten').double()
    assert int(near_kinks(ref, x)[0].sum()) > 0 and not near_kinks(ref, off_kinks(ref, x))[0].any()
    moved = off_kinks(ref, x) != x
    assert 0 < int(moved.sum()) < 2000 and float((off_kinks(ref, x) - x)[moved].abs().max()) < 0.02
    compare(make, shape, torch.float16, 'cpu', what='kinks', seed=8, steps=2)
    assert near_kinks(GroupProxyNorm(256, 32, act='gelu'), x) is None  # gelu has no kink: its data are as drawn
