"""The StatNorm engine: one training/eval pipeline for the norms that are "per-(sample, channel) moments,
then a per-(sample, channel) map" (BCN, GN+PN, Unitization), the default (``fused=True``) path of those
layers. Their composition of torch ops (``fused=False``) stays as the reference the tests compare against.

For x viewed as (N, C, L) with L positions:

    m, v         = mean and biased variance of x[n, c, :]                     (backend: one reduction)
    mean, var    = the first stage's per-channel statistics                    (engine, once per forward)
    A, B [, K, L'] = coeff_map(m, v, mean, var, parameters)                   (layer: pure, (N, C)-sized)
    y            = A (x - m) + B    or    K act(A (x - m) + B) + L'           (backend: one pass)

``mean, var`` are the running estimates (estimate mode, Algorithm 1 of arXiv:1903.10520: moved once per
training iteration by ``_estimate.py``), the running statistics (eval) or the batch moments (batch mode,
all-reduced across processes with ``sync_stats``; the running statistics tracked here, once per forward).
None of that happens inside ``coeff_map``, which has no side effects, no collective and no parameters but
its arguments; each layer gives its closed-form vector-Jacobian product ``coeff_vjp`` (no autograd in
backward). Backward, with t = x - m, dm/dx = 1/L and dv/dx = 2 t / L:

    dx = A g + (2 dv t + dm - A sum_l g) / L,     g = dy     (g = dy K act'(A t + B) with an activation)

where dm, dv and the parameter gradients are ``coeff_vjp`` of the channel-sized sums sum_l g t, sum_l g
(and sum_l dy act(.), sum_l dy), plus, in batch mode, the VJP of the batch moments (an all-reduce of the
moment gradients with ``sync_stats``). Only x (in its own dtype) and channel-sized tensors are kept for
backward: the activation memory of one nn.GroupNorm. The moments and coefficients are float32 for fp16/bf16
inputs (float64 for float64 ones).

A layer subclasses :class:`StatNorm2d` and defines ``_statnorm_params``, ``coeff_map`` and ``coeff_vjp``
(and, where it differs, ``_first_stage``, ``_statnorm_act``, ``_statnorm_dtypes``); nothing here names a
layer. The backends (``_fused.py``: ATen; ``_compiled.py``: torch.compile) sit below and import nothing
above them.
"""
import warnings
from typing import Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from ..kernels.backend import selected_backend
from ._estimate import in_backward, world_size
from ._fused import AtenKernels, compute_dtype, moments

FIRST_STAGES = ('none', 'estimate', 'batch')


class StatNorm2d:
    """Mixin of the engine's layers (before ``nn.Module`` / ``nn.GroupNorm`` in the bases).

    The layer sets ``fused``, ``compiled`` and, with a first stage, ``mode``, ``eps``, ``momentum``,
    ``sync_stats`` and the ``running_mean`` / ``running_var`` buffers (``num_batches_tracked`` optional,
    ``momentum=None`` then averages cumulatively). It defines:

    * ``_statnorm_params()``: the parameters the coefficients depend on (tensors or None), in order;
    * ``coeff_map(m, v, mean, var, params, positions, count)`` -> ``(coeffs, residuals)``: pure;
      ``coeffs`` = (A, B) or (A, B, K, L), each (N, C); ``mean, var`` (C,) or None without a first stage;
      ``count`` the values per channel behind batch statistics (an int, or a tensor when all-reduced);
    * ``coeff_vjp(residuals, grads, wants_stats)`` -> ``(dm, dv, dmean, dvar, dparams)`` for ``grads`` the
      gradients of the coefficients (gA, gB[, gK, gL], each (N, C)); dmean, dvar only when ``wants_stats``
      (batch statistics), else None.
    """
    _FIRST_STAGE = 'estimate_or_batch'  # 'none': no per-channel first stage (GN+PN)
    _SYNC_BATCH = False  # batch-mode statistics all-reduced with sync_stats (BCN)

    # --- what a layer may override ---------------------------------------------------------------------
    def _statnorm_act(self):
        return None

    def _statnorm_dtypes(self, x: torch.Tensor) -> Tuple[torch.dtype, torch.dtype]:
        """(compute dtype, output dtype) for input x."""
        return compute_dtype(x), x.dtype

    def _track(self, mean: torch.Tensor, var: torch.Tensor, count) -> None:
        """Batch mode: running statistics (unbiased variance, as nn.BatchNorm), once per forward; ``count``
        values per channel (a tensor after an all-reduce: 0 everywhere leaves the statistics)."""
        with torch.no_grad():
            rm, rv = self.running_mean, self.running_var
            nbt = self._buffers.get('num_batches_tracked')
            if nbt is not None:
                nbt.add_(1)
            # 1 / count in the buffers' dtype: (1.0 / nbt) would be float32 (an int tensor's true division)
            weight = self.momentum if self.momentum is not None else nbt.to(rm.dtype).reciprocal()
            if isinstance(count, torch.Tensor):
                unbiased = var * count / (count - 1).clamp(min=1)
                weight = (count > 0).to(rm.dtype) * weight
            else:
                unbiased = var * (count / (count - 1))
            rm.lerp_(mean.to(rm.dtype), weight)
            rv.lerp_(unbiased.to(rv.dtype), weight)

    # --- the engine -------------------------------------------------------------------------------------
    def _statnorm_kernels(self):
        act = self._statnorm_act()
        if self.compiled:
            from ._compiled import CompiledKernels  # torch.compile imported only when asked for
            return CompiledKernels.get(act)
        return _aten_kernels(act)

    def _first_stage_kind(self) -> str:
        if self._FIRST_STAGE == 'none':
            return 'none'
        return 'batch' if self.mode == 'batch' and self.training else 'fixed'

    def _statnorm_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's output on a non-empty x (N, C, *positions)."""
        if not self.compiled and selected_backend(self, x) == 'triton':
            from ._statnorm_triton import triton_forward  # triton imported only when it runs
            y = triton_forward(self, x)
            if y is not None:  # None: a kernel failed to compile, the ATen backend takes over
                return y
        shape = x.shape
        cd, out_dtype = self._statnorm_dtypes(x)
        with torch.autocast(x.device.type, enabled=False):
            x3 = x.reshape(shape[0], shape[1], -1)
            if x3.dtype != cd and x3.dtype not in (torch.float16, torch.bfloat16):
                x3 = x3.to(cd)  # e.g. float32 x with float64 parameters (GN+PN computes in float64 then)
            kernels = self._statnorm_kernels()
            m, v, buf = moments(x3)
            m, v = m.to(cd), v.to(cd)
            stats = self._first_stage_stats(m, v, x3.shape[2])
            params = tuple(self._statnorm_params())
            needs_grad = torch.is_grad_enabled() and (x.requires_grad or any(
                p is not None and p.requires_grad for p in params))
            if not needs_grad:  # eval / no_grad: nothing kept
                coeffs, _ = self.coeff_map(m, v, stats[1], stats[2], params, x3.shape[2], stats[3])
                y = kernels.forward(x3, m, _centred(coeffs, v > 0), buf)
                return _reshaped_base(y if y.dtype == out_dtype else y.to(out_dtype), shape)
            # buf in a list: a tensor argument returned as the output would make the output a view of an input
            y = _StatNormFn.apply(x3, self, kernels, m, v, [buf], stats, out_dtype, *params)
        return y.view(shape)

    def _first_stage_stats(self, m, v, positions):
        """(kind, mean, var, count): the first stage's statistics for this call, with their side effects
        (estimate update, tracking, the forward's all-reduce) done here, once."""
        kind = self._first_stage_kind()
        if kind == 'none':
            return kind, None, None, None
        if kind == 'fixed':
            if self.mode == 'estimate' and self.training:
                mean, var = self.estimates_from_moments(m, v, positions)
            else:  # copies: constants of this call, whatever later calls do to the buffers
                mean, var = self.running_mean.clone(), self.running_var.clone()
            return kind, mean.to(m.dtype), var.to(m.dtype), None
        synced = self._SYNC_BATCH and self.sync_stats and world_size() > 1
        mean, var, count = batch_moments(m, v, positions, synced)
        if not in_backward():  # a checkpoint's recomputation tracks nothing: the forward did
            self._track(mean, var, count)
        return ('synced' if synced else 'batch'), mean, var, count


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


def warn_recompute_deprecated(layer: str) -> None:
    warnings.warn(f'{layer}(recompute=True) is deprecated and has no effect: the fused path (the default) keeps '
                  'only the input for backward already; drop recompute, or set fused=False to recompute the '
                  'reference composition', DeprecationWarning, stacklevel=3)


def set_fused(module: nn.Module, fused: bool = True) -> int:
    """Switch every StatNorm layer (BCN, GN+PN, Unitization, ...) in ``module`` between the fused path (True)
    and the reference composition (False); returns how many were switched."""
    n = 0
    for mod in module.modules():
        if isinstance(mod, StatNorm2d):
            mod.fused = bool(fused)
            n += 1
    return n

