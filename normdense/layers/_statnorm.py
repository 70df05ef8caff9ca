"""The StatNorm engine: the training/eval pipeline of the norms that are "per-(sample, channel) moments, then a
per-(sample, channel) map" (BCN, GN+PN, Unitization). For x viewed as (N, C, L) with L positions:

    m, v           = mean and biased variance of x[n, c, :]                  backend.moments / stats
    mean, var      = the first stage's per-channel statistics                 here, once per forward
    A, B [, K, L'] = coeff_map(m, v, mean, var, parameters)                  the layer's file: pure, (N, C)
    y              = A (x - m) + B    or    K act(A (x - m) + B) + L'        backend.apply

``mean, var`` are the running estimates (estimate mode, Algorithm 1 of arXiv:1903.10520, moved once per
training iteration: ``_estimate.py``), the running statistics (eval) or the batch moments (batch mode,
all-reduced across processes with ``sync_stats``; the running statistics tracked). The backend computes them
from m, v in its stats step (the Triton backend in its stats kernel); the collectives of ``sync_stats`` are
torch code here, between the same backend steps. Backward, with t = x - m, dm/dx = 1/L, dv/dx = 2 t / L:

    dx = A g + (2 dv t + dm - A sum_l g) / L,     g = dy     (g = dy K act'(A t + B) with an activation)

where dm, dv and the parameter gradients are the layer's closed-form ``coeff_vjp`` of the channel-sized sums
(backend.sums), plus, in batch mode, the VJP of the batch statistics. Only x (in its own dtype) and
channel-sized tensors are kept for backward: the activation memory of one nn.GroupNorm.

The backends (``normdense/kernels/aten.py``, ``triton.py``) and the torch.compile operator
(``kernels/torch_op.py``) import nothing from ``layers/``; one autograd Function (:class:`_StatNormFn`) runs
either, and only tensors and plain values cross it.
"""
import types
from typing import Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from ..errors import ExportError
from ..kernels import backend as _backend
from ..kernels.aten import STATS_BATCH, STATS_ESTIMATE, STATS_FIXED, AtenBackend, tracked
from ..kernels.backend import check_backend, selected_backend
from ._estimate import in_backward, mark_iteration, watch_backward, world_size

_HALF = (torch.float16, torch.bfloat16)


class StatNorm2d(nn.Module):
    """Base class of BCN, GN+PN and Unitization: their flags, buffers, dtype policy and the engine.

    A layer calls :meth:`_init_statnorm` in its constructor and defines ``_statnorm_params()`` (the parameters
    its coefficients depend on, tensors or None, in order) and ``_coeff_maps(triton)``: the pure coefficient
    map and its closed-form VJP as plain callables (its file's functions bound to its configuration, or their
    Triton transcriptions)::

        coeff_map(m, v, mean, var, params, positions, count) -> ((A, B[, K, L]), residuals)
        coeff_vjp(residuals, grads, wants_stats) -> (dm, dv, dmean, dvar, dparams)

    ``mean, var`` are (C,) or None without a first stage; ``count`` the values per channel behind batch
    statistics (an int, a tensor when all-reduced, None otherwise); dmean, dvar only when ``wants_stats``.

    Buffers (layers with a first stage; GN+PN has none, so no statistics and no counter): ``running_mean``,
    ``running_var`` (the running statistics, or the estimates in estimate mode) and ``num_batches_tracked``
    (training iterations in estimate mode, training calls in batch mode); a checkpoint without the counter
    (BCN before issue 37) loads with 0, as torch's BatchNorm loads its old versions.

    Dtype policy, here only (the engine, the reference compositions and the estimates' owner call these):

    * statistics never run in fp16/bf16 (sums over positions overflow or round away): the compute dtype is
      float64 where the input or a parameter is float64, else float32 (:meth:`stat_dtype`); the reference
      compositions take half inputs in float32 (:meth:`compute_input`);
    * the output keeps the input's dtype, under autocast too: statistics in float32 (float64 for float64),
      y written once in x's dtype, as nn.BatchNorm2d does under autocast. nn.GroupNorm's autocast policy
      returns float32 for a half input instead (twice the bytes written, and a float32 dy to read back);
      the reference compositions cast to x's dtype so both paths give the same dtype;
    * estimate-mode estimates stay float32 when the module is cast to fp16/bf16 (``model.half()``): an update
      of ``r * delta`` with r ~ lr is below bf16's resolution and would be lost to rounding (:meth:`_apply`).
    """
    _FIRST_STAGE = True  # per-channel statistics before the map (GN+PN: none)
    _SYNC_BATCH = False  # batch-mode statistics all-reduced with sync_stats (BCN)
    _ESTIMATE_BUFFERS = ('running_mean', 'running_var')  # float32 under .half() in estimate mode
    _version = 2  # 2: num_batches_tracked for every layer with a first stage (BCN's checkpoints of 1 lack it)

    def _init_statnorm(self, num_features: int, mode: Optional[str], sync_stats: bool, fused: bool,
                       backend: Optional[str], momentum=None) -> None:
        self.mode, self.sync_stats, self.momentum = mode, bool(sync_stats), momentum
        self.fused = bool(fused)
        self.backend = check_backend(backend, f'{type(self).__name__} backend')
        if self._FIRST_STAGE:  # 'batch': eval statistics; 'estimate': the estimates mu_hat, sigma_hat^2
            self.register_buffer('running_mean', torch.zeros(num_features))
            self.register_buffer('running_var', torch.ones(num_features))
            self.register_buffer('num_batches_tracked', torch.tensor(0, dtype=torch.long))

    def _reset_statnorm_buffers(self) -> None:
        self.running_mean.zero_()
        self.running_var.fill_(1.0)
        self.num_batches_tracked.zero_()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, *args, **kwargs):
        key = prefix + 'num_batches_tracked'
        if self._FIRST_STAGE and local_metadata.get('version', 1) < 2 and key not in state_dict:
            state_dict[key] = torch.tensor(0, dtype=torch.long)  # as torch's _NormBase for its version 1
        return super()._load_from_state_dict(state_dict, prefix, local_metadata, *args, **kwargs)

    def _apply(self, fn, *args, **kwargs):
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
        return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32

    @staticmethod
    def compute_input(x: torch.Tensor) -> torch.Tensor:
        """x as the reference compositions compute on it: half inputs in float32, others as they are."""
        return x.float() if x.dtype in _HALF else x

    def _statnorm_act(self):
        return None

    def _output_dtype(self, x: torch.Tensor) -> torch.dtype:
        return x.dtype  # the class docstring's dtype policy

    def _statnorm_dtypes(self, x: torch.Tensor) -> Tuple[torch.dtype, torch.dtype]:
        """(compute dtype, output dtype) of the engine: the class docstring's policy over x and the parameters."""
        return self.stat_dtype(x, *self._statnorm_params()), self._output_dtype(x)

    def _statnorm_repr(self) -> str:
        return ('' if self.fused else ', fused=False') + (f', backend={self.backend!r}' if self.backend else '')

    # --- forward --------------------------------------------------------------------------------------------
    def _export_form(self, x: torch.Tensor) -> torch.Tensor:
        """The output while the model is exported (``_utils.exporting``): the layer's ``_eval_form(x)``, eval
        mode's output as a short composition of standard ops that ONNX translates. Training-mode export of a
        layer with a first stage is refused: a recorded graph cannot move statistics or estimates."""
        if self.training and self._FIRST_STAGE:
            raise ExportError(f'{type(self).__name__} exports in eval mode only (its training statistics and '
                               f'estimate updates cannot be recorded): call model.eval() before exporting')
        return self._eval_form(x)

    def _statnorm_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's output on a non-empty x (N, C, *positions)."""
        if torch.compiler.is_compiling():  # one opaque operator for the compiler
            from ..kernels.torch_op import compiled_call
            if self.mode == 'estimate' and self.training:
                self.__dict__['_op_marks_iteration'] = True  # its backward ends the iteration
            return compiled_call(self, x)
        return self._statnorm_eager(x)

    def _statnorm_eager(self, x: torch.Tensor, keep: Optional[list] = None) -> torch.Tensor:
        """The output by the selected backend. ``keep`` (a list): no autograd graph; (backward state, backward
        function) is appended to it instead (the torch.compile operator)."""
        if selected_backend(self, x) == 'triton':
            from ..kernels.triton import TritonBackend  # triton imported only when it runs
            try:
                with _backend.device_guard(x):  # every launch on x's device and its current stream
                    return self._run(x, TritonBackend, keep)
            except _backend.compile_errors() as e:  # under 'auto': the ATen backend takes this call and the next
                _backend.give_up_triton(self.backend, e)
                st = self.__dict__.get('_iteration')
                if st is not None and st.total is None:  # opened by this call, its base never filled
                    self.__dict__.pop('_iteration')
        return self._run(x, AtenBackend, keep)

    def _run(self, x, be, keep):
        shape = x.shape
        cd, out_dtype = self._statnorm_dtypes(x)
        with torch.autocast(x.device.type, enabled=False):
            x3 = x.reshape(shape[0], shape[1], -1)
            if x3.dtype != cd and x3.dtype not in _HALF:
                x3 = x3.to(cd)  # e.g. float32 x with float64 parameters
            # Triton reads (N, C, L) and channels_last (N, L, C) layouts in place; anything else (a permuted
            # view, ATen's row kernels) is made contiguous: a copy
            x3 = be.layout(x3)
            part = be.moments(x3)
            m, v, stats, write, nbt, record, first = self._first_stage(be, part, x3.shape)
            params = tuple(self._statnorm_params())
            # the layer's Triton maps, or its torch ones where the statistics come from a collective
            triton = be is not AtenBackend and not isinstance(stats[3], torch.Tensor)
            call = types.SimpleNamespace(
                backend=be, maps=self._coeff_maps(triton), fallback_maps=self._coeff_maps(False) if triton else None,
                triton_maps=triton,
                option=self.backend, act=self._statnorm_act(), m=m, v=v, stats=stats, out_dtype=out_dtype,
                fold={} if first is None else {'first': first},
                ends_iteration=self.mode == 'estimate' and self.training)
            effects = [write, nbt, part[2] if be is AtenBackend else None]  # the last: storage y may take
            needs_grad = torch.is_grad_enabled() and (x.requires_grad or any(
                p is not None and p.requires_grad for p in params))
            if keep is not None:
                ctx = types.SimpleNamespace(needs_input_grad=(True, ))
                y = _forward(ctx, x3, call, effects, params)
                ctx.saved_tensors = (x3, )
                keep.append((ctx, _op_backward))
                needs_grad = False
            elif not needs_grad:  # eval / no_grad: nothing kept
                coeffs = call.maps[0](m, v, stats[1], stats[2], params, x3.shape[2], stats[3], **call.fold)[0]
                y = be.apply(x3, m, v, be.prepare(coeffs, v), call.act, out_dtype, *effects)
            else:  # the list: a tensor argument returned as the output would make the output a view of an input
                y = _StatNormFn.apply(x3, call, effects, *params)
        if record is not None:
            record()  # after the kernels ran: the iteration's bookkeeping in Python
        return _reshaped_base(y, shape) if not needs_grad else y.view(shape)

    def _first_stage(self, be, part, shape):
        """(m, v, stats, write, nbt, record, first): the moments, the statistics (kind, mean, var, count), what
        the backend's apply writes into the buffers last, the num_batches_tracked it counts, a Python step for
        after the kernels, and the backend's planned first stage that the coefficient map must run (None: done;
        m, v, mean, var are filled when the map has run). The estimate update, tracking and the forward's
        all-reduce: here, once per call."""
        none = (None, None, None)
        if not self._FIRST_STAGE:
            (m, v, *_), first = be.plan_stats(part, shape)
            return m, v, ('none', None, None, None), *none, first
        rm, rv, nbt = self.running_mean, self.running_var, self._buffers.get('num_batches_tracked')
        if not self.training:
            (m, v, mean, var, *_), first = be.plan_stats(part, shape, STATS_FIXED, rm, rv)
            return m, v, ('fixed', mean, var, None), *none, first
        estimate = self.mode == 'estimate'
        if self.sync_stats and world_size() > 1 and (estimate or self._SYNC_BATCH):
            m, v = be.stats(part, shape)[:2]  # torch code reads them now: no deferred launch
            return m, v, self._synced_stats(m, v, shape[2]), *none, None
        count = shape[0] * shape[2]
        backward = in_backward()  # a checkpoint's recomputation: the forward's values, no state change
        if estimate:  # Algorithm 1, once per iteration
            st = self._open_iteration(deferred=True)
            first = st.total is None and not backward
            (m, v, mean, var, moved, upd), pending = be.plan_stats(part, shape, STATS_ESTIMATE, rm, rv, st.base,
                                                                   rate=st.rate, write=first)
            record = None if backward else (lambda: self._record_call(st, moved, count))
            return m, v, ('fixed', mean, var, None), (upd, rm, rv) if first else None, \
                nbt if first else None, record, pending
        (m, v, mean, var, _, upd), pending = be.plan_stats(part, shape, STATS_BATCH, rm, rv, momentum=self.momentum,
                                                           write=not backward, nbt=nbt)
        return m, v, ('batch', mean, var, count), None if backward else (upd, rm, rv), \
            None if backward else nbt, None, pending

    def _synced_stats(self, m, v, positions):
        """The first stage across processes (torch code around the collectives), its side effects done."""
        if self.mode == 'estimate':
            mean, var = self.estimates_from_moments(m, v, positions)
            return 'fixed', mean.to(m.dtype), var.to(m.dtype), None
        mean, var, count = synced_batch_moments(m, v, positions)
        if not in_backward():
            self._track(mean, var, count)
        return 'synced', mean, var, count

    def _track(self, mean: torch.Tensor, var: torch.Tensor, count) -> None:
        """Batch mode, outside the backends' stats step (the collective path, the reference compositions): the
        running statistics after a batch of ``count`` values per channel (a tensor after an all-reduce)."""
        with torch.no_grad():
            nbt = self._buffers.get('num_batches_tracked')
            tracked(mean, var, count, self.momentum, nbt)(self.running_mean, self.running_var)
            if nbt is not None:
                nbt.add_(1)

    def _watch(self, y: torch.Tensor) -> torch.Tensor:
        """A training output of an estimate-mode layer: a backward through it ends the iteration, except where
        the torch.compile operator took the call (its backward does: a hook traced into a compiled backward
        cannot change Python state)."""
        if not (self.mode == 'estimate' and self.training):
            return y
        if torch.compiler.is_compiling() and self.__dict__.get('_op_marks_iteration', False):
            return y
        return watch_backward(y)


# --- the autograd Function ------------------------------------------------------------------------------------
def _forward(ctx, x3, call, effects, params):
    kind, mean, var, count = call.stats
    coeffs, res = call.maps[0](call.m, call.v, mean, var, params, x3.shape[2], count, **call.fold)
    call.fold = {}  # the first stage ran in the map: the values are there for the backward
    ctx.call, ctx.pc, ctx.res, ctx.params = call, call.backend.prepare(coeffs, call.v), res, params
    ctx.param_dtypes = [None if p is None else p.dtype for p in params]
    return call.backend.apply(x3, call.m, call.v, ctx.pc, call.act, call.out_dtype, *effects)


def _backward(ctx, x3, dy):
    """(dx, dparams) for dy in x3's shape and dtype."""
    call, pc = ctx.call, ctx.pc
    be, m, v, act = call.backend, call.m, call.v, call.act
    kind, mean, var, count = call.stats
    # the Triton maps add the chunks' partial sums as they load them: no merge launch
    grads, state = be.sums(x3, dy, m, v, pc, act, merged=not call.triton_maps)
    # at large N the Triton maps may leave their sums over the samples as sample blocks' partials (a
    # ``second_stage.BlockSums`` in place of dparams), which dx sums in its own launch
    defer = {'defer': True} if call.triton_maps else {}
    dm, dv, dmean, dvar, dparams = call.maps[1](ctx.res, grads, kind in ('batch', 'synced'), **defer)
    later = dparams if hasattr(dparams, 'finish') else None
    if later is not None:
        dparams = later.params
        if kind == 'synced' or not ctx.needs_input_grad[0]:  # no dx launch to sum them: torch does
            dmean, dvar = later.finish()
            later = None
    if kind == 'synced':  # every process joins the VJP's all-reduces, whether it needs dx or not
        dm, dv = synced_batch_moments_vjp(m, mean, count, x3.shape[2], dm, dv, dmean, dvar)
    dx = None
    if ctx.needs_input_grad[0]:
        batch = (mean, dmean, dvar, 1.0 / x3.shape[0]) if kind == 'batch' else None
        dx = be.dx(x3, dy, m, v, pc, dm, dv, grads[1], act, batch, state,
                   **({} if later is None else {'finish': later}))
    dparams = [None if d is None or t is None else d.to(t) for d, t in zip(dparams, ctx.param_dtypes)]
    return dx, dparams


def _backward_or_fallback(ctx, dy):
    x3, = ctx.saved_tensors
    with torch.autocast(x3.device.type, enabled=False):
        dy = dy.reshape(x3.shape)  # dy may be expanded (the grad of a sum)
        call = ctx.call
        dy = call.backend.grad_layout(dy, x3)  # once, for both backward passes
        errors = _backend.compile_errors() if call.backend is not AtenBackend else ()
        try:
            if call.backend is AtenBackend:
                return _backward(ctx, x3, dy)
            with _backend.device_guard(x3):  # autograd may run the backward with another device current
                return _backward(ctx, x3, dy)
        except errors as e:  # a Triton backward kernel failed to compile: ATen, from the same statistics
            _backend.give_up_triton(call.option, e)
            ctx.call = call = types.SimpleNamespace(**{**vars(call), 'backend': AtenBackend,
                                                       'maps': call.fallback_maps, 'triton_maps': False})
            kind, mean, var, count = call.stats
            coeffs, ctx.res = call.maps[0](call.m, call.v, mean, var, ctx.params, x3.shape[2], count)
            ctx.pc = AtenBackend.prepare(coeffs, call.v)
            return _backward(ctx, x3, dy)


def _op_backward(ctx, dy):
    """The torch.compile operator's backward of a forward it ran with ``keep``."""
    out = _backward_or_fallback(ctx, dy)
    if ctx.call.ends_iteration:  # as the hook of StatNorm2d._watch in eager mode
        mark_iteration()
    return out


class _StatNormFn(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x3, call, effects, *params):
        ctx.save_for_backward(x3)  # x only: channel-sized tensors are kept as attributes
        return _forward(ctx, x3, call, effects, params)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        dx, dparams = _backward_or_fallback(ctx, dy)
        return (dx, None, None, *dparams)


# --- batch statistics across processes ------------------------------------------------------------------------
def synced_batch_moments(m: torch.Tensor, v: torch.Tensor, positions: int):
    """Per-channel mean and biased variance over every process's batch from the per-(n, c) moments, and the
    count of values per channel (a tensor), in two all-reduces: the squares around the global mean, so no
    E[x^2] - E[x]^2 cancellation. Outside autograd."""
    with torch.no_grad():
        count = m.new_full((1, ), m.shape[0] * positions)  # not new_tensor: no host-to-device copy
        packed = torch.cat([m.sum(0) * positions, count])
        dist.all_reduce(packed)
        total = packed[-1]
        mean = packed[:-1] / total.clamp(min=1)
        d = m - mean
        sq = torch.addcmul(v, d, d).sum(0) * positions
        dist.all_reduce(sq)
        return mean, sq / total.clamp(min=1), total


def synced_batch_moments_vjp(m, mean, count, positions, dm, dv, dmean, dvar):
    """dm, dv plus the VJP of :func:`synced_batch_moments` for (dmean, dvar): the all-reduces of the moment
    gradients, in the order and sizes autograd of the forward's all-reduces issues them (var's C, then the
    packed C + 1), so that a process taking the reference path (an empty input) pairs with them."""
    d = m - mean
    total = count.clamp(min=1)
    g_sq = dvar / total
    dist.all_reduce(g_sq)
    g_mean = dmean - (2 * positions) * g_sq * d.sum(0)  # through sq's (x - mean)
    packed = torch.cat([g_mean / total, g_mean.new_zeros(1)])  # the count's slot: not differentiated
    dist.all_reduce(packed)
    dm = dm + torch.addcmul(positions * packed[:-1], d, g_sq, value=2 * positions)
    return dm, dv + positions * g_sq


def _reshaped_base(y: torch.Tensor, shape) -> torch.Tensor:
    """The fresh tensor y in ``shape`` as a tensor of its own, not a view: under no_grad, e.g. the forward of
    a reentrant activation checkpoint (mmdet's ``with_cp``), a view returned out of the checkpoint's Function
    could not be modified in place (a residual ``+=``, a following ReLU(inplace)). Keeps y's memory format."""
    try:
        strides = y.view(shape).stride()
    except RuntimeError:  # not viewable in that shape: a copy, a tensor of its own anyway
        return y.reshape(shape)
    return y.new_empty(0).set_(y.untyped_storage(), y.storage_offset(), shape, strides)


def check_group_values(x: torch.Tensor, num_channels: int, num_groups: int, layer: str) -> None:
    """Group normalization of a group holding a single value outputs its bias alone, with a zero gradient
    to everything before it (torch's own group_norm accepts it silently): say why and what to change.

    The group statistics are per sample, so what counts is a group's values *within one sample*:
    channels per group x H x W, whatever the batch size (a batch of 2 on a 1x1 map with one channel per
    group is as degenerate as a batch of 1). An empty batch has no group to normalize and passes.
    Shapes only, no host sync."""
    per_group = num_channels // num_groups
    values = per_group
    for size in x.shape[2:]:
        values *= size
    if values == 1 and x.shape[0] > 0:
        raise ValueError(
            f'{layer}: each group holds a single value per sample (input {tuple(x.shape)}, {per_group} channel '
            f'per group), which group normalization maps to its bias alone; use num_groups <= '
            f'{max(num_channels // 2, 1)} (>= 2 channels per group) for 1x1 maps or (N, C) inputs')


def device_autocast(device_type: str) -> Tuple[bool, torch.dtype]:
    if hasattr(torch, 'get_autocast_dtype'):  # torch >= 2.4: per-device-type queries
        return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
    if device_type == 'cpu':
        return torch.is_autocast_cpu_enabled(), torch.get_autocast_cpu_dtype()
    if device_type == 'cuda':
        return torch.is_autocast_enabled(), torch.get_autocast_gpu_dtype()
    raise RuntimeError(f'no autocast state query for {device_type!r} before torch 2.4')


def autocast_enabled(device_type: str) -> bool:
    """Whether autocast is on for ``device_type`` (any torch version; False where it has no autocast)."""
    try:
        return device_autocast(device_type)[0]
    except RuntimeError:
        return False


def set_fused(module: nn.Module, fused: bool = True) -> int:
    """Switch every StatNorm layer (BCN, GN+PN, Unitization) in ``module`` between the engine (True) and the
    reference composition (False); returns how many were switched."""
    n = 0
    for mod in module.modules():
        if isinstance(mod, StatNorm2d):
            mod.fused = bool(fused)
            n += 1
    return n
