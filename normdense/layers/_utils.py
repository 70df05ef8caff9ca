"""Small helpers of the layers: input checks raised before torch's less specific errors, the float64
arithmetic of the eval-time maps (``eval_affine`` / ``eval_linear``, folded by ``normdense.deploy.fuse``), and
autocast queries that work on every supported torch."""
from typing import Optional, Tuple

import torch
import torch.nn as nn


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


def affine_parameters(module: nn.Module, num_features: int, affine: bool) -> None:
    """``weight`` (ones) and ``bias`` (zeros) per channel, or both registered as None without affine."""
    if affine:
        module.weight = nn.Parameter(torch.ones(num_features))
        module.bias = nn.Parameter(torch.zeros(num_features))
    else:
        module.register_parameter('weight', None)
        module.register_parameter('bias', None)
