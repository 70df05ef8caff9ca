"""Norm layers of a built model swapped for BCN in place (:meth:`BatchChannelNorm2d.convert_norm`, in the style of
detectron2's ``convert_frozen_batchnorm``); ``normdense.model_convert`` copies through :func:`copy_norm_into_bcn`."""
import torch
import torch.nn as nn


def convert_to_bcn(cls, module: nn.Module, num_groups: int = 32, **bcn_kwargs) -> nn.Module:
    """Swap every BatchNorm2d (incl. SyncBatchNorm) and GroupNorm in ``module`` (or ``module`` itself) for a BCN of
    class ``cls``; GN's ``num_groups`` carries over, what else does: :func:`copy_norm_into_bcn`. Returns the
    converted module (a new object only when ``module`` itself is a norm layer)."""
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
    # the source's device and float dtype, so copying rounds nothing
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
    """A BN's running statistics and affine into BCN's first stage (which then computes the eval-mode BN), or a
    GN's affine into its channel stage (``ValueError`` if it varies within a group and ``group_affine``)."""
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
