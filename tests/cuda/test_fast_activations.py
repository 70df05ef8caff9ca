"""The compiled forms of normdense.kernels.activations (``FAST`` on: libdevice expm1/log1p/tanh, the
one-exp-one-division forms of mish, tanh' and gelu-tanh') on a GPU against float64 torch, for every activation:
phi through its torch function, phi' through the ATen backward op autograd uses, on the kink values of
tests/kernels/test_activations.py (the phi' conventions of the module docstring), on a dense grid and on
log-spaced magnitudes of both signs, past where exp overflows. Tolerance, the module docstring's: float32 within
rtol 1e-6 and atol 1e-6, float64 within rtol 1e-12 and atol 1e-13.

Marked ``cuda``: reported as "needs CUDA: not run" without a GPU (triton is imported inside the test, so the
file collects everywhere). Run it with ``TRITON_INTERPRET`` unset: the kernels must be compiled."""
import pytest
import torch

pytestmark = pytest.mark.cuda

TOL = {torch.float32: dict(rtol=1e-6, atol=1e-6), torch.float64: dict(rtol=1e-12, atol=1e-13)}


def _grid(kwargs, dtype):
    from tests.kernels.test_activations import _values
    huge = 750.0 if dtype == torch.float64 else 100.0  # exp(huge) overflows (mish's clamp)
    mags = torch.logspace(-30, 3, 3301, dtype=torch.float64).clamp_max(huge)
    z = torch.cat([_values(kwargs, torch.float64, 'cpu'), torch.linspace(-30, 30, 120001, dtype=torch.float64),
                   mags, -mags])
    return z.to(dtype).cuda()


@pytest.mark.parametrize('dtype', [torch.float32, torch.float64], ids=['fp32', 'fp64'])
def test_compiled_activations_equal_torch_on_cuda(dtype):
    import triton

    from normdense.kernels import activations as K
    from normdense.layers._activations import _BACKWARD, PROXY_NORM_ACTIVATIONS
    from tests.kernels.test_activations import CASES, _apply
    assert K.FAST, 'TRITON_INTERPRET is set: the kernels would run the portable forms'
    failures = []
    for name, kwargs in CASES:
        z = _grid(kwargs, dtype)
        f, d = torch.full_like(z, float('nan')), torch.full_like(z, float('nan'))
        act, p0, p1 = K.act_args(name, kwargs)
        _apply[(triton.cdiv(z.numel(), 256), )](z, f, d, z.numel(), act, p0, p1, 256)
        z64 = z.double().cpu()  # the reference on the CPU: ATen's CUDA hardswish multiplies by a float 1/6
        f, d = f.cpu(), d.cpu()
        ref = PROXY_NORM_ACTIVATIONS[name][0](z64, **kwargs)
        dref = _BACKWARD[name](torch.ones_like(z64), z64, ref, kwargs)
        for what, got, want in (('phi', f, ref), ("phi'", d, dref)):
            try:
                torch.testing.assert_close(got.double(), want, **TOL[dtype])
            except AssertionError as e:
                worst = int(((got.double() - want).abs() / (want.abs() * TOL[dtype]['rtol'] + TOL[dtype]['atol']))
                            .nan_to_num(float('inf')).argmax())
                failures.append(f'{name} {kwargs} {what}: at z = {float(z64[worst])!r} got {float(got[worst])!r}, '
                                f'float64 {float(want[worst])!r}; {str(e).splitlines()[2:4]}')
    assert not failures, '\n'.join(failures)
