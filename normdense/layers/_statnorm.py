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
import torch.nn as nn

from ..kernels.backend import selected_backend
from ._estimate import in_backward, world_size
from ._fused import compute_dtype, moments
from ._statnorm_aten import _aten_kernels, _centred, _reshaped_base, _StatNormFn, batch_moments

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
            if torch.compiler.is_compiling():  # one torch.library operator for the compiler
                from ._statnorm_compile import compiled_call
                return compiled_call(self, x)
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

