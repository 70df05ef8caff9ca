"""Input checks shared by the layers, raised before torch's own less specific errors."""
import torch


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
