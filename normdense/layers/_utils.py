"""Small helpers of the layers: the float64 arithmetic of the eval-time maps (``eval_affine`` /
``eval_linear``, behind the layers' ``eval_form``), the per-channel affine parameters, autocast queries and
:func:`set_fused`."""
from typing import Optional, Tuple

import torch
import torch.nn as nn

from ..kernels.backend import autocast_on as autocast_enabled  # noqa: F401  (one query: the engine's)


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


def device_autocast(device_type: str) -> Tuple[bool, torch.dtype]:
    if hasattr(torch, 'get_autocast_dtype'):  # torch >= 2.4: per-device-type queries
        return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
    if device_type == 'cpu':
        return torch.is_autocast_cpu_enabled(), torch.get_autocast_cpu_dtype()
    if device_type == 'cuda':
        return torch.is_autocast_enabled(), torch.get_autocast_gpu_dtype()
    raise RuntimeError(f'no autocast state query for {device_type!r} before torch 2.4')


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
