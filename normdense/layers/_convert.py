"""Norm layers of a built model swapped for BCN in place, in the style of detectron2's
``convert_frozen_batchnorm``: what :meth:`BatchChannelNorm2d.convert_norm` runs (``normdense.model_convert``, the
model-wide conversion to any layer, copies through :func:`copy_norm_into_bcn` too). Imports no layer: the BCN class
comes as an argument."""
import torch
import torch.nn as nn


def convert_to_bcn(cls, module: nn.Module, num_groups: int = 32, **bcn_kwargs) -> nn.Module:
    """Swap every ``nn.BatchNorm2d`` (incl. SyncBatchNorm) and ``nn.GroupNorm`` in ``module`` (or ``module`` itself)
    for a BCN of class ``cls`` (:meth:`BatchChannelNorm2d.convert_norm`).

    What carries over:
    * BatchNorm2d -> its running mean/var become BCN's first-stage statistics (the estimates in ``'estimate'``
      mode) and its weight/bias become gamma^b/beta^b, so the first stage computes exactly the eval-mode BN; the
      channel stage starts at identity affine (a GN on top).
    * GroupNorm -> its weight/bias become the channel stage's (needs ``group_affine=False`` unless they are
      constant within each group); ``num_groups`` is taken from the GN; the first stage starts as identity
      (estimates 0 and 1).
    Returns the converted module (a new object only when ``module`` itself is a norm layer).
    """
    new = _to_bcn(cls, module, num_groups, bcn_kwargs)
    if new is not None:
        return new
    for name, child in module.named_children():
        converted = convert_to_bcn(cls, child, num_groups, **bcn_kwargs)
        if converted is not child:
            setattr(module, name, converted)
    return module


def _to_bcn(cls, module, num_groups, bcn_kwargs):
    tensors = list(module.parameters()) + list(module.buffers())
    # build on the source's device and float dtype before copying, so nothing is rounded
    place = dict(device=tensors[0].device, dtype=next((t.dtype for t in tensors if t.is_floating_point()),
                                                      None)) if tensors else {}
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, cls):
        bcn = cls(module.num_features, num_groups=num_groups, eps=module.eps, **bcn_kwargs).to(**place)
    elif type(module) is nn.GroupNorm:
        bcn = cls(module.num_channels, num_groups=module.num_groups, eps=module.eps, **bcn_kwargs).to(**place)
    else:
        return None
    copy_norm_into_bcn(bcn, module)
    bcn.train(module.training)
    return bcn


def copy_norm_into_bcn(bcn: nn.Module, module: nn.Module) -> None:
    """A BatchNorm's running statistics and affine into BCN's first stage (which then computes the eval-mode
    BN), or a GroupNorm's affine into its channel stage (``ValueError`` where a per-group affine cannot hold
    it: the GN's varies within a group)."""
    with torch.no_grad():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            if module.track_running_stats and module.running_mean is not None:
                bcn.running_mean.copy_(module.running_mean)
                bcn.running_var.copy_(module.running_var)
            if module.affine:
                bcn.batch_weight.copy_(module.weight)
                bcn.batch_bias.copy_(module.bias)
        elif module.affine:
            weight, bias = module.weight, module.bias
            if bcn.group_affine:
                per_group = weight.view(bcn.num_groups, -1), bias.view(bcn.num_groups, -1)
                if any((t - t[:, :1]).abs().max() > 0 for t in per_group):
                    raise ValueError('GroupNorm affine varies within a group; convert with group_affine=False '
                                     'to keep it')
                weight, bias = per_group[0][:, 0], per_group[1][:, 0]
            bcn.weight.copy_(weight)
            bcn.bias.copy_(bias)
