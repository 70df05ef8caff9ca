"""The StatNorm engine on the Triton backend (``normdense/kernels``): the same pipeline as ``_statnorm.py``
with every pass and every channel-sized step a kernel launch, at most 8 per training step of a layer:

    forward   moments (partials per chunk) -> stats (merge; estimate / batch statistics) -> the layer's
              coefficient kernel (``triton_coeff_map``) -> apply (y; the buffers written last)
    backward  sums [-> merge when split] -> the layer's coefficient VJP (``triton_coeff_vjp``) -> dx

The module's state changes (estimates, running statistics, num_batches_tracked) happen in the forward's last
kernel, so a kernel failing to compile under backend 'auto' leaves it untouched and the call is taken by
the ATen backend (one warning for the process). Paths with a collective (``sync_stats`` over several
processes) keep the engine's torch code for the statistics and for their VJP, between the same kernels.
"""
import types

import torch

from ..kernels import backend as _backend
from ._estimate import in_backward, world_size
from ._statnorm_aten import _aten_kernels, _centred, _reshaped_base, _StatNormFn, batch_moments_vjp

_HALF = (torch.float16, torch.bfloat16)


def triton_forward(layer, x, keep=None):
    """The layer's output on x by the Triton backend, or None where a kernel failed to compile (then the
    caller takes the ATen path). ``keep`` (a list): no autograd graph; what the backward needs is appended to
    it instead, for :func:`backward_of` (the torch.library operator of ``_statnorm_compile.py``)."""
    from ..kernels import passes as P
    try:
        return _forward(layer, x, P, keep)
    except _backend.compile_errors() as e:
        _backend.give_up_triton(layer, e)
        st = layer.__dict__.get('_iteration')
        if st is not None and st.total is None:  # opened by this call, its base never filled: start anew
            layer.__dict__.pop('_iteration')
        return None


def _act(layer):
    act = layer._statnorm_act()
    if act is None:
        return None
    from ..kernels.activations import act_args
    return act_args(act.name, act.kwargs)


def _forward(layer, x, P, keep=None):
    shape = x.shape
    cd, out_dtype = layer._statnorm_dtypes(x)
    with torch.autocast(x.device.type, enabled=False):
        x3 = x.reshape(shape[0], shape[1], -1)
        if x3.dtype != cd and x3.dtype not in _HALF:
            x3 = x3.to(cd)
        x3 = x3.contiguous()
        part, split, chunk = P.moment_partials(x3)
        m, v, stats, write, nbt, record = _first_stage(layer, P, part, split, chunk, x3.shape)
        params = tuple(layer._statnorm_params())
        act = _act(layer)
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or any(
            p is not None and p.requires_grad for p in params))
        if keep is not None:
            ctx = types.SimpleNamespace(needs_input_grad=(True, ))
            y = _keep_forward(ctx, x3, layer, m, v, stats, act, out_dtype, [write, nbt], *params)
            ctx.saved_tensors = (x3, )
            keep.append(ctx)
            needs_grad = False
        elif not needs_grad:
            coeffs, _ = _maps(layer, stats)[0](m, v, stats[1], stats[2], params, x3.shape[2], stats[3])
            y = P.apply(x3, m, v, coeffs, act, out_dtype, write, nbt)
        else:
            y = _TritonStatNormFn.apply(x3, layer, m, v, stats, act, out_dtype, [write, nbt], *params)
    if record is not None:
        record()  # after the kernels ran: the iteration's bookkeeping in Python
    return _reshaped_base(y, shape) if not needs_grad else y.view(shape)


def _maps(layer, stats):
    """The coefficient map and its VJP: the layer's Triton kernels, or its torch code where the statistics
    come from a collective (a tensor count; its coefficients made contiguous for the passes)."""
    if isinstance(stats[3], torch.Tensor):
        def cmap(*args):
            coeffs, res = layer.coeff_map(*args)
            return tuple(t.contiguous() for t in coeffs), res
        return cmap, layer.coeff_vjp
    return layer.triton_coeff_map, layer.triton_coeff_vjp


def _first_stage(layer, P, part, split, chunk, shape):
    """(m, v, stats, write, nbt, record): the merged moments, the engine's (kind, mean, var, count), what the
    apply kernel writes into the buffers, the num_batches_tracked it counts and a Python step to run after."""
    positions = shape[2]
    kind = layer._first_stage_kind()
    none = (None, None, None)
    if kind == 'none':
        m, v = P.stats(part, split, chunk, shape)[:2]
        return m, v, ('none', None, None, None), *none
    nbt = layer._buffers.get('num_batches_tracked')
    rm, rv = layer.running_mean, layer.running_var
    if kind == 'fixed' and not (layer.mode == 'estimate' and layer.training):  # eval: the running statistics
        m, v, mean, var = P.stats(part, split, chunk, shape, P.STATS_FIXED, rm, rv)[:4]
        return m, v, ('fixed', mean, var, None), *none
    synced = layer.sync_stats and world_size() > 1 and (kind == 'fixed' or layer._SYNC_BATCH)
    if synced:  # the engine's torch code around the collective
        m, v = P.stats(part, split, chunk, shape)[:2]
        return m, v, layer._first_stage_stats(m, v, positions), *none
    count = shape[0] * positions
    backward = in_backward()
    if kind == 'fixed':  # estimate mode, training: Algorithm 1 once per iteration
        st = layer._open_iteration(deferred=True)
        first = st.total is None and not backward
        m, v, mean, var, moved, upd = P.stats(part, split, chunk, shape, P.STATS_ESTIMATE, rm, rv, st.base,
                                              rate=st.rate, write=first)
        record = None if backward else (lambda: layer._record_call(st, moved, count))
        return m, v, ('fixed', mean, var, None), (upd, rm, rv) if first else None, \
            nbt if first and nbt is not None else None, record
    track = not backward  # a checkpoint's recomputation tracks nothing: the forward did
    m, v, mean, var, _, upd = P.stats(part, split, chunk, shape, P.STATS_BATCH, rm, rv, momentum=layer.momentum,
                                      write=track, nbt=nbt)
    return m, v, ('batch', mean, var, count), (upd, rm, rv) if track else None, \
        nbt if track and nbt is not None else None, None


def _keep_forward(ctx, x3, layer, m, v, stats, act, out_dtype, effects, *params):
    """y, with what the backward needs set on ``ctx`` (all but x3)."""
    from ..kernels import passes as P
    cmap, _ = _maps(layer, stats)
    coeffs, res = cmap(m, v, stats[1], stats[2], params, x3.shape[2], stats[3])
    ctx.layer, ctx.m, ctx.v, ctx.coeffs, ctx.res, ctx.stats, ctx.act = layer, m, v, coeffs, res, stats, act
    ctx.params = params
    ctx.param_dtypes = [None if p is None else p.dtype for p in params]
    return P.apply(x3, m, v, coeffs, act, out_dtype, effects[0], effects[1])


def backward_of(ctx, dy):
    """(dx, *dparams) of a forward run with ``keep`` (dparams aligned with ``_statnorm_params()``)."""
    x3, = ctx.saved_tensors
    with torch.autocast(x3.device.type, enabled=False):
        out = _backward(ctx, x3, _like(dy, x3))
    return (out[0], ) + tuple(out[8:])


def _like(dy, x3):
    """dy as the passes read it: x3's shape and dtype, contiguous (it may be expanded: the grad of a sum)."""
    dy = dy.reshape(x3.shape)
    return (dy if dy.dtype == x3.dtype else dy.to(x3.dtype)).contiguous()


class _TritonStatNormFn(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x3, layer, m, v, stats, act, out_dtype, effects, *params):
        ctx.save_for_backward(x3)
        return _keep_forward(ctx, x3, layer, m, v, stats, act, out_dtype, effects, *params)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x3, = ctx.saved_tensors
        with torch.autocast(x3.device.type, enabled=False):
            dy = _like(dy, x3)
            try:
                return _backward(ctx, x3, dy)
            except _backend.compile_errors() as e:
                _backend.give_up_triton(ctx.layer, e)
                return _aten_backward(ctx, x3, dy)


def _backward(ctx, x3, dy):
    from ..kernels import passes as P
    layer, m, v, coeffs = ctx.layer, ctx.m, ctx.v, ctx.coeffs
    kind, mean, var, count = ctx.stats
    grads = P.sums(x3, dy, m, v, coeffs, ctx.act)
    batch = kind in ('batch', 'synced')
    dm, dv, dmean, dvar, dparams = _maps(layer, ctx.stats)[1](ctx.res, grads, batch)
    dx = None
    if ctx.needs_input_grad[0]:
        extra = None
        if kind == 'synced':
            dm, dv = batch_moments_vjp(m, mean, count, x3.shape[2], True, dm, dv, dmean, dvar)
        elif kind == 'batch':
            extra = (mean, dmean, dvar, 1.0 / x3.shape[0])
        dx = P.dx(x3, dy, m, v, coeffs, dm, dv, grads[1], ctx.act, extra)
    elif kind == 'synced':  # every process joins the VJP's all-reduces
        batch_moments_vjp(m, mean, count, x3.shape[2], True, dm, dv, dmean, dvar)
    return _outputs(ctx, dx, dparams)


def _outputs(ctx, dx, dparams):
    dparams = [None if d is None or t is None else d.to(t) for d, t in zip(dparams, ctx.param_dtypes)]
    return (dx, None, None, None, None, None, None, None, *dparams)


def _aten_backward(ctx, x3, dy):
    """The engine's ATen backward for a forward the Triton kernels took (a backward kernel failed to compile):
    the layer's torch coefficient map rebuilt from the same moments and statistics."""
    layer, stats = ctx.layer, ctx.stats
    coeffs, res = layer.coeff_map(ctx.m, ctx.v, stats[1], stats[2], ctx.params, x3.shape[2], stats[3])
    live = ctx.v > 0
    fake = types.SimpleNamespace(saved_tensors=(x3, ), layer=layer, m=ctx.m, v=ctx.v, coeffs=coeffs, res=res,
                                 stats=stats, live=live, centred=_centred(coeffs, live),
                                 kernels=_aten_kernels(layer._statnorm_act()),
                                 needs_input_grad=ctx.needs_input_grad, param_dtypes=ctx.param_dtypes)
    return _StatNormFn.backward(fake, dy)
