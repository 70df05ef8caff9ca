"""How many groups a group norm takes, decided from the layer's own channel count.

Group Normalization (Wu & He, arXiv:1803.08494, Sec. 3.1 and Table 3) uses either a fixed number of groups
(G = 32) or a fixed number of channels per group (C/G = 16); both work within a fraction of a point. A model
zoo mixes channel counts that 32 does not divide (HRNet's 18, MobileNetV2's 16, DeepLabV3+'s 48-channel
bottleneck, CGNet's 35), so a config-level ``num_groups=32`` cannot fit every layer. The policy here:

* ``num_groups=int``: exactly that many groups; a layer whose channels it does not divide is a build error
  (one line naming the channel count and the policy forms below). What a user writes stays exact.
* ``num_groups='auto'`` (the norm switch's default): the divisor of C nearest 32 that keeps at least 2
  channels per group (ties: fewer groups, i.e. more channels per group); 1 group where no divisor does.
  Where C >= 64 and 32 divides C this is exactly mmcv's ``dict(type='GN', num_groups=32)``, so layers that
  config could build keep their function; at C = 32 it takes 16 groups: one channel per group would make a
  group of a 1x1 map (a pooling branch) a single value, which GN maps to its bias and BCN refuses.
* ``channels_per_group=K``: G = C / K where K divides C, else the divisor of C nearest K is taken as the
  group width (ties: the wider group).

:class:`GroupNorm` is ``nn.GroupNorm`` with this policy, registered as ``'GNAuto'`` (default ``'auto'``; mmcv's
``'GN'`` keeps its exact ``num_groups``); BCN and GN+PN take the same arguments (their default stays the papers'
exact 32, so existing configs and checkpoints build the same layers).
"""
from typing import Optional, Union

import torch.nn as nn

DEFAULT_GROUPS = 32  # the GN paper's G
AUTO = 'auto'
AUTO_RULE = f"num_groups='auto' (the divisor nearest {DEFAULT_GROUPS} with >= 2 channels per group)"
POLICY = f'{AUTO_RULE} or channels_per_group=K'


def _divisors(n: int):
    return [d for d in range(1, n + 1) if n % d == 0]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def resolve_groups(num_channels: int, num_groups: Union[int, str, None] = None,
                   channels_per_group: Optional[int] = None, layer: str = 'GroupNorm') -> int:
    """The group count of a ``layer`` over ``num_channels`` channels under the policy above. ``num_groups=None``
    (not given): ``channels_per_group`` where given, else the papers' exact 32."""
    if not _is_int(num_channels) or num_channels <= 0:
        raise ValueError(f'{layer}: num_channels must be a positive int, got {num_channels!r}')
    if channels_per_group is not None:
        if num_groups is not None and num_groups != AUTO:
            raise ValueError(f'{layer}: give num_groups or channels_per_group, not both '
                             f'(num_groups={num_groups!r}, channels_per_group={channels_per_group!r})')
        if not _is_int(channels_per_group) or channels_per_group <= 0:
            raise ValueError(f'{layer}: channels_per_group must be a positive int, got {channels_per_group!r}')
        # nearest divisor; ties to the wider group (the larger divisor comes first in the sort key)
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


class GroupNorm(nn.GroupNorm):
    """``nn.GroupNorm`` whose group count follows :func:`resolve_groups` (config type ``'GNAuto'``).

    Built by mmcv's ``build_norm_layer(dict(type='GNAuto'), C)`` as ``GroupNorm(C)``; its state dict and
    mmcv attribute names (``gn1``, ...) are those of ``nn.GroupNorm``, so GN checkpoints load unchanged.
    ``group_policy`` records how the count was chosen (for the norm switch's summary).
    """
    _abbr_ = 'gn'

    def __init__(self, num_channels: int, num_groups: Union[int, str] = AUTO,
                 channels_per_group: Optional[int] = None, eps: float = 1e-5, affine: bool = True,
                 device=None, dtype=None):
        groups = resolve_groups(num_channels, num_groups, channels_per_group, layer='GNAuto')
        super().__init__(groups, num_channels, eps=eps, affine=affine, device=device, dtype=dtype)
        self.group_policy = group_policy(num_groups, channels_per_group)


def group_policy(num_groups, channels_per_group=None) -> str:
    """A short name of the policy a layer's group count came from (``'exact'``, ``'auto'``, ``'cpg=16'``)."""
    if channels_per_group is not None:
        return f'channels_per_group={channels_per_group}'
    return AUTO if num_groups == AUTO else 'exact'


def check_group_values(x, num_channels: int, num_groups: int, layer: str) -> None:
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
