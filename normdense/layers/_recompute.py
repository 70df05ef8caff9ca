"""IterNorm's ``recompute`` option: keep only the layer's input for backward and recompute the rest.

:func:`checkpoint_once` is activation checkpointing of one layer, cheaper per call than
``torch.utils.checkpoint``: side effects once, no RNG state, the forward's autocast state restored; double
backward differentiates the recomputation (docs/performance.md, "Activation memory").
"""
from typing import Callable, Dict, Tuple

import torch
import torch.nn as nn

from ._utils import compiling, device_autocast, in_transform


def recompute_active(module: nn.Module, x: torch.Tensor) -> bool:
    """Whether ``module`` recomputes this forward: ``recompute`` set, training, grad on, a non-empty input and
    something to differentiate; not under torch.compile (its partitioner chooses what to keep) nor inside a
    torch.func transform (vmap, grad: they take no custom autograd.Function without a vmap rule): plain autograd
    there, the same values."""
    if not (module.recompute and module.training and torch.is_grad_enabled() and x.numel() > 0):
        return False
    if compiling() or in_transform():
        return False
    return x.requires_grad or any(p.requires_grad for p in module.parameters())


def _autocast_state(tensors) -> Dict[str, Tuple[bool, torch.dtype]]:
    state = {}
    for d in {'cpu'} | {t.device.type for t in tensors}:
        try:
            state[d] = device_autocast(d)
        except RuntimeError:  # e.g. 'meta' has no autocast
            pass
    return state


class _Recompute(torch.autograd.Function):
    """forward: ``fn(True, *args)`` saving the tensor args; backward: ``fn(False, *args)`` on detached copies, or
    (double backward: create_graph, grad mode on) on the saved tensors themselves, so the gradient is
    differentiable in them."""

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
    def backward(ctx, grad_out):
        create_graph = torch.is_grad_enabled()
        args = list(ctx.other_args)
        inputs, positions = [], []
        for i, t in zip(ctx.tensor_index, ctx.saved_tensors):
            need = ctx.needs_input_grad[1 + i]
            # double backward needs the gradient as a function of the saved tensors; a first backward detaches
            args[i] = t if create_graph and need else t.detach().requires_grad_(need)
            if need:
                inputs.append(args[i])
                positions.append(i)
        with torch.enable_grad(), _autocast(ctx.autocast):
            out = ctx.fn(False, *args)
        grads = (torch.autograd.grad(out, inputs, grad_out, allow_unused=True, create_graph=create_graph)
                 if inputs else ())
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
    """``fn(first, *args)``, keeping only ``args`` and running ``fn`` again in backward; ``first`` is False there, so
    buffer updates happen once. Pass input, parameters and copies of mutable state; ``fn`` returns one tensor."""
    return _Recompute.apply(fn, *args)
