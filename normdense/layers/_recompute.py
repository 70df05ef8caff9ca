"""IterNorm's ``recompute`` option: keep only the layer's input for backward and recompute the rest.

IterNorm is a composition of autograd ops that each save their input, so plain autograd holds several
activation-sized tensors where ``nn.GroupNorm`` holds one (the StatNorm layers need no such option: their
engine keeps only x). :func:`checkpoint_once` runs the differentiable part as one autograd function whose
forward keeps only its tensor arguments (input, parameters, channel-sized statistics) and whose backward runs
the part again with autograd: activation checkpointing, the same ops on the same values as plain autograd's.

What the layer guarantees: side effects once (running statistics updated only when ``first=True``, the
forward); the recomputation sees what the forward saw (everything as arguments: parameters, so
``torch.func.functional_call`` works, and copies of mutable state; ``training`` fixed at forward time); no
random numbers (no RNG state saved). The forward's autocast state is restored for the recomputation; double
backward raises. ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` would do the same at a higher
fixed cost per call (docs/performance.md).
"""
from typing import Callable, Dict, Tuple

import torch
import torch.nn as nn
from torch.autograd.function import once_differentiable

from ._utils import device_autocast


def recompute_active(module: nn.Module, x: torch.Tensor) -> bool:
    """True when ``module`` (with a ``recompute`` attribute) should recompute in this forward: training
    mode, grad enabled, a non-empty input, and something to differentiate (input or a parameter).
    Eval mode, ``no_grad`` / inference mode and empty inputs run the plain path (nothing to save)."""
    if not (module.recompute and module.training and torch.is_grad_enabled() and x.numel() > 0):
        return False
    return x.requires_grad or any(p.requires_grad for p in module.parameters())


def _autocast_state(tensors) -> Dict[str, Tuple[bool, torch.dtype]]:
    state = {}
    for d in {'cpu'} | {t.device.type for t in tensors}:
        try:
            state[d] = device_autocast(d)
        except RuntimeError:  # a device type without autocast support (e.g. 'meta')
            pass
    return state


class _Recompute(torch.autograd.Function):
    """forward: ``fn(True, *args)`` without a graph, saving the tensor args; backward: ``fn(False, *args)``
    with autograd on detached copies of them, differentiated w.r.t. those that need a gradient."""

    @staticmethod
    def forward(ctx, fn, *args):
        ctx.fn = fn
        ctx.tensor_index = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ctx.other_args = [None if isinstance(a, torch.Tensor) else a for a in args]
        tensors = [args[i] for i in ctx.tensor_index]
        ctx.autocast = _autocast_state(tensors)
        ctx.save_for_backward(*tensors)
        return fn(True, *args)  # grad mode is off inside an autograd.Function's forward

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        args = list(ctx.other_args)
        inputs, positions = [], []
        for i, t in zip(ctx.tensor_index, ctx.saved_tensors):
            need = ctx.needs_input_grad[1 + i]
            args[i] = t.detach().requires_grad_(need)
            if need:
                inputs.append(args[i])
                positions.append(i)
        with torch.enable_grad(), _autocast(ctx.autocast):
            out = ctx.fn(False, *args)
        grads = torch.autograd.grad(out, inputs, grad_out, allow_unused=True) if inputs else ()
        result = [None] * len(args)
        for i, g in zip(positions, grads):
            result[i] = g
        return (None, *result)


class _autocast:
    """Re-enter the autocast state captured in the forward (per device type)."""

    def __init__(self, state):
        self.contexts = [torch.autocast(d, dtype=dtype, enabled=enabled) for d, (enabled, dtype) in state.items()]

    def __enter__(self):
        for c in self.contexts:
            c.__enter__()

    def __exit__(self, *exc):
        for c in reversed(self.contexts):
            c.__exit__(*exc)
        return False


def checkpoint_once(fn: Callable[..., torch.Tensor], *args) -> torch.Tensor:
    """``fn(first, *args)`` keeping only ``args`` for backward and running ``fn`` again in backward;
    ``first`` is True for the forward call and False for the recomputation (so buffer updates inside
    ``fn`` happen exactly once). Pass the input, the parameters and copies of any mutable state as
    ``args`` (tensors, or other values such as None / dtypes); ``fn`` must return one tensor."""
    return _Recompute.apply(fn, *args)
