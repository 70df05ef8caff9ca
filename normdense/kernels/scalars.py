"""Float arithmetic the kernels share.

Float arguments: Triton passes a Python float as float32, too coarse for float64 inputs (a momentum of 0.1 is
off by 1.5e-9), so a value travels as two float32 numbers whose sum, formed in the kernel's compute dtype, is
the value to ~2^-48 relative. 1 / sqrt: correctly rounded in float64 (``tl.rsqrt`` is ``rsqrt.approx.f64`` on
sm_90), the fast ``tl.rsqrt`` in float32."""
import struct

import triton
import triton.language as tl


def _f32(value: float) -> float:
    return struct.unpack('f', struct.pack('f', value))[0]  # on the host: no tensor, no operator


def hi_lo(value: float):
    """``value`` as the float32 pair (hi, lo) for :func:`from_hi_lo`."""
    hi = _f32(value)
    return hi, _f32(value - hi)


@triton.jit
def from_hi_lo(hi, lo, dt: tl.constexpr):
    return tl.cast(hi, dt) + tl.cast(lo, dt)  # floats reach the interpreter as Python floats: no .to()


@triton.jit
def rsqrt(x):
    """1 / sqrt(x): sqrt.rn.f64 and div.rn.f64 in float64 (exact as torch's), the fast tl.rsqrt in float32
    (within the float32 tolerance)."""
    if x.dtype == tl.float64:
        out = 1.0 / tl.sqrt(x)
    else:
        out = tl.rsqrt(x)
    return out
