"""Estimated statistics updated at a rate r: Algorithm 1 (steps 1-4) of Qiao et al., "Micro-Batch Training
with Batch-Channel Normalization and Weight Standardization" (arXiv:1903.10520), for BCN's and Unitization's
``mode='estimate'``. Steps 1-4 in torch are ``kernels.backend.estimate_moments`` / ``estimate_step``; here: the
rate state (:class:`EstimateRateMixin`), the once-per-iteration bookkeeping (:class:`Estimates`, which the engine
owns and hands the buffers) and :func:`set_update_rate`.

The estimates move once per training iteration, however often a layer is called in it (a head shared over FPN
levels, a checkpoint's recomputation in backward); :func:`mark_iteration` ends one. r must lie in [0, 1]: r > 1
overshoots and the variance estimate can turn negative; r = 0 freezes the estimates.
"""
import math
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ..kernels.backend import estimate_moments, estimate_step
from ._distributed import pack, unpack, world_size

# Shown wherever a layer has no rate: the hook's registered names (BCNRateHook is the older alias).
RATE_HINT = ("add custom_hooks=[dict(type='EstimateRateHook')] (alias 'BCNRateHook'; r = the optimizer's "
             "current learning rate, as in the paper), call normdense.layers.set_update_rate(model, lr) each "
             "iteration, or set a fixed norm_cfg update_rate=...")



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


def _rate(rate: float, count, dtype):
    """r, or 0 where no values stand behind the moments; for an all-reduced count a tensor in ``dtype`` (no host
    sync)."""
    if isinstance(count, torch.Tensor):
        return (count > 0).to(dtype) * rate
    return rate if count > 0 else 0.0


# An iteration ends when gradients flow back through an estimate-mode layer or the hook / set_update_rate marks
# one: one counter shared by every layer and the hook, without a reference to either.
_TOKEN = [0]


def mark_iteration() -> None:
    """Start a new training iteration for every estimate-mode layer (their next training call opens it)."""
    _TOKEN[0] += 1


def mark_on_backward(grad) -> None:
    """A tensor hook: gradients flowing back through an estimate-mode layer's output end the iteration."""
    mark_iteration()


_TASK_ID = getattr(torch._C, '_current_graph_task_id', None)


def in_backward() -> bool:
    """True while autograd runs a backward on this thread: a forward then is a checkpoint's recomputation."""
    return _TASK_ID is not None and _TASK_ID() != -1


class _Iteration:
    """One training iteration of one layer: the estimates (2, C) it started from, r (read once), the summed
    moments of its calls so far, and (with sync) each call's local and all-reduced sums for a recomputation."""

    def __init__(self, token, base, rate):
        self.token, self.base, self.rate = token, base, rate
        self.total = None  # (moments (2, C), count) of the calls so far
        self.local, self.synced = [], []

    def synced_sums(self, local):
        """The all-reduced sums of the forward call whose local sums a recomputation repeats: on the device, no
        collective, no host sync."""
        if not self.local:
            raise RuntimeError('an estimate-mode layer is recomputed in backward but was not called in this '
                               "iteration's forward")
        index = (torch.stack(self.local) - local).abs().sum(1).argmin()
        return torch.stack(self.synced).index_select(0, index.view(1))[0]


class Estimates:
    """One layer's estimates across the calls of an iteration, owned by the engine, which hands over the buffers
    (running_mean, running_var, num_batches_tracked) and a function giving r."""

    def __init__(self):
        self.iteration = None  # the open _Iteration
        self.base = None  # the deferred iterations' (2, C) starting estimates, refilled by each one's first call

    def reset(self) -> None:
        """New buffers (a load, a move): the next call opens a new iteration."""
        self.iteration = self.base = None

    def begin(self, buffers, rate, deferred: bool = False):
        """(this iteration's state, whether this call is a recomputation), opened on the iteration's first call;
        ``deferred``: the backend's first stage fills ``base`` and counts num_batches_tracked (no launch here)."""
        st = self.iteration
        if _TASK_ID is not None and _TASK_ID() != -1:  # in_backward(), inlined: a recomputation
            if st is None:
                raise RuntimeError('an estimate-mode layer is recomputed in backward but was not called in '
                                   "this iteration's forward")
            return st, True
        if st is None or st.token != _TOKEN[0]:
            rm, rv, nbt = buffers
            if deferred:  # one tensor for every iteration (read by its own calls only, in stream order)
                base = self.base
                if base is None or base.dtype != rm.dtype or base.device != rm.device:
                    base = self.base = rm.new_empty(2, rm.shape[0])
            else:
                base = torch.stack([rm.detach(), rv.detach()])
            st = self.iteration = _Iteration(_TOKEN[0], base, rate())
            if not deferred and nbt is not None:
                nbt.add_(1)
        return st, False

    def drop_unfilled(self) -> None:
        """Forget an iteration opened by a call whose first stage never ran (a kernel failed to compile)."""
        if self.iteration is not None and self.iteration.total is None:
            self.iteration = None

    def estimates(self, m: torch.Tensor, v: torch.Tensor, positions: int, buffers, rate, sync: bool):
        """This call's estimates (mean, var) from its per-(n, c) moments m, v (N, C), in torch.

        A call normalizes with the iteration's starting estimates moved by r towards its own moments (exactly
        Algorithm 1 for one call, the same for any call order); the buffers hold them moved towards all the
        iteration's calls' moments (one move per iteration). ``sync``: the moments all-reduced first (a process
        without samples joins with a count of 0). A recomputation returns the forward's values, no collective."""
        st, backward = self.begin(buffers, rate)
        with torch.no_grad():
            count = m.shape[0] * positions
            moments = estimate_moments(m, v, st.base[0]) if count else st.base.to(m.dtype) * 0
            if sync and world_size() > 1:
                moments, count = self._all_reduced(st, moments, count, backward)
            call = estimate_step(st.base, moments, _rate(st.rate, count, moments.dtype))
            if not backward:
                if st.total is None:  # the iteration's first call: the buffers take its estimates
                    buffers[0].copy_(call[0])
                    buffers[1].copy_(call[1])
                self.end(st, moments, count, buffers)
            return call[0], call[1]

    @staticmethod
    def _all_reduced(st: '_Iteration', moments: torch.Tensor, count: int, backward: bool):
        """(moments, count tensor) over every process; a recomputation finds the forward's."""
        local = pack(moments, count)
        if backward:
            return unpack(st.synced_sums(local))
        synced = local.clone()
        dist.all_reduce(synced)
        st.local.append(local)
        st.synced.append(synced)
        return unpack(synced)

    @staticmethod
    def end(st: _Iteration, moments: torch.Tensor, count, buffers) -> None:
        """After a call with moments (2, C) over ``count`` values: the iteration's total, and (after its first
        call, which set them) the buffers moved towards it."""
        if st.total is None:
            st.total = (moments, count)
            return
        with torch.no_grad():
            total, n = st.total
            n = n + count
            weight = count / n.clamp(min=1) if isinstance(n, torch.Tensor) else count / max(n, 1)
            st.total = (torch.lerp(total.to(moments.dtype), moments, weight), n)
            moved = estimate_step(st.base, st.total[0], _rate(st.rate, n, moments.dtype))
            buffers[0].copy_(moved[0])
            buffers[1].copy_(moved[1])


class EstimateRateMixin:
    """Rate state of an estimate-mode layer: r is ``update_rate`` when fixed, else the ``current_rate`` that
    ``EstimateRateHook`` or :func:`set_update_rate` sets before each iteration (range-checked where set)."""

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


def set_update_rate(module: nn.Module, rate: float) -> int:
    """Set r in [0, 1] on every estimate-mode layer of ``module`` that takes its rate from outside (training loops
    without mmengine: the current learning rate, before each step); returns how many."""
    rate = check_rate(rate)
    mark_iteration()
    n = 0
    for m in module.modules():
        if isinstance(m, EstimateRateMixin) and m.needs_update_rate:
            m.set_current_rate(rate)
            n += 1
    return n
