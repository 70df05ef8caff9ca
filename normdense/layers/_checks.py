"""Input checks shared by the layers, raised before torch's own less specific errors."""
import torch


def check_group_values(x: torch.Tensor, num_channels: int, num_groups: int, layer: str) -> None:
    """Group normalization of a group holding a single value outputs its bias alone (torch refuses it with
    "Expected more than 1 value per channel"): say why and what to change. Shapes only, no host sync."""
    per_group = num_channels // num_groups
    values = x.shape[0] * per_group
    for size in x.shape[2:]:
        values *= size
    if values == 1:
        raise ValueError(
            f'{layer}: each group holds a single value (input {tuple(x.shape)}, {per_group} channel per group), '
            f'which group normalization maps to its bias alone; use num_groups <= {max(num_channels // 2, 1)} '
            f'(>= 2 channels per group) for batch 1 on 1x1 maps')
