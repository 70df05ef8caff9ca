"""One fused pass for the norms that are "per-(sample, channel) statistics, then a per-(sample, channel)
map": BCN (both modes), GN+PN and Unitization (both modes). The default path of those layers; their
composition of torch ops (``fused=False``) stays as the reference the tests compare against.

Forward, for x viewed as (N, C, L) with L the number of positions:

    m, v     = mean and biased variance of x[n, c, :]                   (one reduction)
    A, B     = coeffs(m, v, parameters)                                  (channel-sized, autograd)
    y        = A (x - m) + B         or, with an activation phi,  y = K phi(A (x - m) + B) + L'

Each layer's statistics (group moments, batch moments, estimates, the per-sample norm of Unitization, the
proxy moments of PN) are functions of the per-(n, c) moments m, v and its parameters, so ``coeffs`` only
ever touches (N, C)-sized tensors. Backward: y depends on x elementwise and through m, v, with
dm/dx = 1/L and dv/dx = 2 (x - m)/L, hence

    dx = A g + (dm - A sum_l g + 2 dv (x - m)) / L,    g = dy    (g = dy K phi'(A (x - m) + B) with phi)

where dm, dv and every parameter gradient are ``coeffs``' vector-Jacobian product of the channel-sized
sums  sum_l g (x - m),  sum_l g  (and  sum_l dy phi(.),  sum_l dy  with phi). B is the output's mean per
(n, c) (before phi), so every term stays at the scale of x's spread, not of its mean. Only x (in its own dtype)
and channel-sized tensors are kept for backward: the activation memory of one nn.GroupNorm.

Buffers: on the CPU a fresh activation-sized tensor costs page faults on first touch (glibc hands large
blocks back to the OS), more than the pass that fills it; so y is written over the normalized output of
the moments' kernel and dx over the backward's own buffers (t, or the ReLU mask): 2 activation-sized
allocations per forward + backward (3 with ReLU), GroupNorm's 2.

The moments and coefficients are float32 for fp16/bf16 inputs (float64 for float64 ones); ``coeffs`` is
called once, in the forward, so side effects there (running statistics, a collective) happen once.
"""
import functools
import warnings
from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float32 for fp16/bf16 inputs (sums over positions overflow or round away in half), else x's dtype."""
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


def moments(x3: torch.Tensor):
    """(mean, biased variance) of x3 (N, C, L) over L in the compute dtype, outside autograd."""
    return moments_normalized(x3)[:2]


_TINY_VAR = 1e-30  # the moments kernel's eps on the CPU; a variance at or below it counts as 0


def moments_normalized(x3: torch.Tensor):
    """(mean, biased variance, x normalized per (n, c) or None) of x3 (N, C, L), outside autograd.

    On the CPU, GroupNorm's forward kernel with one channel per group gives the moments in one pass
    (torch.var_mean's Welford reduction is ~30x slower; E[x^2] - E[x]^2 in float32 loses the variance of a
    channel whose mean is large), and its output (x - m) / sd is returned as the buffer the forward writes
    y into (one large allocation fewer). Its eps is 1e-30, not 0, so that a constant channel gives a finite
    buffer (rstd = 1e15, not inf: no NaN from 0 * inf) without a check that reads values (a host sync on
    a GPU); var = rstd^-2 - 1e-30, and a variance at or below 1e-30 is 0 (y = B there, whatever the
    buffer holds). On CUDA, SyncBN's statistics kernel: one read, nothing written, no buffer."""
    with torch.no_grad():
        xc = x3.to(compute_dtype(x3))
        n, c, length = xc.shape
        if xc.is_cuda:
            m, rstd = torch.batch_norm_stats(xc.reshape(1, n * c, length), 0.0)
            # a constant channel: SyncBN's InvStd returns 0 for var = eps = 0
            rstd = rstd.view(n, c)
            return m.view(n, c), torch.where(rstd > 0, rstd.pow(-2), 0.0), None
        normalized, m, rstd = torch.ops.aten.native_group_norm(xc, None, None, n, c, length, c, _TINY_VAR)
        v = rstd.view(n, c).pow(-2) - _TINY_VAR
        return m.view(n, c), torch.where(v > _TINY_VAR, v, 0.0), normalized


def affine(t: torch.Tensor, scale: torch.Tensor, shift: Optional[torch.Tensor] = None) -> torch.Tensor:
    """t * scale + shift per (n, c), t (N, C, L), scale/shift (N, C): one pass. BatchNorm's eval kernel on
    the (1, N*C, L) view with mean 0, variance 1 and eps 0 computes exactly this (vectorized; addcmul
    with two broadcast operands is 1.6x slower on CPU)."""
    n, c, length = t.shape
    return _affine_flat(t.reshape(1, n * c, length), scale, shift).view(n, c, length)


def _affine_flat(flat: torch.Tensor, scale: torch.Tensor, shift: Optional[torch.Tensor] = None) -> torch.Tensor:
    # on the (1, N*C, L) view; returns a (1, N*C, L) tensor that is not a view (the custom Function's
    # output: a view made inside it could not be modified in place, e.g. by a following ReLU(inplace))
    zeros = flat.new_zeros(flat.shape[1], dtype=scale.dtype)
    shift = zeros if shift is None else shift.reshape(-1)
    return F.batch_norm(flat, zeros, torch.ones_like(zeros), scale.reshape(-1), shift, False, 0.0, 0.0)


def affine_(t: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, out: Optional[torch.Tensor] = None
            ) -> torch.Tensor:
    """out = t * scale + shift per (n, c), t (N, C, L), in place (``out`` None) or into ``out`` of t's shape:
    no allocation (on the CPU a fresh activation-sized tensor costs page faults, more than the pass).
    CPU: BatchNorm's eval kernel writing into its output (one vectorized pass); elsewhere addcmul."""
    n, c, length = t.shape
    out = t if out is None else out
    if t.device.type != 'cpu':
        return torch.addcmul(shift.unsqueeze(2), t, scale.unsqueeze(2), out=out)
    zeros = t.new_zeros(n * c, dtype=scale.dtype)
    torch.ops.aten.native_batch_norm.out(t.view(1, n * c, length), scale.reshape(-1), shift.reshape(-1), zeros,
                                         torch.ones_like(zeros), False, 0.0, 0.0, out=out.view(1, n * c, length),
                                         save_mean=t.new_empty(0), save_invstd=t.new_empty(0))
    return out


def sums(dy: torch.Tensor, t: torch.Tensor):
    """(sum_l dy * t, sum_l dy) per (n, c) in one pass: BatchNorm's eval backward for the weight and bias
    gradients on the (1, N*C, L) views (vecdot + sum are 2.5x slower on CPU)."""
    n, c, length = t.shape
    zeros = t.new_zeros(n * c)
    _, dot, total = torch.ops.aten.native_batch_norm_backward(
        dy.reshape(1, n * c, length), t.reshape(1, n * c, length), None, zeros, torch.ones_like(zeros), None,
        None, False, 0.0, [False, True, True])
    return dot.view(n, c), total.view(n, c)


class _StatNorm(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, m, v, normalized, coeffs_fn, kernels, out_dtype, recompute_coeffs, *params):
        if recompute_coeffs:  # nothing of the coefficients' graph is kept
            with torch.no_grad():
                coeffs = coeffs_fn(m, v, *params)
            ctx.save_for_backward(x, m, v, *[p if isinstance(p, torch.Tensor) else None for p in params])
            ctx.extra = (coeffs_fn, [p if not isinstance(p, torch.Tensor) else None for p in params])
        else:
            ctx.graph = _coeff_graph(coeffs_fn, m, v, params)
            coeffs = ctx.graph[2]
            ctx.save_for_backward(x)
        ctx.kernels = kernels
        return kernels.forward(x.to(m.dtype), m.detach(), [c.detach() for c in coeffs], normalized).to(out_dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        if hasattr(ctx, 'graph'):
            x, = ctx.saved_tensors
            (m, v), p_leaves, coeffs = ctx.graph
        else:
            x, m, v, *params = ctx.saved_tensors
            coeffs_fn, others = ctx.extra
            params = [p if o is None else o for p, o in zip(params, others)]
            (m, v), p_leaves, coeffs = _coeff_graph(coeffs_fn, m, v, params)
        cd = m.dtype
        xc, dy = x.to(cd), dy.to(cd).reshape(x.shape)  # dy may be expanded (the grad of a sum)
        fixed = [c.detach() for c in coeffs]
        grad_outs, state = ctx.kernels.sums(xc, m.detach(), dy, fixed)
        wanted = [m, v] + [p for p in p_leaves if isinstance(p, torch.Tensor) and p.requires_grad]
        # retain: a caller's backward(retain_graph=True) may run this twice
        live = [(c, s) for c, s in zip(coeffs, grad_outs) if c.requires_grad]  # e.g. K = 1 without PN's scaling
        grads = torch.autograd.grad([c for c, _ in live], wanted, [s for _, s in live], allow_unused=True,
                                    retain_graph=True) if live else [None] * len(wanted)
        dm, dv = [torch.zeros_like(t) if d is None else d for t, d in zip((m, v), grads[:2])]
        it = iter(grads[2:])
        dparams = [next(it) if isinstance(p, torch.Tensor) and p.requires_grad else None for p in p_leaves]
        dx = None
        if ctx.needs_input_grad[0]:
            length = x.shape[2]
            # y depends on m also directly, through x - m: -A per position, summed over them -A sum_l g
            dm = dm - fixed[0] * grad_outs[1].detach()
            dx = ctx.kernels.dx(xc, m.detach(), dy, fixed, (2.0 / length) * dv, dm / length, state).to(x.dtype)
        return (dx, None, None, None, None, None, None, None, *dparams)


class EagerKernels:
    """The passes over x with ATen's BatchNorm kernels (the default). ``act``: the activation of
    y = K act(A (x - m) + B) + L, or None for y = A (x - m) + B.

    The backward works on t = x - m (one exact subtraction): the sums and dx = A g + c1 t + c0 then stay
    at the scale of x's spread, not of its mean (in x itself, c1 x and c1 m cancel: float32 gradients
    were off by percents where a channel's mean is large against its spread)."""

    def __init__(self, act: Optional[Callable] = None):
        self.act = act
        # ReLU (GN+PN's default): K relu(p) + L = max(K p + L, L) for K > 0 (K = 1 / proxy std), and its
        # gradients follow from the masked sums of dy and dy t
        self.relu = isinstance(act, functools.partial) and act.func is F.relu and not act.args and not act.keywords

    def forward(self, xc, m, coeffs, normalized=None):
        """y on x (N, C, L); returns a tensor of x's size that is not a view. ``normalized``: (x_hat, sd) with
        x_hat = (x - m) / sd from :func:`moments_normalized`, which y is written into (A t = (A sd) x_hat);
        otherwise the forward folds m into the shift, as GroupNorm's own kernel does."""
        a = coeffs[0]
        if normalized is not None:
            y, sd = normalized
            a, b = a * sd, coeffs[1]
        else:
            y, b = None, coeffs[1] - a * m
        if self.relu:  # K relu(p) + L = max(K p + L, L), K > 0
            k, l_ = coeffs[2], coeffs[3]
            y = _affine_into(y, xc, k * a, k * b + l_)
            return y.clamp_(min=l_.unsqueeze(2))
        y = _affine_into(y, xc, a, b)
        if self.act is not None:
            y = affine_(self.act(y), coeffs[2], coeffs[3])
        return y

    def sums(self, xc, m, dy, coeffs):
        """The channel-sized sums that coeffs' gradients need (the first two: sum_l g t, sum_l g), and
        what dx needs. t = x - m is formed once (dx needs it); buffers made here are reused for dx."""
        t = affine(xc, torch.ones_like(m), -m)
        if self.act is None:
            return list(sums(dy, t)), (dy, t, False)
        a, b = coeffs[0], coeffs[1]
        if self.relu:  # h = dy where A t + B > 0, written over A t + B
            k = coeffs[2]
            pre = affine(t, a, b)
            h = torch.ops.aten.threshold_backward.grad_input(dy, pre, 0, grad_input=pre)
            ht, hs = sums(h, t)
            return [k * ht, k * hs, a * ht + b * hs, dy.sum(2)], (h, t, True)
        with torch.enable_grad():
            pre = affine(t, a, b).requires_grad_()
            out = self.act(pre)
            g, = torch.autograd.grad(out, pre, affine(dy, coeffs[2]))
        return list(sums(g, t) + sums(dy, out.detach())), (g, t, True)

    def dx(self, xc, m, dy, coeffs, c1, c0, state=None):
        """dx = A g + c1 t + c0, written over g where this class made g, else over t."""
        if state is None:
            state = self.sums(xc, m, dy, coeffs)[1]
        g, t, own = state
        scale = coeffs[0] * coeffs[2] if self.relu else coeffs[0]  # ReLU: g = K h
        if own:
            return affine_(g, scale, c0).addcmul_(t, c1.unsqueeze(2))
        return affine_(t, c1, c0).addcmul_(g, scale.unsqueeze(2))


def _affine_into(out, xc, scale, shift):
    """scale * xc + shift per (n, c), written over ``out`` when given, else into a new tensor (not a view: the
    custom Function's output, which a following ReLU(inplace) may modify)."""
    return affine_(xc, scale, shift, torch.empty_like(xc)) if out is None else affine_(out, scale, shift)


def _coeff_graph(coeffs_fn, m, v, params):
    """coeffs_fn on fresh leaves: (leaves m, v), parameter leaves, coefficients with their graph."""
    leaves = [m.detach().requires_grad_(), v.detach().requires_grad_()]
    p_leaves = [p.detach().requires_grad_(p.requires_grad) if isinstance(p, torch.Tensor) and p.is_floating_point()
                else p for p in params]
    with torch.enable_grad():
        coeffs = tuple(coeffs_fn(*leaves, *p_leaves))
    return leaves, p_leaves, coeffs


def stat_norm(x: torch.Tensor, coeffs_fn: Callable, params: Sequence, act: Optional[Callable] = None,
              out_dtype: Optional[torch.dtype] = None, stats=None, recompute_coeffs: bool = False,
              compiled: bool = False) -> torch.Tensor:
    """y = A (x - m) + B (or K act(A (x - m) + B) + L), (A, B[, K, L]) = coeffs_fn(m, v, *params), each (N, C).

    ``x`` is (N, C, *positions); ``stats`` = (m, v) or (m, v, normalized) from :func:`moments` or
    :func:`moments_normalized` when the caller needed them first (e.g. for an estimate update). The graph of coeffs_fn is kept for backward ((N, C)-sized tensors),
    or with ``recompute_coeffs`` recomputed in backward: for a coeffs_fn without side effects whose graph
    holds larger tensors (PN's (C, n) proxy samples). ``compiled``: the passes over x as torch.compile'd
    kernels (``_compiled.py``; the eager kernels where torch.compile is unavailable). ``act`` must be a stable object (one per activation
    configuration, see ``_activations.activation_fn``) for the compiled kernels to be reused. Returns y in
    ``out_dtype`` (default x's dtype) and x's shape.
    """
    shape = x.shape
    x3 = x.reshape(shape[0], shape[1], -1)
    m, v, normalized = moments_normalized(x3) if stats is None else (tuple(stats) + (None, ))[:3]
    normalized = None if normalized is None else (normalized, v.sqrt())
    out_dtype = x.dtype if out_dtype is None else out_dtype
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or any(
        isinstance(p, torch.Tensor) and p.requires_grad for p in params))
    kernels = compiled_kernels(act) if compiled else EagerKernels(act)
    if not needs_grad:  # eval / no_grad: no graph to keep
        with torch.no_grad():
            y = kernels.forward(x3.to(m.dtype), m, coeffs_fn(m, v, *params), normalized).to(out_dtype)
        return _reshaped_base(y, shape)
    else:
        y = _StatNorm.apply(x3, m, v, normalized, coeffs_fn, kernels, out_dtype, recompute_coeffs, *params)
    return y.view(shape)


def _reshaped_base(y: torch.Tensor, shape) -> torch.Tensor:
    """The fresh tensor y in ``shape`` as a tensor of its own, not a view: under no_grad, e.g. the forward of
    a reentrant activation checkpoint (mmdet's ``with_cp``), a view returned out of the checkpoint's Function
    could not be modified in place (a residual ``+=``, a following ReLU(inplace))."""
    if not y.is_contiguous():
        return y.reshape(shape)
    strides = torch.empty(0).new_empty(shape, device='meta').stride()
    return y.new_empty(0).set_(y.untyped_storage(), y.storage_offset(), shape, strides)


def compiled_kernels(act):
    from ._compiled import CompiledKernels  # torch.compile imported only when asked for
    return CompiledKernels.get(act)


def group_moments(m: torch.Tensor, v: torch.Tensor, groups: int):
    """Per-(n, g) mean and biased variance from the per-(n, c) moments (law of total variance: no
    E[x^2] - E[x]^2 cancellation)."""
    n = m.shape[0]
    mg, vg = m.reshape(n, groups, -1), v.reshape(n, groups, -1)
    mean = mg.mean(2)
    return mean, (vg + (mg - mean.unsqueeze(2)).square()).mean(2)


def batch_moments(m: torch.Tensor, v: torch.Tensor):
    """Per-channel mean and biased variance over the batch from the per-(n, c) moments (equal counts)."""
    mean = m.mean(0)
    return mean, (v + (m - mean).square()).mean(0)


def warn_recompute_deprecated(layer: str) -> None:
    warnings.warn(f'{layer}(recompute=True) is deprecated and has no effect: the fused path (the default) keeps '
                  'only the input for backward already; drop recompute, or set fused=False to recompute the '
                  'reference composition', DeprecationWarning, stacklevel=3)


def set_fused(module: nn.Module, fused: bool = True) -> int:
    """Switch every BCN, GN+PN and Unitization layer in ``module`` between the fused path (True) and the
    reference composition (False); returns how many were switched."""
    from .bcn import BatchChannelNorm2d  # the layers import this module
    from .proxy_norm import GroupProxyNorm
    from .unitization import Unitization2d
    n = 0
    for mod in module.modules():
        if isinstance(mod, (BatchChannelNorm2d, GroupProxyNorm, Unitization2d)):
            mod.fused = bool(fused)
            n += 1
    return n
