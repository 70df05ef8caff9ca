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
from typing import Any, NamedTuple, Optional

import torch
import torch.distributed as dist

from ..errors import ExportError
from ..kernels import backend as _backend
from ..kernels.aten import AtenBackend
from ..kernels.backend import (STATS_BATCH, STATS_ESTIMATE, STATS_FIXED, Maps, PendingSums, StatsRequest,
                               autocast_off, exporting, give_up_triton, ncl)
from ._distributed import synced_batch_moments, synced_batch_moments_vjp
from ._estimate import _TASK_ID, _TOKEN, in_backward, mark_iteration, mark_on_backward
from ._statnorm_graph import graph_backward, tensor_stats
from ._statnorm_plan import _Plan, plan_for
from ._statnorm_state import StatNormState

_DIST = dist.is_available()
_unwrap_if_dead = getattr(getattr(torch._C, '_functorch', None), 'unwrap_if_dead', None)
# attributes a layer sets per iteration or step: they do not change its plans
_PER_CALL = frozenset(('training', 'current_rate'))


class _Call(NamedTuple):  # a NamedTuple: a frozen dataclass's __init__ costs 3x more per call
    """What the Function's forward and backward need of one call besides tensors."""
    plan: _Plan
    maps: Maps  # the maps this call runs (the torch ones for all-reduced statistics)
    kernel: bool  # maps are the layer's kernel transcriptions
    kind: str  # the statistics: 'none' | 'fixed' | 'batch' | 'synced'
    count: Any  # values per channel behind batch statistics (an int, a tensor when all-reduced), else None
    option: Optional[str]  # the layer's backend option (a failed compile under 'auto' falls back)
    ends_iteration: bool  # estimate mode in training: the backward ends the iteration


def _launch_key(device, serial, x3, params, mode=()):
    """The call's launch-cache key (``kernels/launch.py``): what fixes every kernel's specialization besides the
    plan (the configuration, the buffers' dtypes): x's shape, strides and dtype, the parameters' dtypes, then
    ``mode`` (the first stage's). None where x or a parameter is not 16-byte aligned (the kept kernels assume the
    alignment the first launch saw; what the engine allocates is aligned, and so are buffers, which it never
    replaces by views)."""
    if x3.data_ptr() & 15:
        return None
    key = (device, serial, x3.shape, x3.stride(), x3.dtype)
    for t in params:
        if t is None:
            key += (None, )
        elif t.data_ptr() & 15:
            return None
        else:
            key += (t.dtype, )
    return key + mode


class StatNorm2d(StatNormState):
    """Base class of BCN, GN+PN and Unitization: ``forward`` and the engine, on their flags, buffers and dtype
    policy (:class:`StatNormState`, ``_statnorm_state.py``).

    ``forward`` (as torch's ``_BatchNorm.forward``) checks the input (``_check_input``), runs the modules of the
    layer's inference form (``eval_form()``, ``layers/eval_form.py``) while a graph is recorded for export, the
    engine where it applies (``fused`` and ``_fusable(x)``), else the layer's reference composition (``_reference``).

    A layer calls :meth:`_init_statnorm` in its constructor and supplies data: ``_statnorm_params()`` (tensors or
    None, in order), ``_coeff_maps(kernel)`` (its pure map and closed-form VJP, torch or kernel, bound to its
    configuration), ``_statnorm_act()`` and ``eval_form(dtype)``::

        coeff_map(m, v, mean, var, params, positions, count) -> ((A, B[, K, L]), residuals)
        coeff_vjp(residuals, grads, wants_stats) -> (dm, dv, dmean, dvar, dparams)

    ``mean, var``: (C,) or None; ``count``: the values per channel behind batch statistics (an int, a tensor
    when all-reduced) or None; dmean, dvar only when ``wants_stats``.
    """

    def __new__(cls, *args, **kwargs):
        layer = super().__new__(cls)
        # reachable by the torch.compile operator: created, copied and unpickled layers all pass here
        from ..kernels.torch_op import register
        register(layer)
        return layer

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if name not in _PER_CALL:  # a configuration, parameter or buffer changed: plan anew
            self.__dict__['_plans'] = {}

    def __getstate__(self):
        state = self.__dict__.copy()
        state['_plans'] = {}  # a plan is made for this process (a backend's activation form holds lambdas)
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self.__dict__['_plans'] = {}  # checkpoints and copies pickled before plans existed have none

    def _apply(self, fn, *args, **kwargs):
        self.__dict__['_plans'] = {}  # new dtypes or devices
        return super()._apply(fn, *args, **kwargs)

    def _statnorm_act(self):
        return None

    def _watch(self, y: torch.Tensor) -> torch.Tensor:
        """y, whose backward ends the iteration in estimate-mode training (the reference compositions; the engine's
        Function ends it in its backward; under torch.compile the operator's backward does: a hook traced into a
        compiled backward cannot change Python state)."""
        if not (self.mode == 'estimate' and self.training):
            return y
        if torch.compiler.is_compiling() and self.__dict__.get('_op_marks_iteration', False):
            return y
        if y.requires_grad:
            y.register_hook(mark_on_backward)
        return y

    # --- forward --------------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        compiling = torch.compiler.is_compiling()
        if exporting(compiling):  # a graph recorded for another runtime: standard ops, eval mode only
            return self._export_form(x)
        # under torch.func's transforms (vmap, grad, jacrev, ...): the reference composition, which they see through
        if self.fused and self._fusable(x) and (compiling or not _transforms_active()):
            return self._statnorm_forward(x, compiling)
        if not compiling and self.training and self._FIRST_STAGE and _transforms_active():
            _refuse_vmap_in_training(self)
        return self._reference(x)

    def _check_input(self, x: torch.Tensor) -> None:
        """A one-line ValueError for an input the layer does not take."""

    def _fusable(self, x: torch.Tensor) -> bool:
        """Whether the engine computes this call (else the reference composition: empty inputs, ...)."""
        return x.numel() > 0

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's output by its reference composition of torch ops (``fused=False``)."""
        raise NotImplementedError

    def _export_form(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's ``_eval_form(x)`` while a graph is recorded; training mode is refused: a recorded graph cannot
        move statistics or estimates."""
        if self.training and self._FIRST_STAGE:
            raise ExportError(f'{type(self).__name__} exports in eval mode only (its training statistics and '
                               f'estimate updates cannot be recorded): call model.eval() before exporting')
        return self._eval_form(x)

    def _eval_form(self, x: torch.Tensor) -> torch.Tensor:
        """The eval output by the modules of ``eval_form()``, its constants in the statistics' compute dtype (what
        an export records: standard ops only)."""
        xf = self.compute_input(x)
        return self.eval_form(self.stat_dtype(xf, *self._statnorm_params())).module()(xf).to(x.dtype)

    def _statnorm_forward(self, x: torch.Tensor, compiling: Optional[bool] = None) -> torch.Tensor:
        """The layer's output on a non-empty x (N, C, *positions) by the engine."""
        if torch.compiler.is_compiling() if compiling is None else compiling:  # one opaque operator for the compiler
            from ..kernels.torch_op import compiled_call
            if self.mode == 'estimate' and self.training:
                self.__dict__['_op_marks_iteration'] = True  # its backward ends the iteration
            return self._watch(compiled_call(self, x))
        plan = self.__dict__['_plans'].get((x.dtype, x.device, _backend._STATE['broken']))
        # the direct route (Triton, x's device current, no collectives): no context to enter
        if plan is not None and plan.direct and (plan.device is None or plan.device < 0
                                                 or plan.device == _backend.current_device()) \
                and not (self.sync_stats and _DIST and dist.is_initialized()):
            try:
                return self._run(x, plan, None, False)
            except plan.errors as e:  # under 'auto': the ATen backend takes this call and the next
                give_up_triton(self.backend, e)
                self._estimates.drop_unfilled()
        return self._statnorm_eager(x)

    def _plan(self, x: torch.Tensor) -> _Plan:
        """This layer's :class:`_Plan` for x's dtype and device (made on the first such call; shared by the
        layers of one configuration: ``_statnorm_plan.py``)."""
        key = (x.dtype, x.device, _backend._STATE['broken'])
        plan = self.__dict__['_plans'].get(key)
        if plan is None:
            plan = self.__dict__['_plans'][key] = plan_for(self, x, key)
        return plan

    def _statnorm_eager(self, x: torch.Tensor, keep: Optional[list] = None, plan: Optional[_Plan] = None):
        """The output by the layer's backend; with ``keep`` (the torch.compile operator) no autograd graph:
        (backward state, backward function) is appended to it."""
        if plan is None:
            plan = self._plan(x)
        # the collectives read m, v: torch code between the passes
        synced = self.sync_stats and _DIST and dist.is_initialized() and dist.get_world_size() > 1
        try:
            if plan.device is not None and plan.device >= 0 and plan.device != _backend.current_device():
                with torch.cuda.device(plan.device):  # Triton launches on the current device and stream
                    return self._run_autocast(x, plan, keep, synced)
            return self._run_autocast(x, plan, keep, synced)
        except plan.errors as e:  # under 'auto': the ATen backend takes this call and the next
            give_up_triton(self.backend, e)
            self._estimates.drop_unfilled()
        return self._run_autocast(x, self._plan(x), keep, synced)

    def _run_autocast(self, x, plan: _Plan, keep, synced):
        if plan.direct and not synced:  # no torch code between the passes: autocast as it is (no context)
            return self._run(x, plan, keep, synced)
        with autocast_off(x.device.type):  # torch code between the passes
            return self._run(x, plan, keep, synced)

    def _run(self, x, plan: _Plan, keep, synced):
        params = self._statnorm_params()
        needs_grad = x.requires_grad
        for p in params:
            if p is not None and p.requires_grad:
                needs_grad = True
        if keep is None and needs_grad and torch.is_grad_enabled():
            if plan.direct:  # the C entry: Function.apply's Python (bound arguments, dead-wrapper unwrapping) skipped
                return _base_apply(x if _unwrap_if_dead is None else _unwrap_if_dead(x), self, plan, synced, *params)
            shape = x.shape  # ATen: y in the moments' storage (N, C, L), viewed in x's shape outside
            x3 = x.reshape(shape[0], shape[1], -1)
            y = _base_apply(x3 if _unwrap_if_dead is None else _unwrap_if_dead(x3), self, plan, synced, *params)
            y = y.view(*shape)
            return y if x.is_contiguous() else _in_layout_of(y, x)
        if keep is None:  # eval / no_grad: nothing kept
            y = self._step(None, x, plan, synced, params)
            return y if plan.direct or x.is_contiguous() else _in_layout_of(y, x)
        ctx = _OpContext()
        y = self._step(ctx, x, plan, synced, params)
        keep.append((ctx, _op_backward))
        return y

    def _step(self, ctx, x, plan: _Plan, synced: bool, params):
        """y in x's shape, a tensor of its own (not a view: a residual ``+=`` modifies it in place): the first
        stage, the coefficient map, the output pass; with ``ctx`` (the Function's) what the backward needs."""
        shape = x.shape
        # the kernel maps' backend takes x as it is (an (N, C, L) view costs a step ~4 us), ATen the view (made
        # by _run already where the Function takes x)
        x3 = view = x if plan.direct or len(shape) == 3 else x.reshape(shape[0], shape[1], -1)
        if plan.convert:
            x3 = view = x3.to(plan.cd)  # e.g. float32 x with float64 parameters
        key = None
        if plan.device is not None:
            # the first stage's mode fixes the rest of the kernels' specializations
            mode = (self.training, self.mode, self.sync_stats, self.momentum is None) if self._FIRST_STAGE else ()
            key = _launch_key(plan.device, plan.serial, x3, params, mode)
        n, _, length = ncl(x)
        x3, stats, kind, count, step = self._first_stage(plan.backend, x3, key, synced, n * length,
                                                         plan.kernel_maps is not None)
        kernel = plan.kernel_maps is not None and kind != 'synced'  # the kernel maps take no all-reduced count
        call = _Call(plan=plan, maps=plan.kernel_maps if kernel else plan.torch_maps, kernel=kernel, kind=kind,
                     count=count, option=self.backend, ends_iteration=self.mode == 'estimate' and self.training)
        if stats.first is None:
            coeffs, res = call.maps.coeff_map(stats.m, stats.v, stats.mean, stats.var, params, length, count)
        else:  # the deferred first stage runs in the map's launch
            coeffs, res = call.maps.coeff_map(stats.m, stats.v, stats.mean, stats.var, params, length, count,
                                              first=stats.first)
        y4 = out = None
        if plan.direct and x3 is view:  # the output in x's shape and layout (x3 is x, or x converted)
            y4 = out = torch.empty_like(x) if plan.out_dtype == x.dtype else \
                torch.empty_like(x, dtype=plan.out_dtype)
        y, pc = plan.backend.apply(x3, stats, coeffs, plan.act, plan.out_dtype, out)
        if ctx is not None:
            # the input only (channel-sized tensors are kept as attributes): a double backward differentiates
            # through it, and where the passes read a copy (a dtype or layout they take) the backward makes it again
            ctx.save_for_backward(x)
            ctx.call, ctx.res, ctx.params, ctx.pc, ctx.shape = call, res, params, pc, shape
            ctx.remake = x3 is not x
            # without the output storage (not kept alive); a deferred stage stays (its outputs, its geometry; the
            # backend drops its partials once they are read)
            ctx.stats = stats if stats.out is None else stats._replace(update=None, out=None)
        if step is not None:  # after the kernels: the iteration's total
            it, buffers = step
            self._estimates.end(it, stats.moved, n * length, buffers)
        if out is not None and y is out:
            return y4
        return y if y.dim() == len(shape) else _reshaped_base(y, shape)

    def _first_stage(self, be, x3, key, synced, count, deferred=True):
        """(x3 as the backend reads it, :class:`Statistics`, kind, count, (the open iteration, the buffers) to close
        after the kernels or None); ``count``: x3's values per channel, N L; ``deferred``: a kernel map runs the
        statistics in its own launch where the backend can (else they are computed now: torch maps read them)."""
        if not self._FIRST_STAGE:
            return (*be.first_stage(x3, StatsRequest(key=key), deferred), 'none', None, None)
        b = self._buffers
        rm, rv, nbt = b['running_mean'], b['running_var'], b.get('num_batches_tracked')
        if not self.training:
            return (*be.first_stage(x3, StatsRequest(STATS_FIXED, stat_mean=rm, stat_var=rv, key=key), deferred),
                    'fixed', None, None)
        estimate = self.mode == 'estimate'
        if synced and (estimate or self._SYNC_BATCH):  # the collectives read m, v now
            x3, st = be.first_stage(x3, StatsRequest(key=key and key + ('synced', )), deferred=False)
            kind, mean, var, count = self._synced_stats(st.m, st.v, ncl(x3)[2])
            return x3, st._replace(mean=mean, var=var), kind, count, None
        if estimate:  # Algorithm 1, once per iteration
            it, backward = self._estimates.begin((rm, rv, nbt), self._rate, deferred=True)
            first = it.total is None and not backward
            request = StatsRequest(STATS_ESTIMATE, stat_mean=rm, stat_var=rv, base=it.base, rate=it.rate, write=first,
                                   nbt=nbt if first else None, key=key and key + (first, ))
            return (*be.first_stage(x3, request, deferred), 'fixed', None, None if backward else (it, (rm, rv, nbt)))
        # a checkpoint's recomputation (in_backward(), inlined: two calls a step): no state change
        backward = _TASK_ID is not None and _TASK_ID() != -1
        request = StatsRequest(STATS_BATCH, stat_mean=rm, stat_var=rv, momentum=self.momentum, write=not backward,
                               nbt=None if backward else nbt, key=key and key + (backward, ))
        return (*be.first_stage(x3, request, deferred), 'batch', count, None)

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

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


def _backward(ctx, x3, dy):
    """(dx, dparams) for dy in x3's shape and dtype (x3: (N, C, L), or x itself on the kernel maps' backend)."""
    call, stats, pc = ctx.call, ctx.stats, ctx.pc
    be, act = call.plan.backend, call.plan.act
    grads, state = be.sums(x3, dy, stats, pc, act, not call.kernel)
    if call.kernel:  # large N: the kernel maps may leave the sample blocks' partial sums for dx's launch
        dm, dv, dmean, dvar, dparams = call.maps.coeff_vjp(ctx.res, grads, call.kind == 'batch', defer=True)
    else:
        dm, dv, dmean, dvar, dparams = call.maps.coeff_vjp(ctx.res, grads, call.kind in ('batch', 'synced'))
    pending = dparams if isinstance(dparams, PendingSums) else None
    if pending is not None:
        dparams = pending.params
        if call.kind == 'synced' or not ctx.needs_input_grad[0]:  # no dx launch to sum them: torch does
            dmean, dvar = pending.finish()
            pending = None
    if call.kind == 'synced':  # every process joins the VJP's all-reduces, whether it needs dx or not
        dm, dv = synced_batch_moments_vjp(stats.m, stats.mean, call.count, ncl(x3)[2], dm, dv, dmean, dvar)
    dx = None
    if ctx.needs_input_grad[0]:
        batch = (stats.mean, dmean, dvar, 1.0 / x3.shape[0]) if call.kind == 'batch' else None
        dx = be.dx(x3, dy, stats, pc, dm, dv, grads, act, batch, state, pending)
    for d, p in zip(dparams, ctx.params):
        if (d is None) != (p is None) or d is not None and d.dtype != p.dtype:
            break
    else:  # each in its parameter's dtype already (the kernel maps write them so): as they are
        return dx, dparams
    out = []
    for d, p in zip(dparams, ctx.params):  # d.to(p) costs about 2 us even where it returns d
        out.append(None if d is None or p is None else d if d.dtype == p.dtype else d.to(p.dtype))
    return dx, out


def _backward_or_fallback(ctx, dy):
    """(dx, dparams): the backward in x's layout, on x's device, autocast off around torch code; a backward
    kernel that fails to compile (under 'auto'): ATen, from the same statistics."""
    x3, = ctx.saved_tensors
    call = ctx.call
    plan = call.plan
    if ctx.remake:  # x3 as the forward's passes read it
        x3 = _passes_input(x3, plan)
    dy = plan.backend.grad_layout(dy, x3)  # dy may be expanded (a sum's grad); once for both passes
    try:
        if not call.kernel:  # torch code between the passes
            with autocast_off(x3.device.type):
                return _backward(ctx, x3, dy)
        if plan.device is not None and plan.device >= 0 and plan.device != _backend.current_device():
            with torch.cuda.device(plan.device):  # autograd may run the backward with another device current
                return _backward(ctx, x3, dy)
        return _backward(ctx, x3, dy)
    except plan.errors as e:
        give_up_triton(call.option, e)
        n, c, length = ncl(x3)
        x3 = x3.reshape(n, c, length)  # the Triton path's x3 may be x itself
        aten = plan._replace(backend=AtenBackend, errors=(), kernel_maps=None, device=None, direct=False,
                             act=plan.activation)
        ctx.call = call = call._replace(plan=aten, maps=plan.torch_maps, kernel=False)
        stats = ctx.stats = tensor_stats(ctx.stats)
        coeffs, ctx.res = call.maps.coeff_map(stats.m, stats.v, stats.mean, stats.var, ctx.params, length, call.count)
        ctx.pc = AtenBackend.prepare(coeffs, stats.v)
        with autocast_off(x3.device.type):  # dy as ATen's passes take it (x3's dtype: x converted for the plan)
            return _backward(ctx, x3, AtenBackend.grad_layout(dy, x3))


def _op_backward(ctx, dy):
    """The torch.compile operator's backward of a forward it ran with ``keep``."""
    out = _backward_or_fallback(ctx, dy)
    if ctx.call.ends_iteration:  # as the engine's Function in eager mode
        mark_iteration()
    return out


class _StatNormFn(torch.autograd.Function):
    """The engine's one autograd Function: x (the layer's input) and the parameters in, y out; the backward's
    state on ``ctx`` (``StatNorm2d._step``)."""

    @staticmethod
    def forward(ctx, x, layer, plan, synced, *params):
        return layer._step(ctx, x, plan, synced, params)

    @staticmethod
    def backward(ctx, dy):
        grad_mode = torch.is_grad_enabled()  # create_graph
        if grad_mode or _is_legacy_batched(dy) or _transforms_active():  # batched cotangents: is_grads_batched
            return _graph_backward(ctx, dy, grad_mode)
        return _plain_backward(ctx, dy)


def _plain_backward(ctx, dy):
    dx, dparams = _backward_or_fallback(ctx, dy)
    if ctx.call.ends_iteration:  # gradients flowed back through an estimate-mode layer: the iteration ends
        _TOKEN[0] += 1  # mark_iteration(), inlined
    if dx is not None and dx.dim() != len(ctx.shape):  # dx in x3's shape (the Triton passes write x's)
        dx = dx.view(*ctx.shape)
    return (dx, None, None, None, *dparams)


def _graph_backward(ctx, dy, create_graph):
    """The backward as autograd of the call's torch composition (``_statnorm_graph.py``): differentiable, and
    batched cotangents welcome; the estimate iteration ends as in the plain backward."""
    x, = ctx.saved_tensors
    with autocast_off(x.device.type):
        dx, dparams = graph_backward(ctx, x, dy, create_graph)
    if ctx.call.ends_iteration:
        mark_iteration()
    return (dx, None, None, None, *dparams)


def _passes_input(x, plan: _Plan):
    """x3 as the forward's passes read it, made again from the Function's input x: in the compute dtype, (N, C, L)
    on the ATen path, in a layout the passes read."""
    x3 = x if plan.direct or x.dim() == 3 else x.reshape(*ncl(x))
    if plan.convert:
        x3 = x3.to(plan.cd)
    return plan.backend.read_input(x3)


_is_legacy_batched = torch._C._functorch.is_legacy_batchedtensor
_transforms_active = torch._C._are_functorch_transforms_active
_base_apply = super(torch.autograd.Function, _StatNormFn).apply  # the C apply: Function.apply's Python skipped


def _in_layout_of(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The ATen path's output (NCHW: its passes read (N, C, L) rows) in x's memory format where x is channels_last,
    as nn.BatchNorm2d and nn.GroupNorm return it."""
    if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last):
        return y.contiguous(memory_format=torch.channels_last)
    return y


def _refuse_vmap_in_training(layer) -> None:
    """A one-line error for vmap over a training call: the statistics update buffers in place, which vmap cannot
    batch (torch refuses nn.BatchNorm2d so too)."""
    from torch._C._functorch import TransformType, get_interpreter_stack
    if any(i.key() == TransformType.Vmap for i in get_interpreter_stack() or ()):
        raise RuntimeError(f'{type(layer).__name__} under torch.func.vmap in training mode: its training call '
                           f'updates the running statistics in place, which vmap cannot batch; call .eval() first '
                           f'(eval uses fixed statistics), or take the statistics out of the vmapped function')


def _reshaped_base(y: torch.Tensor, shape) -> torch.Tensor:
    """y in ``shape`` as a tensor of its own, not a view, in y's memory format: under no_grad (a reentrant
    checkpoint's forward, mmdet's ``with_cp``) a view could not be modified in place (a residual ``+=``)."""
    try:
        strides = y.view(*shape).stride()
    except RuntimeError:  # not viewable in that shape: a copy, a tensor of its own anyway
        return y.reshape(shape)
    return y.new_empty(0).set_(y.untyped_storage(), y.storage_offset(), shape, strides)
