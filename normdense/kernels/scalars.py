"""Float arguments of the kernels: Triton passes a Python float as float32, too coarse for float64 inputs (a
momentum of 0.1 is off by 1.5e-9), so a value travels as two float32 numbers whose sum, formed in the
kernel's compute dtype, is the value to ~2^-48 relative."""
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
