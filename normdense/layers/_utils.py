"""Small helpers of the layers: the float64 arithmetic of the eval-time maps (``eval_affine`` /
``eval_linear``, behind the layers' ``eval_form``), the per-channel affine parameters, autocast queries and
:func:`set_fused`."""
from typing import Optional, Tuple

import torch
import torch.nn as nn

from ..kernels.backend import autocast_on as autocast_enabled  # noqa: F401  (the engine's autocast queries)
from ..kernels.backend import autocast_state as device_autocast  # noqa: F401


def f64(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A detached float64 copy (None stays None)."""
    return None if t is None else t.detach().to(torch.float64)


def standardization_affine(mean: torch.Tensor, var: torch.Tensor, eps: float, weight: Optional[torch.Tensor] = None,
                           bias: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(scale, shift) per channel of ``weight * (x - mean) / sqrt(var + eps) + bias`` (no weight: 1, no bias:
    0), in float64."""
    scale = torch.rsqrt(f64(var) + eps)
    if weight is not None:
        scale = f64(weight) * scale
    shift = -f64(mean) * scale
    if bias is not None:
        shift = f64(bias) + shift
    return scale, shift


def affine_parameters(module: nn.Module, num_features: int, affine: bool, device=None, dtype=None) -> None:
    """``weight`` (ones) and ``bias`` (zeros) per channel on ``device`` in ``dtype``, or both registered as None
    without affine."""
    if affine:
        module.weight = nn.Parameter(torch.ones(num_features, device=device, dtype=dtype))
        module.bias = nn.Parameter(torch.zeros(num_features, device=device, dtype=dtype))
    else:
        module.register_parameter('weight', None)
        module.register_parameter('bias', None)


def set_fused(module: nn.Module, fused: bool = True) -> int:
    """Switch every StatNorm layer (BCN, GN+PN, Unitization) in ``module`` between the engine (True) and the
    reference composition (False); returns how many were switched."""
    from ._statnorm import StatNorm2d
    n = 0
    for mod in module.modules():
        if isinstance(mod, StatNorm2d):
            mod.fused = bool(fused)
            n += 1
    return n


# --- run-time queries the plain layers (IterNorm, WSConv2d, EquiConv2d) share -----------------------------------
def compiling() -> bool:
    """Whether torch.compile is tracing this call: Python-side queries (autograd's graph task, a tensor's value)
    cannot be traced there."""
    query = getattr(torch.compiler, 'is_compiling', None)  # torch >= 2.3
    if query is None:
        from torch._dynamo import is_compiling as query
    return query()


def memory_format_of(x: torch.Tensor) -> torch.memory_format:
    """The memory format ATen suggests for ``x`` (c10's ``is_channels_last_strides_2d/3d``): the layout of
    nn.BatchNorm2d's output, and the one nn.Conv2d follows for its weight."""
    if x.layout != torch.strided or x.dim() not in (4, 5):
        return torch.contiguous_format
    sizes, strides = x.shape, x.stride()
    if strides[1] == 0:
        return torch.contiguous_format
    low = 0
    for d in ((1, 3, 2, 0) if x.dim() == 4 else (1, 4, 3, 2, 0)):
        # ambiguous strides (size-1 dims) default to contiguous, as in c10
        if sizes[d] == 0 or strides[d] < low or (d == 0 and low == strides[1]):
            return torch.contiguous_format
        low = strides[d] * sizes[d]
    return torch.channels_last if x.dim() == 4 else torch.channels_last_3d


def in_transform() -> bool:
    """Whether a torch.func transform (vmap, grad, jacrev, ...) is running this call."""
    peek = getattr(torch._C._functorch, 'peek_interpreter_stack', None)
    return peek is not None and peek() is not None


def refuse_unbatched_update(module: nn.Module, x: torch.Tensor, buffer: torch.Tensor) -> None:
    """Raise, as nn.BatchNorm2d does, where a training forward under vmap would update an unbatched buffer in place
    with batched statistics (torch's own error then asks for a bug report)."""
    batched = getattr(torch._C._functorch, 'is_batchedtensor', None)
    if batched is not None and not compiling() and batched(x) and not batched(buffer):
        raise RuntimeError(
            f'{type(module).__name__} got a batched tensor (vmap) in training while its running statistics, which '
            'it updates in place, are not batched: vmap over torch.func.functional_call with the buffers batched '
            '(torch.func.stack_module_state), or use eval mode')
