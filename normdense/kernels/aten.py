"""The ATen backend of the StatNorm engine (``normdense/layers/_statnorm.py``): the passes over the activation x
with ATen's GroupNorm and BatchNorm kernels, and the channel-sized first-stage statistics in torch. Every device.
It implements ``backend.Backend`` (imports nothing of normdense but that contract); ``triton.py`` is the other.

For x viewed as (N, C, L), per-(n, c) coefficients A, B [, K, L'] and t = x - m:

    moments   m, v     = mean and biased variance of x[n, c, :]          one reduction (GroupNorm's kernel)
    stats     the first stage's per-channel statistics from m, v          (C,)-sized torch ops
    apply     y        = A t + B,  or  K act(A t + B) + L'                one pass (BatchNorm's eval kernel)
    sums      sum_l g t, sum_l g  (and sum_l dy act(.), sum_l dy)          one reduction (BatchNorm's backward)
    dx        dx       = A g + c1 t + c0                                   one pass + one in-place update

with g = dy (g = dy K act'(A t + B) with an activation). x is read in its own dtype (fp16/bf16 included:
the kernels accumulate in float32 and take float32 coefficients; no float32 copy of x is made); the moments
and every channel-sized tensor are float32 for half inputs, x's dtype otherwise.

BatchNorm's eval kernel on the (1, N*C, L) view, with running mean m, running variance 1 and eps 0,
computes ``(x - m) * weight + bias`` per (n, c) in one vectorized pass, centred (no cancellation between
A x and A m where a channel's mean is large against its spread); its training-mode backward with
save_mean = m and save_invstd = 1 gives sum_l dy (x - m) and sum_l dy without writing anything. The
constant vectors these calls take (ones, an empty tensor) are cached per size, dtype and device, so a call
allocates none of them.

Buffers: on the CPU a fresh activation-sized tensor costs page faults on first touch (glibc hands large
blocks back to the OS), more than the pass that fills it; the forward writes y over the normalized output
of the moments' kernel (which it does not otherwise need), the backward allocates dx only (and, with an
activation, its pre-activation): GroupNorm's allocations.
"""
import contextlib
from typing import NamedTuple, Optional

import torch
from torch.ops import aten

from .backend import HALF as _HALF
from .backend import STATS_BATCH, STATS_ESTIMATE, STATS_FIXED, Statistics, StatsRequest, estimate_update, track_



def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float32 for fp16/bf16 inputs (sums over positions overflow or round away in half), else x's dtype."""
    return torch.float32 if x.dtype in _HALF else x.dtype


_CONSTANTS = {}  # why: a call would otherwise allocate (and on CUDA launch a fill for) these every time


def _constant(size: int, value: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A cached read-only vector of ``size`` x ``value`` (the kernels' unit variance, unit weight, empty
    outputs): created once per (size, value, dtype, device), outside inference mode."""
    key = (size, value, dtype, device)
    t = _CONSTANTS.get(key)
    if t is None:
        with torch.inference_mode(False), torch.no_grad():
            t = torch.full((size, ), value, dtype=dtype, device=device)
        if len(_CONSTANTS) > 512:  # many distinct batch x channel sizes: start over
            _CONSTANTS.clear()
        _CONSTANTS[key] = t
    return t


def _plain(x: torch.Tensor) -> bool:
    # cache only for ordinary tensors (a fake or meta tensor's constants must not outlive their mode)
    return type(x) is torch.Tensor and not x.is_meta  # is_meta: no device object made (4 calls a step)


def _ones(x: torch.Tensor, size: int, dtype: torch.dtype) -> torch.Tensor:
    if _plain(x):
        return _constant(size, 1.0, dtype, x.device)
    return torch.ones(size, dtype=dtype, device=x.device)


def moments(x3: torch.Tensor):
    """(m, v, buffer) of x3 (N, C, L), under the caller's no_grad: per-(n, c) mean and biased variance in the
    compute dtype, and an activation-sized tensor of x's dtype that the forward may write y into (None on CUDA).

    CPU: GroupNorm's forward kernel with one channel per group (faster than torch.var_mean's Welford
    reduction, docs/performance.md; E[x^2] - E[x]^2 in float32 loses the variance of a channel whose mean is
    large), eps 0: a constant
    channel has rstd = inf and v = rstd^-2 = 0 exactly (its normalized values, NaN, are never read: the
    buffer is only storage). With a float32 unit weight for half inputs, the kernel returns float32 moments.
    CUDA: SyncBN's statistics kernel, one read and nothing written."""
    n, c, length = x3.shape
    cd = compute_dtype(x3)
    if x3.is_cuda:
        m, invstd = torch.batch_norm_stats(x3.reshape(1, n * c, length), 0.0)
        # a constant channel: SyncBN's InvStd returns 0 for var = eps = 0
        v = torch.where(invstd > 0, invstd.pow(-2), 0.0)
        return m.view(n, c).to(cd), v.view(n, c).to(cd), None
    weight = _ones(x3, c, cd) if x3.dtype in _HALF else None
    buf, m, rstd = aten.native_group_norm(x3, weight, None, n, c, length, c, 0.0)
    return m, rstd.pow(-2), buf  # (N, groups) = (N, C) already


def apply(x3: torch.Tensor, m: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor,
          out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """scale (x - m) + shift per (n, c) in one pass: x3 (N, C, L) in its own dtype, m/scale/shift (N, C)
    (m None: 0); written into ``out`` (x3's shape and dtype; may be x3 itself) or a new tensor of x3's
    dtype. Not a view of anything made here (the custom Function's output may be modified in place)."""
    n, c, length = x3.shape
    flat = x3.reshape(1, n * c, length)
    cd = scale.dtype
    mean = _zeros(x3, n * c, cd) if m is None else m.reshape(-1)
    var = _ones(x3, n * c, cd)
    if out is None or not x3.is_cpu:
        y = aten.native_batch_norm(flat, scale.reshape(-1), shift.reshape(-1), mean, var, False, 0.0, 0.0)[0]
        y = y.view(n, c, length)
        return y if out is None else out.copy_(y)
    empty = _empty(x3, cd)
    aten.native_batch_norm.out(flat, scale.reshape(-1), shift.reshape(-1), mean, var, False, 0.0, 0.0,
                               out=out.view(1, n * c, length), save_mean=empty, save_invstd=empty)
    return out


def _zeros(x, size, dtype):
    if _plain(x):
        return _constant(size, 0.0, dtype, x.device)
    return torch.zeros(size, dtype=dtype, device=x.device)


def _empty(x, dtype):
    # the eval kernel's save_mean / save_invstd outputs: resized to 0 elements, never read
    return _constant(0, 0.0, dtype, x.device) if _plain(x) else torch.empty(0, dtype=dtype, device=x.device)


def centred_sums(dy: torch.Tensor, x3: torch.Tensor, m: Optional[torch.Tensor], cd: torch.dtype):
    """(sum_l dy (x - m), sum_l dy) per (n, c) in one reduction, nothing written (m None: 0)."""
    n, c, length = x3.shape
    mean = _zeros(x3, n * c, cd) if m is None else m.reshape(-1)
    ones = _ones(x3, n * c, cd)
    # CUDA's kernel makes grad_weight with weight's options: an undefined weight raises there
    weight = None if x3.device.type == 'cpu' else ones
    _, dot, total = aten.native_batch_norm_backward(
        dy.reshape(1, n * c, length), x3.reshape(1, n * c, length), weight, None, None, mean, ones, True, 0.0,
        [False, True, True])
    return dot.view(n, c), total.view(n, c)


class PassCoeffs(NamedTuple):
    raw: tuple  # (A, B[, K, L']) as the map made them
    centred: tuple  # A = 0 where v = 0 (see prepare)
    live: torch.Tensor  # v > 0


def _statistics(m, v, request: StatsRequest):
    """(mean, var, moved) of ``request`` from the moments, in torch, under no_grad (the caller's); nothing of the
    module is written but ESTIMATE's ``base`` (the iteration's start)."""
    mean = var = moved = None
    mode, stat_mean, stat_var, write = request.mode, request.stat_mean, request.stat_var, request.write
    if mode == STATS_FIXED:  # copies: constants of this call, whatever later calls do to the buffers
        mean, var = stat_mean.to(m.dtype, copy=True), stat_var.to(m.dtype, copy=True)
    elif mode == STATS_ESTIMATE:
        base = request.base
        if write:  # the iteration's first call: its start is the buffers
            torch.stack([stat_mean, stat_var], out=base)
        moved, (mean, var) = estimate_update(m, v, base, request.rate)
    elif mode == STATS_BATCH:
        mean = m.mean(0)  # over the samples; the variance by the law of total variance
        d = m - mean
        var = torch.addcmul(v, d, d).mean(0)
    return mean, var, moved


def _write(stats: Statistics, shape) -> None:
    """The module's buffers take the call's statistics, in place (two operators; new values then a copy would be
    five): ESTIMATE's estimates as they are, BATCH's as running averages."""
    request = stats.request
    if request.mode == STATS_ESTIMATE:
        request.stat_mean.copy_(stats.mean)
        request.stat_var.copy_(stats.var)
    else:
        track_(request.stat_mean, request.stat_var, stats.mean, stats.var, shape[0] * shape[2], request.momentum,
               request.nbt)


class AtenBackend:
    """:class:`normdense.kernels.backend.Backend` on ATen's kernels (every device); its first stage is torch code,
    computed at once."""
    name = 'aten'
    kernel_maps = False

    @staticmethod
    def read_input(x3):
        return x3.contiguous()  # the row kernels take (N, C, L) rows: channels_last is copied

    @staticmethod
    def first_stage(x3, request: StatsRequest, deferred: bool = True):
        x3 = x3.contiguous()  # read_input(x3), inlined (a call a step)
        with torch.no_grad():  # one context for both (entering one costs about 3 us)
            m, v, out = moments(x3)
            mean, var, moved = _statistics(m, v, request)
        return x3, Statistics(m=m, v=v, mean=mean, var=var, moved=moved, update=None, first=None, out=out,
                              request=request)

    @staticmethod
    def prepare(coeffs, v):
        """A = 0 where the (n, c) is constant (v = 0: t is 0, or rounding noise of m), so that kernels forming
        A x + (B - A m) in one pass (ATen's BatchNorm kernels) return B there exactly instead of the rounding
        of A x - A m (1x1 maps)."""
        live = v > 0
        return PassCoeffs(tuple(coeffs), (coeffs[0] * live, ) + tuple(coeffs[1:]), live)

    @staticmethod
    def apply(x3, stats: Statistics, coeffs, act=None, out_dtype=None, out=None):
        """(y, pc), y written into ``stats.out`` (the moments' output storage) when there is one (``out`` is not
        taken: the engine makes its own output of y)."""
        pc = AtenBackend.prepare(coeffs, stats.v)
        m, buf = stats.m, stats.out
        a, b = pc.centred[0], pc.centred[1]
        if act is None:
            y = apply(x3, m, a, b, buf)
        elif act.name == 'relu':  # K relu(p) + L = max(K p + L, L) for K > 0 (K = 1 / proxy std, or 1)
            k, l_ = pc.centred[2], pc.centred[3]
            y = apply(x3, m, k * a, torch.addcmul(l_, k, b), buf)
            y = y.clamp_(min=l_.unsqueeze(2).to(y.dtype))
        else:
            z = apply(x3, m, a, b, buf)
            y = apply(act.forward(z), None, pc.centred[2], pc.centred[3], None if buf is None else z)
        request = stats.request
        # no no_grad needed: the buffers and the first stage's values (made under no_grad) carry no grad
        if request.write:
            _write(stats, x3.shape)
        if request.nbt is not None:
            request.nbt.add_(1)
        return (y if out_dtype is None or y.dtype == out_dtype else y.to(out_dtype)), pc

    @staticmethod
    def grad_layout(dy, x3):
        """dy (in x's shape) as the passes take it: x3's shape and dtype, contiguous."""
        dy = dy.reshape(x3.shape)
        return (dy if dy.dtype == x3.dtype else dy.to(x3.dtype)).contiguous()

    @staticmethod
    def sums(x3, dy, stats: Statistics, pc, act=None, merged=True):
        """([sum_l g t, sum_l g] (and, with an activation, sum_l dy act(A t + B), sum_l dy), state for dx), each
        (N, C); ATen's reductions have no chunks (``merged`` changes nothing)."""
        m = stats.m
        coeffs = pc.centred
        cd = coeffs[0].dtype
        if act is None:
            return list(centred_sums(dy, x3, m, cd)), dy
        a, b, k = coeffs[0], coeffs[1], coeffs[2]
        z = apply(x3, m, a, b)  # the pre-activation, recomputed (only x is kept)
        if act.name == 'relu':  # h = dy where z > 0, written over z; sum dy relu(z) = A sum h t + B sum h
            h = aten.threshold_backward.grad_input(dy, z, 0, grad_input=z)
            ht, hs = centred_sums(h, x3, m, cd)
            return [k * ht, k * hs, torch.addcmul(a * ht, b, hs), dy.sum(2, dtype=cd)], h
        out = act.forward(z)
        dot, total = centred_sums(dy, out, None, cd)
        h = act.backward(dy, z, out)  # dy act'(z); g = K h
        ht, hs = centred_sums(h, x3, m, cd)
        return [k * ht, k * hs, dot, total], h

    @staticmethod
    def dx(x3, dy, stats: Statistics, pc, dm, dv, grads, act=None, batch=None, state=None, pending=None):
        """dx = A g + c1 t + c0 (x3's dtype), c0 = (dm - A sum_l g) / L, c1 = 2 dv / L (0 where v = 0): c1 t + c0 in
        one pass, then A g added in place (g = K h with an activation, ``state`` from :meth:`sums`). ``batch`` =
        (mean, dmean, dvar, 1 / N): dm, dv first take the VJP of the (unsynchronized) batch statistics. The torch
        maps leave no ``pending`` sums."""
        if pending is not None:
            raise ValueError('the ATen backend runs the torch maps, which leave no pending sums')
        m, length, gsum = stats.m, x3.shape[2], grads[1]  # grads: what sums returned
        if batch is not None:
            mean, dmean, dvar, scale = batch
            dm = dm + torch.addcmul(dmean * scale, m - mean, dvar, value=2 * scale)
            dv = dv + dvar * scale
        # y depends on m also directly, through x - m: -A per position, summed over them -A sum_l g
        coeffs = pc.raw
        c0 = torch.addcmul(dm, coeffs[0], gsum, value=-1.0).mul_(1.0 / length)
        c1 = torch.mul(dv, pc.live).mul_(2.0 / length)
        scale = coeffs[0] if act is None else coeffs[2] * coeffs[0]
        return apply(x3, m, c1, c0).addcmul_(state, scale.unsqueeze(2))

    @staticmethod
    def act_form(act):
        return act  # the Activation itself: its forward and backward

    guard = contextlib.nullcontext  # nothing to set up (a class, not a function of ours: no call into this file)

    @staticmethod
    def compile_errors():
        return ()
