"""The StatNorm engine's autograd Function on the ATen backend and the channel-sized helpers both backends
share (the batch statistics and their VJP, the centred coefficients, the output's storage). Used by
``_statnorm.py`` (the engine) and ``_statnorm_triton.py`` (the Triton backend's glue, whose fallback
backward is this Function's); imports neither. The formulas: ``_statnorm.py``'s docstring.
"""
import torch
import torch.distributed as dist

from ._fused import AtenKernels


def _aten_kernels(act, _cache={}):
    if act not in _cache:
        _cache[act] = AtenKernels(act)
    return _cache[act]


class _StatNormFn(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x3, layer, kernels, m, v, buf, stats, out_dtype, *params):
        kind, mean, var, count = stats
        coeffs, res = layer.coeff_map(m, v, mean, var, params, x3.shape[2], count)
        ctx.save_for_backward(x3)  # x only: channel-sized tensors are kept as attributes
        ctx.layer, ctx.kernels, ctx.m, ctx.v, ctx.coeffs, ctx.res, ctx.stats = layer, kernels, m, v, coeffs, res, stats
        ctx.param_dtypes = [None if p is None else p.dtype for p in params]
        ctx.live = v > 0
        ctx.centred = _centred(coeffs, ctx.live)  # the passes' coefficients, forward and backward
        y = kernels.forward(x3, m, ctx.centred, buf[0])
        return y if y.dtype == out_dtype else y.to(out_dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x3, = ctx.saved_tensors
        m, v, coeffs = ctx.m, ctx.v, ctx.coeffs
        kind, mean, var, count = ctx.stats
        length = x3.shape[2]
        with torch.autocast(x3.device.type, enabled=False):
            dy = dy.reshape(x3.shape)  # dy may be expanded (the grad of a sum)
            if dy.dtype != x3.dtype:
                dy = dy.to(x3.dtype)
            grads, state = ctx.kernels.sums(x3, m, dy, ctx.centred)
            batch = kind in ('batch', 'synced')
            dm, dv, dmean, dvar, dparams = ctx.layer.coeff_vjp(ctx.res, grads, batch)
            if batch:
                dm, dv = batch_moments_vjp(m, mean, count, length, kind == 'synced', dm, dv, dmean, dvar)
            dx = None
            if ctx.needs_input_grad[0]:
                # y depends on m also directly, through x - m: -A per position, summed over them -A sum_l g
                c0 = torch.addcmul(dm, coeffs[0], grads[1], value=-1.0).mul_(1.0 / length)
                c1 = torch.mul(dv, ctx.live).mul_(2.0 / length)
                dx = ctx.kernels.dx(x3, m, dy, coeffs, c1, c0, state)
        dparams = [None if d is None or t is None else d.to(t) for d, t in zip(dparams, ctx.param_dtypes)]
        return (dx, None, None, None, None, None, None, None, *dparams)


def _centred(coeffs, live):
    """The coefficients for the passes that multiply t = x - m by A: A = 0 where the (n, c) is constant
    (v = 0: t is 0, or rounding noise of m), so that kernels forming A x + (B - A m) in one pass (ATen's
    BatchNorm kernels) return B there exactly instead of the rounding of A x - A m (1x1 maps)."""
    return (coeffs[0] * live, ) + tuple(coeffs[1:])


def batch_moments(m: torch.Tensor, v: torch.Tensor, positions: int, synced: bool = False):
    """Per-channel mean and biased variance over the batch from the per-(n, c) moments, and the count of
    values per channel (an int; a tensor when ``synced``: over every process, in two all-reduces, the
    squares around the global mean, so no E[x^2] - E[x]^2 cancellation). Outside autograd."""
    with torch.no_grad():
        if not synced:
            mean = m.mean(0)
            d = m - mean
            return mean, torch.addcmul(v, d, d).mean(0), m.shape[0] * positions
        count = m.new_full((1, ), m.shape[0] * positions)  # not new_tensor: no host-to-device copy
        packed = torch.cat([m.sum(0) * positions, count])
        dist.all_reduce(packed)
        total = packed[-1]
        mean = packed[:-1] / total.clamp(min=1)
        d = m - mean
        sq = torch.addcmul(v, d, d).sum(0) * positions
        dist.all_reduce(sq)
        return mean, sq / total.clamp(min=1), total


def batch_moments_vjp(m, mean, count, positions, synced, dm, dv, dmean, dvar):
    """dm, dv plus the VJP of :func:`batch_moments` for (dmean, dvar). With ``synced``, the all-reduces of the
    moment gradients, in the order and sizes autograd of the forward's all-reduces issues them (var's C,
    then the packed C + 1), so that a process taking the reference path (an empty input) pairs with them."""
    d = m - mean
    if not synced:
        scale = positions / count  # 1 / N
        dm = dm + torch.addcmul(dmean * scale, d, dvar, value=2 * scale)
        return dm, dv + dvar * scale
    total = count.clamp(min=1)
    g_sq = dvar / total
    dist.all_reduce(g_sq)
    g_mean = dmean - (2 * positions) * g_sq * d.sum(0)  # through sq's (x - mean)
    packed = torch.cat([g_mean / total, g_mean.new_zeros(1)])  # the count's slot: not differentiated
    dist.all_reduce(packed)
    g_sum = packed[:-1]
    dm = dm + torch.addcmul(positions * g_sum, d, g_sq, value=2 * positions)
    return dm, dv + positions * g_sq


def _reshaped_base(y: torch.Tensor, shape) -> torch.Tensor:
    """The fresh tensor y in ``shape`` as a tensor of its own, not a view: under no_grad, e.g. the forward of
    a reentrant activation checkpoint (mmdet's ``with_cp``), a view returned out of the checkpoint's Function
    could not be modified in place (a residual ``+=``, a following ReLU(inplace))."""
    if not y.is_contiguous():
        return y.reshape(shape)
    strides = torch.empty(0).new_empty(shape, device='meta').stride()
    return y.new_empty(0).set_(y.untyped_storage(), y.storage_offset(), shape, strides)


