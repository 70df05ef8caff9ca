"""normdense.kernels.activations against torch: phi through the activation's torch function, phi' through the
ATen backward op autograd uses (``_activations._BACKWARD`` with g = 1), elementwise on values that include the
kinks and large |z|, float64 to ~1e-12 and float32 to ~1e-6."""
import os

import pytest
import torch

triton = pytest.importorskip('triton')
import triton.language as tl  # noqa: E402

from normdense.kernels import activations as K  # noqa: E402
from normdense.layers._activations import _BACKWARD, PROXY_NORM_ACTIVATIONS  # noqa: E402


@triton.jit
def _apply(x_ptr, f_ptr, d_ptr, n, ACT: tl.constexpr, P0: tl.constexpr, P1: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    z = tl.load(x_ptr + i, mask=i < n, other=0.0)
    tl.store(f_ptr + i, K.act_forward(z, ACT, P0, P1), mask=i < n)
    tl.store(d_ptr + i, K.act_grad(z, ACT, P0, P1), mask=i < n)


CASES = [
    ('relu', {}), ('relu6', {}), ('leaky_relu', {'negative_slope': 0.01}), ('leaky_relu', {'negative_slope': 0.2}),
    ('elu', {'alpha': 1.0}), ('elu', {'alpha': 0.3}), ('celu', {'alpha': 1.0}), ('celu', {'alpha': 2.5}),
    ('selu', {}), ('gelu', {'approximate': 'none'}), ('gelu', {'approximate': 'tanh'}), ('silu', {}), ('mish', {}),
    ('softplus', {'beta': 1.0, 'threshold': 20.0}), ('softplus', {'beta': 2.0, 'threshold': 5.0}),
    ('softplus', {'beta': 0.5, 'threshold': 3.0}), ('hardswish', {}), ('sigmoid', {}), ('tanh', {}),
]


def test_the_names_are_those_of_the_layer():
    assert set(K.ACTIVATION_IDS) == set(PROXY_NORM_ACTIVATIONS)
    assert {name for name, _ in CASES} == set(PROXY_NORM_ACTIVATIONS)
    ids = list(K.ACTIVATION_IDS.values()) + [K.GELU_TANH]
    assert len(set(ids)) == len(ids)


def _values(kwargs, dtype, device):
    big = 700.0 if dtype == torch.float64 else 80.0
    kinks = [0.0, -0.0, 6.0, -3.0, 3.0, 1e-8, -1e-8, 1e-3, -1e-3, 0.5, -0.5, 5.999, 6.001, -3.001, 2.999,
             40.0, -40.0, big, -big, 1e-300 if dtype == torch.float64 else 1e-30]
    if 'threshold' in kwargs:
        t = kwargs['threshold'] / kwargs['beta']
        kinks += [t, t * (1 + 1e-6), t * (1 - 1e-6)]
    z = torch.cat([torch.linspace(-12, 12, 193, dtype=torch.float64), torch.tensor(kinks, dtype=torch.float64)])
    return z.to(dtype).to(device)


@pytest.mark.parametrize('dtype', [torch.float64, torch.float32])
@pytest.mark.parametrize('name,kwargs', CASES)
def test_forward_and_derivative_equal_torch(name, kwargs, dtype, device):
    z = _values(kwargs, dtype, device)
    f, d = torch.full_like(z, float('nan')), torch.full_like(z, float('nan'))
    act, p0, p1 = K.act_args(name, kwargs)
    _apply[(triton.cdiv(z.numel(), 64), )](z, f, d, z.numel(), act, p0, p1, 64)
    # the reference in float64 on the same values, on the CPU: torch's own float32 results carry cancellation
    # errors (gelu-tanh's 1 + tanh near -1) of the order of the float32 tolerance, and ATen's CUDA hardswish
    # multiplies by a float 1/6 (3e-8 off in float64)
    z64 = z.double().cpu()
    ref = PROXY_NORM_ACTIVATIONS[name][0](z64, **kwargs)
    dref = _BACKWARD[name](torch.ones_like(z64), z64, ref, kwargs)
    tol = dict(rtol=1e-12, atol=1e-13) if dtype == torch.float64 else dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(f.double().cpu(), ref, **tol)
    torch.testing.assert_close(d.double().cpu(), dref, **tol)


def test_act_args_rejects_unknown_names():
    with pytest.raises(ValueError):
        K.act_args('swish2', {})


@triton.jit
def _fast_forms(x_ptr, a_ptr, b_ptr, n, WHICH: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    z = tl.load(x_ptr + i, mask=i < n, other=0.0)
    if WHICH == 0:
        a, b = K._mish_parts(z)
    elif WHICH == 1:
        a, b = K._sigmoid_and_slope(z)
    else:
        a = K._tanh_derivative(z)
        b = a
    tl.store(a_ptr + i, a.to(z.dtype), mask=i < n)
    tl.store(b_ptr + i, b.to(z.dtype), mask=i < n)


@pytest.mark.parametrize('dtype', [torch.float64, torch.float32])
@pytest.mark.parametrize('which', ['mish', 'sigmoid', 'tanh'])
def test_the_compiled_forms_algebra_equals_torch(which, dtype, device):
    """The exp-and-division forms the compiled path takes (``FAST``) need no libdevice, so they run here too:
    the algebra against float64 torch, past where exp overflows (the clamp), at the same tolerances; the
    outputs free of cancellation (all but mish') to the relative tolerance alone, down to the smallest normal."""
    huge = 750.0 if dtype == torch.float64 else 100.0  # exp(huge) overflows
    z = torch.cat([_values({}, dtype, device), torch.tensor([huge, -huge], dtype=dtype, device=device)])
    a, b = torch.full_like(z, float('nan')), torch.full_like(z, float('nan'))
    _fast_forms[(triton.cdiv(z.numel(), 64), )](z, a, b, z.numel(), ['mish', 'sigmoid', 'tanh'].index(which), 64)
    z64 = z.double()
    if which == 'mish':  # (tanh(softplus z), mish'(z))
        ref = torch.tanh(torch.nn.functional.softplus(z64))
        dref = _BACKWARD['mish'](torch.ones_like(z64), z64, z64 * ref, {})
    elif which == 'sigmoid':  # (sigmoid z, sigmoid(z) sigmoid(-z))
        ref, dref = torch.sigmoid(z64), torch.sigmoid(z64) * torch.sigmoid(-z64)
    else:  # 1 - tanh^2 as 1 / cosh^2: no cancellation in the reference either
        ref = dref = torch.cosh(z64).pow(-2)
    tol = dict(rtol=1e-12, atol=1e-13) if dtype == torch.float64 else dict(rtol=1e-6, atol=1e-6)
    # compiled, float32 tl.exp is ex2.approx of a rounded z log2(e): |z| 2^-24 relative, only the documented
    # tolerance holds there
    relative = dict(rtol=tol['rtol'], atol=torch.finfo(dtype).tiny)
    if (dtype, device) == (torch.float32, 'cuda'):
        relative = tol
    torch.testing.assert_close(a.double(), ref, **relative)
    torch.testing.assert_close(b.double(), dref, **(tol if which == 'mish' else relative))


def test_the_switch_follows_the_interpreter():
    """``FAST`` is triton.jit's own decision: the interpreter runs the portable forms (no libdevice)."""
    interpreted = os.environ.get('TRITON_INTERPRET') == '1'
    assert bool(K.FAST) is not interpreted
    assert isinstance(K.FAST, tl.constexpr)
