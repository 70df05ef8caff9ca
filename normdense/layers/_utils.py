"""Small helpers of the layers: the float64 arithmetic of the eval-time maps (``eval_affine`` /
``eval_linear``, folded by ``normdense.deploy.fuse``) and the per-channel affine parameters."""
from typing import Optional, Tuple

import torch
import torch.nn as nn


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


def affine_parameters(module: nn.Module, num_features: int, affine: bool) -> None:
    """``weight`` (ones) and ``bias`` (zeros) per channel, or both registered as None without affine."""
    if affine:
        module.weight = nn.Parameter(torch.ones(num_features))
        module.bias = nn.Parameter(torch.zeros(num_features))
    else:
        module.register_parameter('weight', None)
        module.register_parameter('bias', None)


def exporting() -> bool:
    """True while a graph of the model is recorded for another runtime: either of torch.onnx's exporters
    (TorchScript, dynamo), torch.export or torch.jit.trace. The StatNorm layers then run their eval form of
    standard ops (:meth:`StatNorm2d._export_form`): the engine's autograd Function and its torch.library
    operator have no ONNX translation, and a recorded graph keeps none of the engine's Python state."""
    return torch.onnx.is_in_onnx_export() or torch.jit.is_tracing() or _is_exporting()


_is_exporting = getattr(torch.compiler, 'is_exporting', lambda: False)  # torch >= 2.5 has it
