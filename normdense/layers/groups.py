"""How many groups a group norm takes, decided from the layer's own channel count (Group Normalization, Wu & He,
arXiv:1803.08494, Sec. 3.1 and Table 3: G = 32 or C/G = 16 work about equally well). docs/any_model.md:

* ``num_groups=int``: exactly that many; a layer whose channels it does not divide is a build error.
* ``num_groups='auto'``: the divisor of C nearest 32 with >= 2 channels per group (ties: fewer groups), else 1;
  32 wherever mmcv's ``dict(type='GN', num_groups=32)`` builds for C >= 64.
* ``channels_per_group=K``: G = C / K, with the divisor of C nearest K as the width (ties: the wider).
"""
from typing import Optional, Union

import torch.nn as nn

from .declare import Switch, declare

DEFAULT_GROUPS = 32
AUTO = 'auto'
AUTO_RULE = f"num_groups='auto' (the divisor nearest {DEFAULT_GROUPS} with >= 2 channels per group)"
POLICY = f'{AUTO_RULE} or channels_per_group=K'


def _divisors(n: int):
    return [d for d in range(1, n + 1) if n % d == 0]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def resolve_groups(num_channels: int, num_groups: Union[int, str, None] = None,
                   channels_per_group: Optional[int] = None, layer: str = 'GroupNorm') -> int:
    """The group count of a ``layer`` over ``num_channels`` channels (module docstring); None: K if given, else 32."""
    if not _is_int(num_channels) or num_channels <= 0:
        raise ValueError(f'{layer}: num_channels must be a positive int, got {num_channels!r}')
    if channels_per_group is not None:
        if num_groups is not None and num_groups != AUTO:
            raise ValueError(f'{layer}: give num_groups or channels_per_group, not both '
                             f'(num_groups={num_groups!r}, channels_per_group={channels_per_group!r})')
        if not _is_int(channels_per_group) or channels_per_group <= 0:
            raise ValueError(f'{layer}: channels_per_group must be a positive int, got {channels_per_group!r}')
        width = min(_divisors(num_channels), key=lambda d: (abs(d - channels_per_group), -d))
        return num_channels // width
    if num_groups is None:
        num_groups = DEFAULT_GROUPS
    if num_groups == AUTO:
        fits = [g for g in _divisors(num_channels) if num_channels // g >= 2] or [1]
        return min(fits, key=lambda g: (abs(g - DEFAULT_GROUPS), g))
    if not _is_int(num_groups) or num_groups <= 0:
        raise ValueError(f"{layer}: num_groups must be a positive int or 'auto', got {num_groups!r}")
    if num_channels % num_groups:
        raise ValueError(f'{layer}: num_groups={num_groups} does not divide this layer\'s {num_channels} channels; '
                         f'write {POLICY} to fit every layer')
    return num_groups


@declare('GNAuto', switches=(Switch('gn', dict(type='GNAuto', requires_grad=True), groups=True),
                             Switch('gn-ws', dict(type='GNAuto', requires_grad=True), groups=True, conv='WSConv2d')))
class GroupNorm(nn.GroupNorm):
    """``nn.GroupNorm`` with :func:`resolve_groups`'s count (``'GNAuto'``, default ``'auto'``); GN checkpoints load."""
    _abbr_ = 'gn'

    def __init__(self, num_channels: int, num_groups: Union[int, str] = AUTO,
                 channels_per_group: Optional[int] = None, eps: float = 1e-5, affine: bool = True,
                 device=None, dtype=None):
        groups = resolve_groups(num_channels, num_groups, channels_per_group, layer='GNAuto')
        super().__init__(groups, num_channels, eps=eps, affine=affine, device=device, dtype=dtype)
        self.group_policy = group_policy(num_groups, channels_per_group)


def group_policy(num_groups, channels_per_group=None) -> str:
    """The policy a layer's group count came from: ``'exact'``, ``'auto'`` or ``'channels_per_group=K'``."""
    if channels_per_group is not None:
        return f'channels_per_group={channels_per_group}'
    return AUTO if num_groups == AUTO else 'exact'


def check_group_values(x, num_channels: int, num_groups: int, layer: str) -> None:
    """Raise where a group holds one value per sample (channels per group x H x W = 1, any batch size): group
    normalization maps it to its bias with a zero gradient, which torch accepts silently. Shapes only."""
    per_group = num_channels // num_groups
    values = per_group
    for size in x.shape[2:]:
        values *= size
    if values == 1 and x.shape[0] > 0:
        raise ValueError(
            f'{layer}: each group holds a single value per sample (input {tuple(x.shape)}, {per_group} channel '
            f'per group), which group normalization maps to its bias alone; use num_groups <= '
            f'{max(num_channels // 2, 1)} (>= 2 channels per group) for 1x1 maps or (N, C) inputs')
