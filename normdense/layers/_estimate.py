"""Estimated statistics updated at a rate r: Algorithm 1 (steps 1-4) of Qiao et al., "Micro-Batch Training
with Batch-Channel Normalization and Weight Standardization" (arXiv:1903.10520), shared by every layer
that normalizes with such estimates (BCN's ``mode='estimate'``, Unitization's ``mode='estimate'``).

One place holds the update (:func:`update_estimates_`), the rate state and its range check
(:class:`EstimateRateMixin`), and the loop-side setter (:func:`set_update_rate`); the hook that feeds r
from the learning rate (``normdense.hooks.estimate_rate.EstimateRateHook``) dispatches on the mixin.

r must lie in [0, 1]: each step moves an estimate by ``r * (batch moment - estimate)``, so r > 1
overshoots and the variance estimate can turn negative (NaN in the next normalization). r = 0 freezes the
estimates.
"""
import math
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

# Shown wherever a layer has no rate: the hook's registered names (BCNRateHook is the older alias).
RATE_HINT = ("add custom_hooks=[dict(type='EstimateRateHook')] (alias 'BCNRateHook'; r = the optimizer's "
             "current learning rate, as in the paper), call normdense.layers.set_update_rate(model, lr) each "
             "iteration, or set a fixed norm_cfg update_rate=...")


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def check_rate(rate, who: str = 'update rate r') -> float:
    """``rate`` as a float if it is a finite number in [0, 1], else a ``ValueError`` naming the fix."""
    try:
        value = float(rate)
    except (TypeError, ValueError):
        raise ValueError(f'{who} must be a number in [0, 1], got {rate!r}') from None
    if not (math.isfinite(value) and 0.0 <= value <= 1.0):
        raise ValueError(f'{who} must lie in [0, 1], got {rate!r}: r > 1 overshoots the estimates (the variance '
                         'estimate turns negative, then NaN); lower the rate (e.g. EstimateRateHook rate_scale, '
                         'or the learning rate it follows)')
    return value


def update_estimates_(x: torch.Tensor, running_mean: torch.Tensor, running_var: torch.Tensor, rate: float,
                      sync: bool = True) -> None:
    """Steps 1-4 of Algorithm 1, in place, outside autograd.

    The variance is taken around the current estimate, which equals the batch variance plus the squared
    distance of the batch mean from the estimate. With ``sync`` the per-channel sums are all-reduced so
    every process applies the same update (exact also for unequal per-process batch sizes); a process with
    no samples (a RoI head that got no RoIs) still joins the all-reduce, with a count of 0.
    """
    with torch.no_grad():
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        channels = xf.shape[1]
        count = xf.numel() // channels if channels else 0
        mu_hat = running_mean.to(xf.dtype)
        if count:
            # Two plain reductions (torch.var_mean's Welford reduction over N, H, W is ~20x slower on CPU).
            # E[(x - mu_hat)^2] = E[x^2] - 2 mu_hat E[x] + mu_hat^2, combined in float64.
            dims = [d for d in range(xf.dim()) if d != 1]
            mean_b = xf.mean(dims)
            sq = (xf * xf).mean(dims).double()
            mu64 = mu_hat.double()
            second = (sq - 2 * mu64 * mean_b.double() + mu64 * mu64).clamp_(min=0).to(xf.dtype)
        else:  # e.g. a RoI head that got no RoIs: contributes nothing (but still joins the all-reduce)
            mean_b = second = xf.new_zeros(channels)
        _update(mean_b, second, count, running_mean, running_var, rate, sync)


def update_estimates_from_moments_(m: torch.Tensor, v: torch.Tensor, positions: int, running_mean: torch.Tensor,
                                   running_var: torch.Tensor, rate: float, sync: bool = True) -> None:
    """:func:`update_estimates_` from the per-(sample, channel) mean ``m`` and biased variance ``v`` (N, C)
    over ``positions`` values each (the fused layers have them already): the second moment around the
    estimate is the mean over samples of v + (m - mu_hat)^2."""
    with torch.no_grad():
        count = m.shape[0] * positions
        mu_hat = running_mean.to(m.dtype)
        if count:
            mean_b = m.mean(0)
            second = (v + (m - mu_hat).square()).mean(0)
        else:
            mean_b = second = m.new_zeros(m.shape[1])
        _update(mean_b, second, count, running_mean, running_var, rate, sync)


def _update(mean_b, second, count, running_mean, running_var, rate, sync):
    """Steps 3-4 from this process's moments (all-reduced with ``sync``), in place."""
    channels = mean_b.shape[0]
    mu_hat = running_mean.to(mean_b.dtype)
    # new_full, not new_tensor: a tensor from Python data is a host-to-device copy (a sync on CUDA)
    sums = torch.cat([mean_b * count, second * count, mean_b.new_full((1, ), count)])
    if sync and world_size() > 1:
        dist.all_reduce(sums)
    total = sums[-1]
    # no samples anywhere: a zero rate instead of `if total == 0: return` (that reads the value: a sync)
    rate = (total > 0).to(mean_b.dtype) * rate
    total = total.clamp(min=1)
    mean_b, second = sums[:channels] / total, sums[channels:2 * channels] / total
    running_mean.add_((rate * (mean_b - mu_hat)).to(running_mean.dtype))
    running_var.add_((rate * (second - running_var.to(mean_b.dtype))).to(running_var.dtype))


class EstimateRateMixin:
    """Rate state of a layer with estimate-mode statistics (``running_mean`` / ``running_var`` buffers).

    The layer calls :meth:`_init_estimate_rate` in its constructor. r is ``update_rate`` when fixed, else
    the ``current_rate`` that :class:`~normdense.hooks.estimate_rate.EstimateRateHook` or
    :func:`set_update_rate` sets before each iteration; both are range-checked where they are set. In
    estimate mode the estimates stay float32 when the module is cast to fp16/bf16 (``model.half()``): an
    update of ``r * delta`` with r ~ lr is below bf16's resolution and would be lost to rounding.
    """
    _ESTIMATE_BUFFERS = ('running_mean', 'running_var')

    def _init_estimate_rate(self, mode: str, update_rate: Optional[float]) -> None:
        name = type(self).__name__
        if update_rate is not None and mode != 'estimate':
            raise ValueError(f"{name} update_rate only applies to mode='estimate'")
        self.mode = mode
        self.update_rate = None if update_rate is None else check_rate(update_rate, f'{name} update_rate')
        self.current_rate: Optional[float] = None  # set by EstimateRateHook / set_update_rate

    @property
    def needs_update_rate(self) -> bool:
        """True for layers whose r comes from outside (estimate mode without a fixed ``update_rate``)."""
        return self.mode == 'estimate' and self.update_rate is None

    def set_current_rate(self, rate) -> None:
        self.current_rate = check_rate(rate, f'{type(self).__name__} update rate r')

    def _rate(self) -> float:
        if self.update_rate is not None:
            return self.update_rate
        if self.current_rate is None:
            raise RuntimeError(f"{type(self).__name__}(mode='estimate') is training but has no update rate r, so "
                               f"its estimates would never move: {RATE_HINT}")
        return self.current_rate

    def _apply(self, fn, *args, **kwargs):
        if getattr(self, 'mode', None) != 'estimate':
            return super()._apply(fn, *args, **kwargs)
        before = {n: self._buffers[n] for n in self._ESTIMATE_BUFFERS if self._buffers.get(n) is not None}
        out = super()._apply(fn, *args, **kwargs)
        for n, old in before.items():
            new = self._buffers[n]
            if new.dtype in (torch.float16, torch.bfloat16):  # from the fp32 values: no rounding on the way
                self._buffers[n] = old.detach().to(device=new.device, dtype=torch.float32)
        return out


def set_update_rate(module: nn.Module, rate: float) -> int:
    """Set r on every estimate-mode layer of ``module`` that takes its rate from outside (for training
    loops without mmengine; call it with the current learning rate before each step). Returns the count.
    ``rate`` must lie in [0, 1] (``ValueError`` otherwise)."""
    rate = check_rate(rate)
    n = 0
    for m in module.modules():
        if isinstance(m, EstimateRateMixin) and m.needs_update_rate:
            m.set_current_rate(rate)
            n += 1
    return n
