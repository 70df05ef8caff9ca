"""The activations phi of GN+PN (``normdense.layers._activations``) as Triton device functions, for the GN+PN
coefficient kernels and the engine's passes.

``act_forward(z, ACT, p0, p1)`` is phi(z) and ``act_grad(z, ACT, p0, p1)`` is phi'(z) for a float32 or float64
tile z, in z's dtype. ``act_args(name, kwargs)`` packs a resolved activation into (ACT, p0, p1). phi' follows the
conventions of the ATen backward op autograd uses for each phi (``_activations._BACKWARD``) at its kinks:
relu 0 at z = 0 (``threshold_backward`` on out > 0), relu6 0 at z = 0 and 6 (``hardtanh_backward`` is strict),
leaky_relu the slope at 0, elu/celu/selu the negative branch at 0 (``elu_backward`` on z <= 0), softplus 1 only
above the threshold, hardswish z / 3 + 1/2 on (-3, 3) (0 at -3, 1 at 3, as ATen's hardswish_backward).

Pass ACT, p0 and p1 as ``tl.constexpr`` kernel arguments: a constexpr Python float enters the arithmetic
exactly, in the tile's dtype, whereas a runtime float argument is float32 on the GPU (while in the interpreter
it stays a Python float, so CPU tests cannot see it) and would round e.g. negative_slope = 0.01 in a float64
computation. Constants multiply tiles from the right (``tile * CONST``): the interpreter does not turn a
constexpr on the left into a tensor op.

Two forms of the transcendental activations, chosen at compile time by the constexpr ``FAST`` (True where
``triton.jit`` compiles, False under ``TRITON_INTERPRET=1``, which cannot run libdevice); no call site changes.
The forms, their operation counts and precision: docs/gpu.md, "Kernel tuning notes".

Nothing here imports ``normdense.layers``; the names are a literal (a test checks them against
``PROXY_NORM_ACTIVATIONS``).
"""
import triton
import triton.language as tl

__all__ = ['ACTIVATION_IDS', 'GELU_TANH', 'act_args', 'act_forward', 'act_grad']

ACTIVATION_IDS = {
    'relu': 0, 'relu6': 1, 'leaky_relu': 2, 'elu': 3, 'celu': 4, 'selu': 5, 'gelu': 6, 'silu': 7, 'mish': 8,
    'softplus': 9, 'hardswish': 10, 'sigmoid': 11, 'tanh': 12,
}
GELU_TANH = 13  # gelu(approximate='tanh'): its own id, so the choice is made at compile time

_SELU_ALPHA = tl.constexpr(1.6732632423543772848170429916717)
_SELU_SCALE = tl.constexpr(1.0507009873554804934193349852946)
_SQRT1_2 = tl.constexpr(0.70710678118654752440084436210485)  # 1 / sqrt(2)
_INV_SQRT_2PI = tl.constexpr(0.39894228040143267793994605993438)  # 1 / sqrt(2 pi)
_SQRT_2_PI = tl.constexpr(0.79788456080286535587989211986876)  # sqrt(2 / pi)
_KAPPA = tl.constexpr(0.044715)


def act_args(name: str, kwargs: dict):
    """(ACT, p0, p1) of a resolved activation (``_activations.resolve_activation``'s name and kwargs)."""
    if name not in ACTIVATION_IDS:
        raise ValueError(f'unknown activation {name!r}; one of {sorted(ACTIVATION_IDS)}')
    if name == 'leaky_relu':
        return ACTIVATION_IDS[name], float(kwargs.get('negative_slope', 0.01)), 0.0
    if name in ('elu', 'celu'):
        return ACTIVATION_IDS[name], float(kwargs.get('alpha', 1.0)), 0.0
    if name == 'softplus':
        return ACTIVATION_IDS[name], float(kwargs.get('beta', 1.0)), float(kwargs.get('threshold', 20.0))
    if name == 'gelu':
        approximate = kwargs.get('approximate', 'none')
        if approximate not in ('none', 'tanh'):
            raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
        return (GELU_TANH if approximate == 'tanh' else ACTIVATION_IDS[name]), 0.0, 0.0
    return ACTIVATION_IDS[name], 0.0, 0.0


@triton.jit
def _probe():
    pass


# True where triton.jit compiles (this module's functions are JITFunctions), False under TRITON_INTERPRET=1:
# the very test triton.jit makes. A constexpr global, so each `if FAST` is resolved at compile time and the
# interpreter never reaches a libdevice call.
FAST = tl.constexpr(isinstance(_probe, triton.JITFunction))
# NVIDIA's libdevice (the GPUs this engine targets), reached from tl: the kernels import only triton and
# triton.language (tests/kernels/test_proxy_norm_kernels.py)
libdevice = tl.extra.cuda.libdevice


@triton.jit
def _expm1_neg(x):
    """exp(x) - 1 for x <= 0, to a few ulps: libdevice's expm1 when compiled, else Kahan's
    (u - 1) x / log u, u = exp(x)."""
    if FAST:
        out = libdevice.expm1(x)
    else:
        u = tl.exp(x)
        um1 = u - 1.0
        lu = tl.log(tl.where((um1 == 0.0) | (u == 0.0), 2.0, u))  # u = 1 and u = 0 take the other branches
        out = tl.where(um1 == 0.0, x, tl.where(um1 == -1.0, -1.0, um1 * (x / lu)))
    return out


@triton.jit
def _log1p_pos(x):
    """log(1 + x) for x >= 0, to a few ulps: libdevice's log1p when compiled, else Goldberg's
    log(u) x / (u - 1), u = 1 + x."""
    if FAST:
        out = libdevice.log1p(x)
    else:
        u = 1.0 + x
        um1 = u - 1.0
        out = tl.where(um1 == 0.0, x, tl.log(u) * (x / tl.where(um1 == 0.0, 1.0, um1)))
    return out


@triton.jit
def _tanh(z):
    if FAST:
        out = libdevice.tanh(z)
    else:
        e = _expm1_neg(tl.abs(z) * -2.0)  # in [-1, 0]: tanh |z| = -e / (2 + e), no cancellation near 0
        t = -e / (2.0 + e)
        out = tl.where(z < 0, -t, t)
    return out


@triton.jit
def _sigmoid(z):
    e = tl.exp(-tl.abs(z))
    s = 1.0 / (1.0 + e)
    return tl.where(z >= 0, s, e * s)


@triton.jit
def _softplus(t):
    """log(1 + exp(t)) without overflow."""
    return tl.maximum(t, 0.0) + _log1p_pos(tl.exp(-tl.abs(t)))


@triton.jit
def _sigmoid_and_slope(u):
    """(sigmoid(u), sigmoid(u) sigmoid(-u)) from one exp and one division: with e = exp(-|u|) and
    r = 1 / (1 + e), sigmoid(|u|) = r, sigmoid(-|u|) = e r, and their product is e r^2 either side."""
    e = tl.exp(-tl.abs(u))
    r = 1.0 / (1.0 + e)
    return tl.where(u >= 0, r, e * r), (e * r) * r


@triton.jit
def _tanh_derivative(z):
    """1 - tanh(z)^2 = 4 e / (1 + e)^2, e = exp(-2 |z|): one exp and one division, no cancellation."""
    e = tl.exp(tl.abs(z) * -2.0)
    r = 1.0 / (1.0 + e)
    return (e * r) * (r * 4.0)


@triton.jit
def _mish_parts(z):
    """(t, d) = (tanh(softplus z), mish'(z)) from one exp and one division.

    With e = exp(z) and n = e (e + 2) = (1 + e)^2 - 1: t = n / (n + 2), 1 - t = 2 / (n + 2) and
    1 - t^2 = 4 (1 + e)^2 / (n + 2)^2, so mish' = t + z sigmoid(z) (1 - t^2) = t + 4 z e (1 + e) / (n + 2)^2.
    t is taken as 1 - 2 / (n + 2) where t >= 1/2 (n >= 2), so that it never exceeds 1 (float32 divisions are
    approximate), and as n / (n + 2) below, where 1 - 2 / (n + 2) would cancel. z is clamped at 40, so that n
    and e stay finite in float32 (an infinite e would make the second term inf * 0): from there on t rounds to 1 in
    both dtypes and the second term, exact or clamped (< 4 z e^-80), is far below an ulp of it."""
    e = tl.exp(tl.minimum(z, 40.0))
    n = e * (e + 2.0)
    r = 1.0 / (n + 2.0)
    t = tl.where(n >= 2.0, 1.0 - r * 2.0, n * r)
    return t, t + (e * r) * ((1.0 + e) * r) * (z * 4.0)


@triton.jit
def act_forward(z, ACT: tl.constexpr, p0, p1):
    """phi(z) in z's dtype."""
    if ACT == 0:  # relu
        out = tl.where(z > 0, z, 0.0)
    elif ACT == 1:  # relu6
        out = tl.minimum(tl.maximum(z, 0.0), 6.0)
    elif ACT == 2:  # leaky_relu(negative_slope=p0)
        out = tl.where(z > 0, z, z * p0)
    elif ACT == 3:  # elu(alpha=p0)
        out = tl.where(z > 0, z, _expm1_neg(tl.minimum(z, 0.0)) * p0)
    elif ACT == 4:  # celu(alpha=p0) = elu with input scale 1 / alpha
        out = tl.where(z > 0, z, _expm1_neg(tl.minimum(z, 0.0) * (1.0 / p0)) * p0)
    elif ACT == 5:  # selu
        out = tl.where(z > 0, z, _expm1_neg(tl.minimum(z, 0.0)) * _SELU_ALPHA) * _SELU_SCALE
    elif ACT == 6:  # gelu, exact
        out = z * 0.5 * (1.0 + tl.erf(z * _SQRT1_2))
    elif ACT == 13:  # gelu, tanh approximation
        out = z * _sigmoid((z + z * z * z * _KAPPA) * (2.0 * _SQRT_2_PI))  # (1 + tanh u) / 2 = sigmoid(2 u)
    elif ACT == 7:  # silu
        out = z * _sigmoid(z)
    elif ACT == 8:  # mish: softplus without threshold, as ATen's mish
        if FAST:
            t, _ = _mish_parts(z)
        else:
            t = _tanh(_softplus(z))
        out = z * t
    elif ACT == 9:  # softplus(beta=p0, threshold=p1): linear where beta z > threshold
        t = z * p0
        out = tl.where(t > p1, z, _softplus(t) / p0)
    elif ACT == 10:  # hardswish
        out = z * tl.minimum(tl.maximum(z + 3.0, 0.0), 6.0) / 6.0
    elif ACT == 11:  # sigmoid
        out = _sigmoid(z)
    else:  # tanh
        tl.static_assert(ACT == 12, 'unknown activation id')
        out = _tanh(z)
    return out.to(z.dtype)


@triton.jit
def act_grad(z, ACT: tl.constexpr, p0, p1):
    """phi'(z) in z's dtype, as the ATen backward op with grad 1."""
    if ACT == 0:  # threshold_backward(g, relu(z), 0): out > 0
        d = tl.where(z > 0, 1.0, 0.0)
    elif ACT == 1:  # hardtanh_backward(g, z, 0, 6): strict
        d = tl.where((z > 0) & (z < 6.0), 1.0, 0.0)
    elif ACT == 2:  # leaky_relu_backward: z > 0
        d = tl.where(z > 0, 1.0, tl.zeros_like(z) + p0)  # p0 in z's dtype: where of two scalars is float32
    elif ACT == 3:  # elu_backward(alpha, scale 1, input scale 1): negative branch on z <= 0
        d = tl.where(z > 0, 1.0, tl.exp(tl.minimum(z, 0.0)) * p0)
    elif ACT == 4:  # elu_backward(alpha, 1, 1 / alpha)
        d = tl.where(z > 0, 1.0, tl.exp(tl.minimum(z, 0.0) * (1.0 / p0)) * ((1.0 / p0) * p0))
    elif ACT == 5:  # elu_backward(selu alpha, selu scale, 1)
        d = tl.where(z > 0, _SELU_SCALE, tl.exp(tl.minimum(z, 0.0)) * (_SELU_ALPHA * _SELU_SCALE))
    elif ACT == 6:  # gelu_backward('none'): cdf + z pdf
        d = (1.0 + tl.erf(z * _SQRT1_2)) * 0.5 + z * tl.exp(z * z * -0.5) * _INV_SQRT_2PI
    elif ACT == 13:  # gelu_backward('tanh')
        # (1 + t) / 2 = s and 1 - t^2 = 4 s (1 - s), s = sigmoid(2 u): no cancellation in float32 where |t| ~ 1
        u2 = (z + z * z * z * _KAPPA) * (2.0 * _SQRT_2_PI)
        if FAST:
            s, ss = _sigmoid_and_slope(u2)
            d = s + z * 2.0 * ss * ((1.0 + z * z * (3.0 * _KAPPA)) * _SQRT_2_PI)
        else:
            s = _sigmoid(u2)
            d = s + z * 2.0 * s * _sigmoid(-u2) * ((1.0 + z * z * (3.0 * _KAPPA)) * _SQRT_2_PI)
    elif ACT == 7:  # silu_backward
        s = _sigmoid(z)
        d = s * (1.0 + z * (1.0 - s))
    elif ACT == 8:  # mish_backward
        if FAST:
            _, d = _mish_parts(z)
        else:
            t = _tanh(_softplus(z))
            d = t + z * _sigmoid(z) * (1.0 - t * t)
    elif ACT == 9:  # softplus_backward: 1 above the threshold, else sigmoid(beta z)
        t = z * p0
        d = tl.where(t > p1, 1.0, _sigmoid(t))
    elif ACT == 10:  # hardswish_backward
        d = tl.where(z <= -3.0, 0.0, tl.where(z < 3.0, z / 3.0 + 0.5, 1.0))
    elif ACT == 11:  # sigmoid_backward(g, out) = g (1 - out) out
        s = _sigmoid(z)
        d = (1.0 - s) * s
    else:  # tanh_backward(g, out) = g (1 - out^2)
        tl.static_assert(ACT == 12, 'unknown activation id')
        if FAST:
            d = _tanh_derivative(z)
        else:
            t = _tanh(z)
            d = 1.0 - t * t
    return d.to(z.dtype)
