"""The StatNorm engine of the norms that are "per-(sample, channel) moments, then a per-(sample, channel) map"
(BCN, GN+PN, Unitization). For x viewed as (N, C, L):

    m, v           = mean and biased variance of x[n, c, :]                  backend.first_stage
    mean, var      = running statistics, Algorithm 1's estimates or the batch's  (the request, here)
    A, B [, K, L'] = coeff_map(m, v, mean, var, parameters)                  the layer's file: pure, (N, C)
    y              = A (x - m) + B    or    K act(A (x - m) + B) + L'        backend.apply

Backward, with t = x - m: dx = A g + (2 dv t + dm - A sum_l g) / L, g = dy (dy K act'(A t + B) with an
activation), where dm, dv and the parameter gradients are the layer's closed-form ``coeff_vjp`` of the sums
(backend.sums), plus the batch statistics' VJP in batch mode. Only x is kept: the memory of one nn.GroupNorm.

Calls go one way: the layer's forward calls the engine once, the engine asks the layer for data, the backend
(``kernels/backend.py``'s contract) for passes and its ``Estimates`` for the iteration's bookkeeping. docs/engine.md.
"""
import contextlib
import math
from typing import Any, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from ..errors import ExportError
from ..kernels.aten import AtenBackend
from ..kernels.backend import HALF as _HALF
from ..kernels.backend import (STATS_BATCH, STATS_ESTIMATE, STATS_FIXED, PendingSums, Statistics, StatsRequest,
                               check_backend, give_up_triton, selected_backend, tracked)
from ._distributed import synced_batch_moments, synced_batch_moments_vjp
from ._estimate import Estimates, in_backward, mark_iteration, mark_on_backward



def _triton():
    from ..kernels.triton import TritonBackend  # triton imported only when it runs
    return TritonBackend


_BACKENDS = {'aten': lambda: AtenBackend, 'triton': _triton}
_PER_DEVICE_AUTOCAST = hasattr(torch, 'get_autocast_dtype')  # torch >= 2.4 asks autocast per device type


def _autocast_on(device_type: str) -> bool:
    if not _PER_DEVICE_AUTOCAST:  # cannot ask: always a context
        return True
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:  # a device type without autocast (meta): it cannot be on
        return False


def _no_autocast(device_type: str):
    """Autocast off for ``device_type``: ``torch.autocast(enabled=False)`` where it is on, else nothing (entering
    one costs about 6 us, twice a training step)."""
    if _autocast_on(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


class _Call(NamedTuple):  # a NamedTuple: a frozen dataclass's __init__ costs 3x more per call
    """What the Function's forward and backward need of one call besides tensors."""
    backend: Any  # a kernels.backend.Backend
    maps: tuple  # (coeff_map, coeff_vjp) of the backend's kind
    torch_maps: tuple  # the layer's torch maps (the ATen fallback of a Triton backward that fails to compile)
    kernel_maps: bool  # maps are the layer's kernel transcriptions
    kind: str  # the statistics: 'none' | 'fixed' | 'batch' | 'synced'
    count: Any  # values per channel behind batch statistics (an int, a tensor when all-reduced), else None
    act: Any  # GN+PN's activation, or None
    out_dtype: torch.dtype
    option: Optional[str]  # the layer's backend option (a failed compile under 'auto' falls back)
    ends_iteration: bool  # estimate mode in training: the backward ends the iteration


class StatNorm2d(nn.Module):
    """Base class of BCN, GN+PN and Unitization: their flags, buffers, dtype policy and the engine.

    A layer calls :meth:`_init_statnorm` in its constructor and supplies data: ``_statnorm_params()`` (tensors or
    None, in order), ``_coeff_maps(kernel)`` (its pure map and closed-form VJP, torch or kernel, bound to its
    configuration), ``_statnorm_act()`` and ``_eval_form(x)``::

        coeff_map(m, v, mean, var, params, positions, count) -> ((A, B[, K, L]), residuals)
        coeff_vjp(residuals, grads, wants_stats) -> (dm, dv, dmean, dvar, dparams)

    ``mean, var``: (C,) or None; ``count``: the values per channel behind batch statistics (an int, a tensor
    when all-reduced) or None; dmean, dvar only when ``wants_stats``.

    Buffers (not GN+PN's): ``running_mean``, ``running_var`` (estimates in estimate mode) and
    ``num_batches_tracked`` (iterations in estimate mode, calls in batch mode; 0 when a version-1 checkpoint
    lacks it, as torch's BatchNorm loads its old versions).

    Dtype policy: statistics in float32 (float64 where x or a parameter is; never fp16/bf16: sums over positions
    overflow or round away); y in x's dtype under autocast too, as nn.BatchNorm2d (nn.GroupNorm writes float32);
    estimates stay float32 under ``model.half()`` (an r-sized update is below bf16's resolution).
    """
    _FIRST_STAGE = True  # per-channel statistics before the map (GN+PN: none)
    _SYNC_BATCH = False  # batch-mode statistics all-reduced with sync_stats (BCN)
    _ESTIMATE_BUFFERS = ('running_mean', 'running_var')  # float32 under .half() in estimate mode
    _version = 2  # 2: num_batches_tracked for every layer with a first stage (BCN's checkpoints of 1 lack it)

    def __new__(cls, *args, **kwargs):
        layer = super().__new__(cls)
        # reachable by the torch.compile operator: created, copied and unpickled layers all pass here
        from ..kernels.torch_op import register
        register(layer)
        return layer

    def _init_statnorm(self, num_features: int, mode: Optional[str], sync_stats: bool, fused: bool,
                       backend: Optional[str], momentum=None) -> None:
        self.mode, self.sync_stats, self.momentum = mode, bool(sync_stats), momentum
        self.fused = bool(fused)
        self.backend = check_backend(backend, f'{type(self).__name__} backend')
        self._estimates = Estimates()
        if self._FIRST_STAGE:  # 'batch': eval statistics; 'estimate': the estimates mu_hat, sigma_hat^2
            self.register_buffer('running_mean', torch.zeros(num_features))
            self.register_buffer('running_var', torch.ones(num_features))
            self.register_buffer('num_batches_tracked', torch.tensor(0, dtype=torch.long))

    def _reset_statnorm_buffers(self) -> None:
        self.running_mean.zero_()
        self.running_var.fill_(1.0)
        self.num_batches_tracked.zero_()

    def _buffers3(self):
        return self.running_mean, self.running_var, self._buffers.get('num_batches_tracked')

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, *args, **kwargs):
        self._estimates.reset()  # new estimates: the next call starts a new iteration from them
        key = prefix + 'num_batches_tracked'
        if self._FIRST_STAGE and local_metadata.get('version', 1) < 2 and key not in state_dict:
            state_dict[key] = torch.tensor(0, dtype=torch.long)  # as torch's _NormBase for its version 1
        return super()._load_from_state_dict(state_dict, prefix, local_metadata, *args, **kwargs)

    def _apply(self, fn, *args, **kwargs):
        if '_estimates' in self.__dict__:  # its tensors stay behind: start anew from the moved buffers
            self._estimates.reset()
        if getattr(self, 'mode', None) != 'estimate':
            return super()._apply(fn, *args, **kwargs)
        before = {n: self._buffers[n] for n in self._ESTIMATE_BUFFERS if self._buffers.get(n) is not None}
        out = super()._apply(fn, *args, **kwargs)
        for n, old in before.items():
            new = self._buffers[n]
            if new.dtype in _HALF:  # from the fp32 values: no rounding on the way
                self._buffers[n] = old.detach().to(device=new.device, dtype=torch.float32)
        return out

    @staticmethod
    def stat_dtype(*tensors: Optional[torch.Tensor]) -> torch.dtype:
        """The compute dtype of statistics over ``tensors``: float64 if any is float64, else float32."""
        for t in tensors:  # a loop, not any(generator): once per call, half the host time
            if t is not None and t.dtype == torch.float64:
                return torch.float64
        return torch.float32

    @staticmethod
    def compute_input(x: torch.Tensor) -> torch.Tensor:
        """x as the reference compositions compute on it: half inputs in float32, others as they are."""
        return x.float() if x.dtype in _HALF else x

    def _statnorm_act(self):
        return None

    def _output_dtype(self, x: torch.Tensor) -> torch.dtype:
        return x.dtype

    def _statnorm_dtypes(self, x: torch.Tensor) -> Tuple[torch.dtype, torch.dtype]:
        """(compute dtype, output dtype) by the dtype policy."""
        return self.stat_dtype(x, *self._statnorm_params()), self._output_dtype(x)

    def _statnorm_repr(self) -> str:
        return ('' if self.fused else ', fused=False') + (f', backend={self.backend!r}' if self.backend else '')

    def estimates_from_input(self, x: torch.Tensor):
        """This training call's estimates (mean, var) from x (N, C, ...): the reference compositions' first stage."""
        with torch.no_grad():
            xf = self.compute_input(x)
            x3 = xf.reshape(xf.shape[0], xf.shape[1], math.prod(xf.shape[2:]))
            if x3.numel():
                v, m = torch.var_mean(x3, dim=2, correction=0)
            else:  # no values (a RoI head without RoIs): a count of 0 below
                m = v = x3.new_zeros(x3.shape[:2])
            return self._estimates.estimates(m, v, x3.shape[2], self._buffers3(), self._rate, self.sync_stats)

    def _track(self, mean: torch.Tensor, var: torch.Tensor, count) -> None:
        """The running statistics after a batch of ``count`` values per channel (an int, or a tensor after an
        all-reduce), outside the backends (the collective path, the reference compositions)."""
        with torch.no_grad():
            nbt = self._buffers.get('num_batches_tracked')
            tracked(mean, var, count, self.momentum, nbt)(self.running_mean, self.running_var)
            if nbt is not None:
                nbt.add_(1)

    def _watch(self, y: torch.Tensor) -> torch.Tensor:
        """y, whose backward ends the iteration in estimate-mode training (under torch.compile the operator's
        backward does: a hook traced into a compiled backward cannot change Python state)."""
        if not (self.mode == 'estimate' and self.training):
            return y
        if torch.compiler.is_compiling() and self.__dict__.get('_op_marks_iteration', False):
            return y
        if y.requires_grad:
            y.register_hook(mark_on_backward)
        return y

    # --- forward --------------------------------------------------------------------------------------------
    def _export_form(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's ``_eval_form(x)`` (standard ops) while a graph is recorded; training mode is refused: a
        recorded graph cannot move statistics or estimates."""
        if self.training and self._FIRST_STAGE:
            raise ExportError(f'{type(self).__name__} exports in eval mode only (its training statistics and '
                               f'estimate updates cannot be recorded): call model.eval() before exporting')
        return self._eval_form(x)

    def _statnorm_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's output on a non-empty x (N, C, *positions), watched for the end of the iteration."""
        if torch.compiler.is_compiling():  # one opaque operator for the compiler
            from ..kernels.torch_op import compiled_call
            if self.mode == 'estimate' and self.training:
                self.__dict__['_op_marks_iteration'] = True  # its backward ends the iteration
            return self._watch(compiled_call(self, x))
        return self._statnorm_eager(x)

    def _statnorm_eager(self, x: torch.Tensor, keep: Optional[list] = None) -> torch.Tensor:
        """The output by the selected backend; with ``keep`` (the torch.compile operator) no autograd graph:
        (backward state, backward function) is appended to it."""
        be = _BACKENDS[selected_backend(self, x)]()
        try:
            with be.guard(x):
                return self._run(x, be, keep)
        except be.compile_errors() as e:  # under 'auto': the ATen backend takes this call and the next
            give_up_triton(self.backend, e)
            self._estimates.drop_unfilled()
        return self._run(x, AtenBackend, keep)

    def _run(self, x, be, keep):
        shape = x.shape
        params = tuple(self._statnorm_params())
        cd, out_dtype = self.stat_dtype(x, *params), self._output_dtype(x)
        with _no_autocast(x.device.type):
            x3 = x.reshape(shape[0], shape[1], -1)
            if x3.dtype != cd and x3.dtype not in _HALF:
                x3 = x3.to(cd)  # e.g. float32 x with float64 parameters
            x3, stats, kind, count, step = self._first_stage(be, x3)
            kernel = be.kernel_maps and kind != 'synced'  # the kernel maps take no all-reduced count
            maps = self._coeff_maps(kernel)
            call = _Call(be, maps, self._coeff_maps(False) if kernel else maps, kernel, kind, count,
                         self._statnorm_act(), out_dtype, self.backend, self.mode == 'estimate' and self.training)
            needs_grad = torch.is_grad_enabled() and (x.requires_grad or any(
                p is not None and p.requires_grad for p in params))
            if keep is not None:
                ctx = _OpContext(x3)
                y = _forward(ctx, x3, call, stats, params)
                keep.append((ctx, _op_backward))
                needs_grad = False
            elif not needs_grad:  # eval / no_grad: nothing kept
                y = be.apply(x3, stats, _map(call, stats, params, x3.shape[2])[0], call.act, out_dtype)[0]
            else:
                y = _StatNormFn.apply(x3, call, stats, *params)
        if step is not None:  # after the kernels: the iteration's total
            it, buffers = step
            self._estimates.end(it, stats.moved, x3.shape[0] * x3.shape[2], buffers)
        return self._watch(_reshaped_base(y, shape) if not needs_grad else y.view(shape))

    def _first_stage(self, be, x3):
        """(x3 as the backend reads it, :class:`Statistics`, kind, count, (the open iteration, the buffers) to close
        after the kernels or None)."""
        if not self._FIRST_STAGE:
            return (*be.first_stage(x3, StatsRequest()), 'none', None, None)
        rm, rv, nbt = self._buffers3()
        if not self.training:
            return (*be.first_stage(x3, StatsRequest(STATS_FIXED, rm, rv)), 'fixed', None, None)
        estimate = self.mode == 'estimate'
        if self.sync_stats and (estimate or self._SYNC_BATCH) and dist.is_available() and dist.is_initialized() \
                and dist.get_world_size() > 1:  # the collectives read m, v now
            x3, st = be.first_stage(x3, StatsRequest(), deferred=False)
            kind, mean, var, count = self._synced_stats(st.m, st.v, x3.shape[2])
            return x3, st._replace(mean=mean, var=var), kind, count, None
        count = x3.shape[0] * x3.shape[2]
        if estimate:  # Algorithm 1, once per iteration
            it, backward = self._estimates.begin((rm, rv, nbt), self._rate, deferred=True)
            first = it.total is None and not backward
            request = StatsRequest(STATS_ESTIMATE, rm, rv, it.base, it.rate, write=first, nbt=nbt if first else None)
            return (*be.first_stage(x3, request), 'fixed', None, None if backward else (it, (rm, rv, nbt)))
        backward = in_backward()  # a checkpoint's recomputation: the forward's values, no state change
        request = StatsRequest(STATS_BATCH, rm, rv, momentum=self.momentum, write=not backward,
                               nbt=None if backward else nbt)
        return (*be.first_stage(x3, request), 'batch', count, None)

    def _synced_stats(self, m, v, positions):
        """(kind, mean, var, count) across processes, the buffers moved."""
        if self.mode == 'estimate':
            mean, var = self._estimates.estimates(m, v, positions, self._buffers3(), self._rate, True)
            return 'fixed', mean.to(m.dtype), var.to(m.dtype), None
        mean, var, count = synced_batch_moments(m, v, positions)
        if not in_backward():
            self._track(mean, var, count)
        return 'synced', mean, var, count


# --- the autograd Function ------------------------------------------------------------------------------------
class _OpContext:
    """The torch.compile operator's stand-in for an autograd context."""
    needs_input_grad = (True, )

    def __init__(self, x3):
        self.saved_tensors = (x3, )


def _map(call: _Call, stats: Statistics, params, positions):
    """The coefficient map of this call (running a planned first stage in its launch)."""
    first = {} if stats.plan is None else {'first': stats.plan}
    return call.maps[0](stats.m, stats.v, stats.mean, stats.var, params, positions, call.count, **first)


def _forward(ctx, x3, call: _Call, stats: Statistics, params):
    coeffs, res = _map(call, stats, params, x3.shape[2])
    y, ctx.pc = call.backend.apply(x3, stats, coeffs, call.act, call.out_dtype)
    ctx.call, ctx.stats, ctx.res, ctx.params = call, stats._replace(update=None, plan=None, out=None), res, params
    ctx.param_dtypes = [None if p is None else p.dtype for p in params]
    return y


def _backward(ctx, x3, dy):
    """(dx, dparams) for dy in x3's shape and dtype."""
    call, stats, pc = ctx.call, ctx.stats, ctx.pc
    be, act = call.backend, call.act
    grads, state = be.sums(x3, dy, stats, pc, act, merged=not call.kernel_maps)
    # large N: the kernel maps may leave the sample blocks' partial sums (PendingSums) for dx's launch
    defer = {'defer': True} if call.kernel_maps else {}
    dm, dv, dmean, dvar, dparams = call.maps[1](ctx.res, grads, call.kind in ('batch', 'synced'), **defer)
    pending = dparams if isinstance(dparams, PendingSums) else None
    if pending is not None:
        dparams = pending.params
        if call.kind == 'synced' or not ctx.needs_input_grad[0]:  # no dx launch to sum them: torch does
            dmean, dvar = pending.finish()
            pending = None
    if call.kind == 'synced':  # every process joins the VJP's all-reduces, whether it needs dx or not
        dm, dv = synced_batch_moments_vjp(stats.m, stats.mean, call.count, x3.shape[2], dm, dv, dmean, dvar)
    dx = None
    if ctx.needs_input_grad[0]:
        batch = (stats.mean, dmean, dvar, 1.0 / x3.shape[0]) if call.kind == 'batch' else None
        dx = be.dx(x3, dy, stats, pc, dm, dv, grads[1], act, batch, state, pending)
    # d.to(t) costs about 2 us even where it returns d
    dparams = [None if d is None or t is None else d if d.dtype == t else d.to(t)
               for d, t in zip(dparams, ctx.param_dtypes)]
    return dx, dparams


def _backward_or_fallback(ctx, dy):
    x3, = ctx.saved_tensors
    be = ctx.call.backend
    with _no_autocast(x3.device.type):
        dy = be.grad_layout(dy.reshape(x3.shape), x3)  # dy may be expanded (the grad of a sum); once for both passes
        try:
            with be.guard(x3):  # autograd may run the backward with another device current
                return _backward(ctx, x3, dy)
        except be.compile_errors() as e:  # a backward kernel failed to compile: ATen, from the same statistics
            give_up_triton(ctx.call.option, e)
            ctx.call = call = ctx.call._replace(backend=AtenBackend, maps=ctx.call.torch_maps, kernel_maps=False)
            stats = ctx.stats
            coeffs, ctx.res = call.maps[0](stats.m, stats.v, stats.mean, stats.var, ctx.params, x3.shape[2],
                                           call.count)
            ctx.pc = AtenBackend.prepare(coeffs, stats.v)
            return _backward(ctx, x3, dy)


def _op_backward(ctx, dy):
    """The torch.compile operator's backward of a forward it ran with ``keep``."""
    out = _backward_or_fallback(ctx, dy)
    if ctx.call.ends_iteration:  # as the hook of StatNorm2d._watch in eager mode
        mark_iteration()
    return out


class _StatNormFn(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x3, call, stats, *params):
        ctx.save_for_backward(x3)  # x only: channel-sized tensors are kept as attributes
        return _forward(ctx, x3, call, stats, params)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        dx, dparams = _backward_or_fallback(ctx, dy)
        return (dx, None, None, *dparams)


def _reshaped_base(y: torch.Tensor, shape) -> torch.Tensor:
    """y in ``shape`` as a tensor of its own, not a view, in y's memory format: under no_grad (a reentrant
    checkpoint's forward, mmdet's ``with_cp``) a view could not be modified in place (a residual ``+=``)."""
    try:
        strides = y.view(shape).stride()
    except RuntimeError:  # not viewable in that shape: a copy, a tensor of its own anyway
        return y.reshape(shape)
    return y.new_empty(0).set_(y.untyped_storage(), y.storage_offset(), shape, strides)
