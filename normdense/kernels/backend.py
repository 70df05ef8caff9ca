"""The StatNorm engine's backend contract, and which backend runs a call.

A backend (``aten.AtenBackend``: ATen's kernels, every device; ``triton.TritonBackend``: normdense's Triton
kernels, CUDA, CPU tensors under ``TRITON_INTERPRET=1``) implements :class:`Backend` with these records: the
first stage a call asks for (:class:`StatsRequest`, modes ``STATS_*``), what comes back (:class:`Statistics`) and
a layer VJP's deferred sums (:class:`PendingSums`). Algorithm 1's and the running statistics' arithmetic in torch
(:func:`estimate_moments`, :func:`estimate_step`, :func:`track_`) is here too: the ATen backend and the layers'
estimates share it.

Which backend: the layer's ``backend`` option, else the environment variable ``NORMDENSE_BACKEND``, else
``auto``: Triton for CUDA tensors when triton imports and no kernel has failed to compile in this process,
else ATen. A kernel that fails to compile under ``auto`` makes the process fall back to ATen with one
warning; a forced ``triton`` raises instead. Imports no layer (and no triton until asked).
"""
import contextlib
import os
import warnings
from typing import Any, NamedTuple, Optional, Protocol, Tuple, Union

import torch
from torch import Tensor

BACKENDS = ('auto', 'aten', 'triton')
HALF = (torch.float16, torch.bfloat16)  # statistics never run in these: sums over positions overflow or round away
ENV = 'NORMDENSE_BACKEND'

# why: importing triton is tried once per process, and a failed compile gives Triton up for the process
_STATE = {'triton': None, 'broken': None}  # triton importable (None: not yet tried); why Triton was given up


def check_backend(value, who: str = 'backend'):
    """``value`` (None or one of BACKENDS) or a one-line ValueError naming the choices."""
    if value is not None and value not in BACKENDS:
        raise ValueError(f'{who} must be one of {BACKENDS} (or None: ${ENV}, default auto); got {value!r}')
    return value


def env_backend() -> str:
    value = os.environ.get(ENV, '').strip().lower() or 'auto'
    if value not in BACKENDS:
        raise ValueError(f'{ENV}={os.environ[ENV]!r}: choose one of {"|".join(BACKENDS)}')
    return value


def interpreted() -> bool:
    return os.environ.get('TRITON_INTERPRET') == '1'


def triton_error():
    """None if triton imports, else why not (one line)."""
    if _STATE['triton'] is None:
        try:
            import triton  # noqa: F401
            _STATE['triton'] = ''
        except Exception as e:  # ImportError, or a broken install
            _STATE['triton'] = f'triton does not import ({type(e).__name__}: {e})'.splitlines()[0]
    return _STATE['triton'] or None


def backend_name(option, x) -> str:
    """'aten' or 'triton' for a layer whose ``backend`` option is ``option`` (None: the environment's) on input
    ``x``."""
    choice = check_backend(option) or env_backend()
    if choice == 'aten':
        return 'aten'
    if choice == 'triton':
        reason = triton_error()
        if reason:
            raise RuntimeError(f"backend='triton' needs triton: {reason}; install torch's CUDA wheels (they ship "
                               f"triton) or use backend='aten'")
        if not (x.is_cuda or (x.device.type == 'cpu' and interpreted())):
            raise RuntimeError(f"backend='triton' runs on CUDA tensors (CPU ones only under TRITON_INTERPRET=1); "
                               f"got a {x.device.type} tensor: use backend='aten' or 'auto'")
        return 'triton'
    if x.is_cuda and _STATE['broken'] is None and triton_error() is None:
        return 'triton'
    return 'aten'


def selected_backend(layer, x) -> str:
    """'aten' or 'triton' for ``layer`` on input ``x``."""
    return backend_name(getattr(layer, 'backend', None), x)



def device_guard(t):
    """The context in which a Triton launch for tensor ``t`` runs: ``torch.cuda.device(t.device)`` for a CUDA
    tensor (Triton launches on the current device and its current stream: without the guard, x on cuda:1 with
    cuda:0 current is an illegal access, or a kernel on the wrong stream), nothing for a CPU tensor (the
    interpreter)."""
    device = _device_of(t)
    if device.type != 'cuda':
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def _device_of(t):
    return t.device  # why a function: the tests fake a second CUDA device on CPU tensors


def current_device() -> int:
    """The current CUDA device's index (what Triton launches on); a function: the tests fake devices."""
    return torch._C._cuda_getDevice()


def compile_errors() -> tuple:
    """The exception types of a kernel that does not compile (Triton's frontend, ptxas, resources)."""
    from triton.compiler.errors import CompilationError
    from triton.runtime import errors
    return (CompilationError, ) + tuple(getattr(errors, n) for n in ('OutOfResources', 'PTXASError')
                                        if hasattr(errors, n))


def give_up_triton(option, error) -> None:
    """Under ``auto`` (``option``: the layer's backend option): ATen for the rest of the process, said once. A
    forced 'triton' re-raises."""
    if (check_backend(option) or env_backend()) == 'triton':
        raise error
    if _STATE['broken'] is None:
        _STATE['broken'] = f'{type(error).__name__}: {error}'.splitlines()[0]
        warnings.warn(f'normdense: a Triton kernel failed to compile ({_STATE["broken"]}); using the ATen '
                      f'backend for the rest of this process (set {ENV}=aten to silence this)', RuntimeWarning,
                      stacklevel=3)


def exporting(compiling: Optional[bool] = None) -> bool:
    """True while a graph is recorded for another runtime (either torch.onnx exporter, torch.export,
    torch.jit.trace): no backend runs then, the layers take their eval form of standard ops. ``compiling``:
    ``torch.compiler.is_compiling()`` where the caller has it (Dynamo traces the public queries only)."""
    if torch.compiler.is_compiling() if compiling is None else compiling:
        return torch.onnx.is_in_onnx_export() or torch.jit.is_tracing() or _is_exporting()
    return _in_onnx_export() or torch._C._is_tracing() or _is_exporting()


def _onnx_flag():
    """A function of no arguments equal to ``torch.onnx.is_in_onnx_export()`` without its two imports a call
    (torch 2.9+'s flags), or that function itself."""
    try:
        from torch.onnx._internal.exporter import _flags
        from torch.onnx._internal.torchscript_exporter._globals import GLOBALS
    except ImportError:
        return torch.onnx.is_in_onnx_export
    if not hasattr(GLOBALS, 'in_onnx_export') or not hasattr(_flags, '_is_onnx_exporting'):
        return torch.onnx.is_in_onnx_export
    return lambda: GLOBALS.in_onnx_export or _flags._is_onnx_exporting


def _in_onnx_export() -> bool:
    global _in_onnx_export
    _in_onnx_export = _onnx_flag()  # resolved on the first call: importing torch.onnx at import costs 0.5 s
    return _in_onnx_export()


_HAS_IS_EXPORTING = hasattr(torch.compiler, 'is_exporting')  # torch >= 2.5 has it


def _is_exporting() -> bool:
    return _HAS_IS_EXPORTING and torch.compiler.is_exporting()


if hasattr(torch.compiler, 'assume_constant_result'):
    # run, not traced: before torch 2.12 Dynamo folds is_exporting() to True under torch.compile (pytorch#176347)
    _is_exporting = torch.compiler.assume_constant_result(_is_exporting)

_PER_DEVICE_AUTOCAST = hasattr(torch, 'get_autocast_dtype')  # torch >= 2.4 asks autocast per device type


def autocast_on(device_type: str) -> bool:
    """Whether autocast is on for ``device_type`` (any torch version; False where that device type has none)."""
    if _PER_DEVICE_AUTOCAST:
        try:
            return torch.is_autocast_enabled(device_type)
        except RuntimeError:  # a device type without autocast (meta)
            return False
    if device_type == 'cpu':
        return torch.is_autocast_cpu_enabled()
    return device_type == 'cuda' and torch.is_autocast_enabled()


def autocast_state(device_type: str) -> Tuple[bool, torch.dtype]:
    """(on, dtype) of autocast for ``device_type``, as a recomputation restores it."""
    if _PER_DEVICE_AUTOCAST:
        return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
    if device_type == 'cpu':
        return torch.is_autocast_cpu_enabled(), torch.get_autocast_cpu_dtype()
    if device_type == 'cuda':
        return torch.is_autocast_enabled(), torch.get_autocast_gpu_dtype()
    raise RuntimeError(f'no autocast state query for {device_type!r} before torch 2.4')


_NO_CONTEXT = contextlib.nullcontext()  # reusable: it holds nothing


def autocast_off(device_type: str):
    """Autocast off for ``device_type`` around torch code that must see the dtypes the engine chose:
    ``torch.autocast(enabled=False)`` where autocast is on, else a context that does nothing (entering an autocast
    context costs about 6 us)."""
    if autocast_on(device_type):
        return torch.autocast(device_type, enabled=False)
    return _NO_CONTEXT


# --- the contract -----------------------------------------------------------------------------------------------
# The first stage's modes (the Triton stats kernel's MODE): no per-channel statistics (GN+PN); fixed ones (eval:
# the running statistics); Algorithm 1's estimates moved by r; the batch's, with the running statistics tracked.
STATS_NONE, STATS_FIXED, STATS_ESTIMATE, STATS_BATCH = 0, 1, 2, 3


class StatsRequest(NamedTuple):
    """The first stage one call asks for. ``stat_mean, stat_var``: FIXED's statistics, else the running buffers
    (ESTIMATE reads them as the iteration's start when ``write``); ``base`` (2, C): the iteration's starting
    estimates (filled when ``write``, else read); ``write``: the buffers take this call's values (the forward's
    last launch writes them) and ``nbt`` (num_batches_tracked), if given, counts one; BATCH with ``momentum``
    None: the cumulative average over nbt + 1 batches."""
    mode: int = STATS_NONE
    stat_mean: Optional[Tensor] = None
    stat_var: Optional[Tensor] = None
    base: Optional[Tensor] = None
    rate: Any = 0.0
    momentum: Optional[float] = 0.1
    write: bool = False
    nbt: Optional[Tensor] = None
    key: Optional[tuple] = None


Row = Union[Tensor, int]
"""A (C,) row of statistics as a kernel launch takes it: a tensor, or on the Triton path the integer address of a
row of the deferred first stage's buffer (``first_stage.FirstStage``), which a kept launch passes as it is and a
normal launch turns into a view of that buffer (``launch.Launcher``'s rows)."""


class Statistics(NamedTuple):
    """One call's first stage: the per-(n, c) moments m, v (N, C), the per-channel mean, var (C,) (None in
    STATS_NONE), ESTIMATE's ``moved`` (2, C: the batch moments the estimates moved towards), ``update`` (where
    the apply pass reads the buffers' new values, (2, C), on a backend whose first stage computes them (Triton);
    None: nothing to read, ATen's apply writes the buffers from mean and var itself), ``first`` (a first stage the
    coefficient map runs in its own launch, ``first=``; None: the values are there), ``out`` (storage the
    output may take, or None) and the request. With ``first``, mean, var and update are the addresses of its
    buffer's rows, ``first.outputs`` their tensors."""
    m: Tensor
    v: Tensor
    mean: Optional[Row]
    var: Optional[Row]
    moved: Optional[Tensor]
    update: Optional[Row]
    first: Any  # a ``first_stage.FirstStage`` (which imports triton: not named here), or None
    out: Optional[Tensor]
    request: StatsRequest


class PendingSums:
    """Base of a layer VJP's parameter gradients left as sample blocks' partials (large N, kernel maps):
    ``params`` their final storage, filled by the backend's dx launch or by :meth:`finish` (which returns
    (dmean, dvar)). A class, not a runtime Protocol: the engine's isinstance check stays a C call."""
    params: list

    def finish(self) -> Tuple[Optional[Tensor], Optional[Tensor]]:
        raise NotImplementedError


def ncl(x: Tensor):
    """(N, C, L) of x (N, C, *positions): L the positions per (sample, channel)."""
    s = x.shape
    if len(s) == 3:
        return s
    if len(s) == 4:
        return s[0], s[1], s[2] * s[3]
    length = 1
    for d in s[2:]:
        length *= d
    return s[0], s[1], length


class Backend(Protocol):
    """The passes over the activation x3 (N, C, L); a backend with ``kernel_maps`` takes x (N, C, *positions)
    itself as x3 too (no (N, C, L) view: one costs a training step ~4 us), its sizes by :func:`ncl`. Coefficients
    are (N, C) in the compute dtype; ``pc`` is what :meth:`prepare` makes of them; ``act`` None (y = A t + B) or
    an activation with ``name``, ``kwargs``, ``forward(z)``, ``backward(g, z, out)`` (y = K act(A t + B) + L')."""
    name: str
    kernel_maps: bool  # the layers' kernel transcriptions of their maps run on it (``_coeff_maps(True)``)

    def first_stage(self, x3: Tensor, request: StatsRequest, deferred: bool = True) -> Tuple[Tensor, Statistics]:
        """(x3 as the passes read it, the first stage): the moments, and the statistics computed now or (where
        ``deferred`` and the backend can) deferred to the coefficient map's launch."""

    def read_input(self, x3: Tensor) -> Tensor:
        """x3 as :meth:`first_stage` returns it for the passes (itself where they read its layout, else a copy):
        the backward makes it again from the saved input where the forward's was a copy."""

    def prepare(self, coeffs: tuple, v: Tensor) -> Any:
        """The coefficients as the passes take them."""

    def apply(self, x3: Tensor, stats: Statistics, coeffs: tuple, act=None, out_dtype: Optional[torch.dtype] = None,
              out: Optional[Tensor] = None) -> Tuple[Tensor, Any]:
        """(y, pc): y = the map of x3 in ``out_dtype``, then the module's state written (with ``request.write`` the
        buffers take the call's statistics; nbt counted): the forward's last step. ``out``: storage y may take
        (x3's shape, layout and ``out_dtype``: a view of the layer's output), or None."""

    def grad_layout(self, dy: Tensor, x3: Tensor) -> Tensor:
        """dy (the gradient of y, in x's shape) as the backward passes read it."""

    def sums(self, x3: Tensor, dy: Tensor, stats: Statistics, pc, act=None, merged: bool = True) -> Tuple[Any, Any]:
        """(the coefficients' gradients [sum g t, sum g (, sum dy act(z), sum dy)], state for :meth:`dx`);
        ``merged`` False: in the backend's own form for its kernel maps (Triton: the chunks' partials of all of
        them in one (SPLIT, count, N, C) buffer)."""

    def dx(self, x3: Tensor, dy: Tensor, stats: Statistics, pc, dm: Tensor, dv: Tensor, grads, act=None,
           batch: Optional[tuple] = None, state=None, pending: Optional[PendingSums] = None) -> Tensor:
        """dx from the coefficient VJP's dm, dv and ``grads`` (what :meth:`sums` returned); ``batch`` = (mean,
        dmean, dvar, 1 / N): the batch statistics' VJP too; ``pending``: sums this launch finishes (kernel maps
        only)."""

    def act_form(self, act) -> Any:
        """The activation (an Activation) as this backend's passes take it (``act`` of apply, sums, dx)."""

    def guard(self, t: Tensor) -> contextlib.AbstractContextManager:
        """The context every launch for ``t`` runs in."""

    def compile_errors(self) -> tuple:
        """The exception types of a kernel that does not compile (empty: none can fail to)."""


# --- what a layer gives the engine: its coefficient maps -------------------------------------------------------
class CoeffMap(Protocol):
    """A layer's coefficient map, bound to its configuration (a ``functools.partial``): the torch form (in
    ``layers/<layer>.py``; every backend can run it) or a kernel transcription (in ``kernels/<layer>.py``; the
    backends with ``kernel_maps``). It is pure: no module state is read or written."""

    def __call__(self, m: Tensor, v: Tensor, mean: Optional[Row], var: Optional[Row], params: tuple, length: int,
                 count: Any, first: Any = None) -> Tuple[Any, Any]:
        """(coeffs, res): the per-(n, c) coefficients of y = A t + B (t = x - m; with an activation
        y = K act(A t + B) + L') and the residuals its VJP reads. m, v (N, C): the moments; mean, var (C,): the
        channels' statistics (None for a layer without a first stage); ``params``: the layer's
        ``_statnorm_params()``; ``length``: the positions per (n, c); ``count``: the values per channel behind batch
        statistics (an int; a tensor when all-reduced, which only the torch form receives), else None. ``coeffs``:
        a tuple (A, B[, K, L']) of (N, C) tensors in the compute dtype, or, from a kernel map given ``first``, one
        (k, N, C) buffer of them (``common.stacked``). ``first`` (kernel maps only): the deferred first stage,
        which the map's own launch runs (``first_stage.fold_args``); mean and var are then its rows' addresses."""


class CoeffVJP(Protocol):
    """The VJP of a :class:`CoeffMap`, in closed form, bound as the map is."""

    def __call__(self, res: Any, grads: Any, wants_stats: bool, defer: bool = False) -> Tuple[Any, Any, Any, Any, Any]:
        """(dm, dv, dmean, dvar, dparams): the gradients of the map's inputs from ``grads``, what
        :meth:`Backend.sums` made (the torch form: a tuple of (N, C) [sum g t, sum g (, sum dy act(z), sum dy)];
        a kernel map: the sums kernel's (SPLIT, count, N, C) partials, added as it loads them). dmean, dvar (C,)
        only when ``wants_stats`` (batch statistics), else None; ``dparams``: one per parameter (None where it
        is None). ``defer`` (kernel maps only): dm and dv as one stacked (2, N, C) buffer in dm's place, dv None,
        and ``dparams`` may be a :class:`PendingSums` that the dx launch finishes."""


class Maps(NamedTuple):
    """A layer's coefficient map and its VJP (``StatNorm2d._coeff_maps``)."""
    coeff_map: CoeffMap
    coeff_vjp: CoeffVJP


# --- the first stage's arithmetic in torch (Algorithm 1 of arXiv:1903.10520, BN's running statistics) ----------
def estimate_moments(m: Tensor, v: Tensor, base_mean: Tensor) -> Tensor:
    """Algorithm 1, steps 1-2, from the per-(n, c) moments: (2, C) = (batch mean, second moment around the estimate
    ``base_mean``), the latter as the mean over samples of v + (m - mu_hat)^2 (no E[x^2] - E[x]^2 cancellation)."""
    d = m - base_mean.to(m.dtype)
    return torch.stack([m, torch.addcmul(v, d, d)]).mean(1)


def estimate_step(base: Tensor, moments: Tensor, rate) -> Tensor:
    """Algorithm 1, steps 3-4: the estimates (2, C) moved by r (a number, or a tensor) towards the moments (2, C)."""
    return torch.lerp(base.to(moments.dtype), moments, rate)


def estimate_update(m: Tensor, v: Tensor, base: Tensor, rate) -> Tuple[Tensor, Tensor]:
    """Algorithm 1, steps 1-4, from the per-(n, c) moments: (moments (2, C), estimates (2, C)) with ``base`` (2, C)
    the estimates the iteration started from."""
    moved = estimate_moments(m, v, base[0])
    return moved, estimate_step(base, moved, rate)


def track_(running_mean: Tensor, running_var: Tensor, mean, var, count, momentum, nbt) -> None:
    """Move the running statistics in place after one batch of ``count`` values per channel (unbiased variance, as
    nn.BatchNorm); ``momentum`` None: the cumulative average over num_batches_tracked + 1 batches. ``count`` a
    tensor (all-reduced): 0 leaves them as they are."""
    weight = momentum if momentum is not None else (nbt + 1).to(mean.dtype).reciprocal()
    if isinstance(count, torch.Tensor):
        unbiased = var * count / (count - 1).clamp(min=1)
        weight = (count > 0).to(mean.dtype) * weight
    else:
        unbiased = var * (count / (count - 1))
    running_mean.lerp_(mean.to(running_mean.dtype), weight)
    running_var.lerp_(unbiased.to(running_var.dtype), weight)
