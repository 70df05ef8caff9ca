"""A StatNorm layer's call under ``torch.compile``: one operator registered through torch.library,
``normdense::statnorm``, and its backward ``normdense::statnorm_backward``, on either backend.

Dynamo cannot trace Triton's launch machinery, and the engine's per-iteration bookkeeping (estimate mode,
checkpoint recomputation) is Python state; as an operator the call is opaque to the compiler and runs the eager
engine (the same kernels, the same launches) when the compiled graph executes. The module's buffers go in as
arguments and their new values come out (an operator with an autograd formula must be functional; the traced
code copies them back into the buffers); the parameters go in as inputs, so the operator's backward returns
their gradients. The forward keeps the eager path's backward state under a ticket (a CPU int64 scalar:
reading it syncs nothing) that the backward consumes.

Imports no layer: a layer is reached through :func:`handle` (it calls :func:`register` when created) and its
duck-typed ``_statnorm_eager(x, keep)`` (the engine's forward without an autograd graph, appending (state,
backward function) to ``keep``), ``_statnorm_params()`` and ``_statnorm_dtypes(x)``.
"""
import contextlib
import itertools
import weakref
from typing import List, Tuple

import torch

_LAYERS = weakref.WeakValueDictionary()  # why: the operator's schema takes strings, not modules
_PENDING = {}  # why: a forward's backward state until its backward runs (ticket -> (state, backward fn))
_STATE = ('running_mean', 'running_var', 'num_batches_tracked')  # the buffers a call may write
_TICKETS = itertools.count(1)  # why: a forward's key into _PENDING, unique per process
_MAX_PENDING = 4096  # a safety net: forwards whose graph is alive without a backward, the oldest dropped


def _declared(t: torch.Tensor, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t as the fake kernels declare it, ``torch.empty_like(x, dtype=dtype)``'s strides and dtype (a compiled graph
    asserts them): t itself where it has them, else a copy (a backend's layout differs from x's, e.g. the
    Triton passes read an H/W-swapped map as a contiguous copy)."""
    out = torch.empty_like(x, dtype=dtype)
    if out.stride() == t.stride() and out.dtype == t.dtype:
        return t
    return out.copy_(t)


def handle(layer) -> str:
    """The layer's key into the operator's registry; traced as a constant (Dynamo guards on the identity)."""
    return f'{type(layer).__name__}@{id(layer):x}'


def register(layer) -> None:
    """Makes ``layer`` reachable by :func:`handle`, outside any traced code: a layer registers when it is
    created (copies and unpickled ones too: ``__new__``) since Dynamo before torch 2.12 cannot pass a module
    to a function run at trace time."""
    _LAYERS[handle(layer)] = layer


def _state_names(layer):
    return [n for n in _STATE if layer._buffers.get(n) is not None]


def _param_names(layer):
    # the names of _statnorm_params() in order (None entries: absent parameters)
    by_id = {id(p): n for n, p in layer._parameters.items() if p is not None}
    return [by_id.get(id(p)) for p in layer._statnorm_params() if p is not None]


@contextlib.contextmanager
def _swapped(layer, params, state):
    """The layer reads ``params`` and writes ``state`` (the operator's arguments, which functionalization may
    have copied) instead of its own parameters and buffers, for the length of the call."""
    names, p_names = _state_names(layer), _param_names(layer)
    saved_p = {n: layer._parameters[n] for n in p_names}
    saved_b = {n: layer._buffers[n] for n in names}
    try:
        layer._parameters.update(zip(p_names, params))
        layer._buffers.update(zip(names, state))
        yield
    finally:
        layer._parameters.update(saved_p)
        layer._buffers.update(saved_b)


@torch.library.custom_op('normdense::statnorm', mutates_args=())
def statnorm(x: torch.Tensor, params: List[torch.Tensor], state: List[torch.Tensor], layer: str,
             needs_grad: bool) -> Tuple[torch.Tensor, torch.Tensor, List[torch.Tensor]]:
    """(y, ticket, new state) of the layer's eager engine on x; ``params`` the present (not None) ones of its
    ``_statnorm_params()``, in order."""
    mod = _LAYERS[layer]
    state = [b.clone() for b in state]  # written by the call, returned
    keep = [] if needs_grad else None
    with _swapped(mod, params, state):
        y = _declared(mod._statnorm_eager(x, keep), x, mod._statnorm_dtypes(x)[1])
    if not needs_grad:
        return y, torch.zeros((), dtype=torch.int64), state
    ticket = next(_TICKETS)
    if len(_PENDING) >= _MAX_PENDING:
        _PENDING.pop(next(iter(_PENDING)))
    _PENDING[ticket] = keep[0]
    held = torch.full((), ticket, dtype=torch.int64)
    # the autograd graph keeps the ticket for the backward; a graph dropped without one frees what it holds
    weakref.finalize(held, _PENDING.pop, ticket, None)
    return y, held, state


@statnorm.register_fake
def _(x, params, state, layer, needs_grad):
    out_dtype = _LAYERS[layer]._statnorm_dtypes(x)[1]
    return (torch.empty_like(x, dtype=out_dtype), torch.empty((), dtype=torch.int64),
            [torch.empty_like(b) for b in state])


@torch.library.custom_op('normdense::statnorm_backward', mutates_args=())
def statnorm_backward(ticket: torch.Tensor, dy: torch.Tensor, x: torch.Tensor,
                      params: List[torch.Tensor]) -> List[torch.Tensor]:
    """The gradients of x and the present parameters of the forward ``ticket`` names, for dy."""
    ctx, backward = _PENDING.pop(int(ticket))
    dx, dparams = backward(ctx, dy)
    present = [d for d, p in zip(dparams, ctx.params) if p is not None]
    return [_declared(dx.view(x.shape), x, x.dtype)] + \
        [torch.zeros_like(p) if d is None else d for d, p in zip(present, params)]


@statnorm_backward.register_fake
def _(ticket, dy, x, params):
    return [torch.empty_like(x)] + [torch.empty_like(p) for p in params]


def _setup(ctx, inputs, output):
    x, params, state, _, _ = inputs
    ctx.n_state = len(state)
    ctx.save_for_backward(output[1], x, *params)


def _backward(ctx, dy, _dticket, _dstate):
    ticket, x, *params = ctx.saved_tensors
    dx, *dparams = torch.ops.normdense.statnorm_backward(ticket, dy, x, params)
    return dx, dparams, [None] * ctx.n_state, None, None


statnorm.register_autograd(_backward, setup_context=_setup)


def compiled_call(layer, x):
    """The layer's output inside a torch.compile'd region: one operator call."""
    params = [p for p in layer._statnorm_params() if p is not None]
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params))
    state = [layer._buffers[n] for n in _state_names(layer)]
    y, _, new_state = torch.ops.normdense.statnorm(x, params, state, handle(layer), needs_grad)
    with torch.no_grad():
        for b, new in zip(state, new_state):
            b.copy_(new)
    return y
