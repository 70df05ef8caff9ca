"""StatDiff: statistical difference between the channels normalized together (Qiao et al., WS/BCN
paper, Sec. 6.1.4, Eq. 35)::

    StatDiff(g) = sqrt(E_{c in g}[(mu_c)^2] - (E_{c in g}[mu_c])^2) / E_{c in g}[sigma_c]

i.e. the (population) standard deviation of the channel means of group g divided by the mean of the
channel standard deviations. It is 0 when every channel of the group has the same mean (BN: all 0) and
grows as channels become under-represented relative to the others of their group. The paper computes it
from each channel's running mean/variance "after convolutional layers" (the input of the norm layer);
``statdiff`` computes the channel moments from a feature tensor, ``statdiff_from_moments`` takes them
directly (e.g. from running statistics).
"""
from typing import Tuple

import torch


def channel_moments(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and population std over every axis but 1 of an (N, C, ...) tensor."""
    if x.dim() < 2:
        raise ValueError(f'channel_moments expects (N, C, ...) features, got shape {tuple(x.shape)}')
    dims = [d for d in range(x.dim()) if d != 1]
    var, mean = torch.var_mean(x.double(), dim=dims, correction=0)
    return mean, var.sqrt()


def statdiff_from_moments(mean: torch.Tensor, std: torch.Tensor, num_groups: int = 1,
                          eps: float = 1e-12) -> torch.Tensor:
    """Eq. 35 for each of ``num_groups`` contiguous channel groups; returns a (G,) tensor.

    ``eps`` only guards the division when every channel of a group is constant (std 0).
    """
    mean, std = mean.double().flatten(), std.double().flatten()
    if mean.shape != std.shape:
        raise ValueError(f'mean and std must have the same shape, got {tuple(mean.shape)} and {tuple(std.shape)}')
    c = mean.numel()
    if not isinstance(num_groups, int) or num_groups <= 0 or c % num_groups:
        raise ValueError(f'StatDiff num_groups must be a positive int dividing the {c} channels, got {num_groups!r}')
    mu = mean.view(num_groups, -1)
    sd = std.view(num_groups, -1)
    spread = ((mu ** 2).mean(1) - mu.mean(1) ** 2).clamp(min=0).sqrt()
    return spread / sd.mean(1).clamp(min=eps)


def statdiff(x: torch.Tensor, num_groups: int = 1) -> torch.Tensor:
    """Eq. 35 per group from an (N, C, ...) feature tensor; returns a (G,) tensor (float64)."""
    mean, std = channel_moments(x)
    return statdiff_from_moments(mean, std, num_groups)
