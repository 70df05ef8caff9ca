"""Shared arithmetic of the layers' eval-time maps (``eval_affine`` / ``eval_linear``), which
``normdense.deploy.fuse`` folds into the neighbouring conv. Everything is returned in float64 so that folding
loses no precision before the final cast."""
from typing import Optional, Tuple

import torch


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
