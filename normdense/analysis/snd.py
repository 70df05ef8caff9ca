"""Stochastic Normalization Disturbance (Huang et al., IterNorm, CVPR 2019, Sec. 4.1, Eq. 9-10).

For a sample x and a normalization F that uses the statistics of a batch X^B, the normalized output
F(X^B; x) is a random variable over the draw of the batch. Its SND is (Eq. 9)
Delta_F(x) = E_{X^B} ||F(X^B; x) - E_{X^B} F(X^B; x)||_2, estimated with s draws as (Eq. 10)::

    Delta_hat_F(x) = 1/s sum_i || F(X_i^B; x) - 1/s sum_j F(X_j^B; x) ||

and the operation's SND is the average over sampled x (Delta_hat_F = 1/N sum Delta_hat_F(x)).

Our estimator: each batch X_i^B holds x itself plus B - 1 other samples drawn without replacement from
the pool (a sample is always part of the batch it is normalized with during training), and F receives
the batch with x as its first row.
"""
import copy
from typing import Callable, Optional

import torch
import torch.nn as nn


def batch_standardize(batch: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """BN's standardization (no affine) of a (B, d) batch: per dimension, batch mean and biased variance."""
    var, mean = torch.var_mean(batch, dim=0, correction=0, keepdim=True)
    return (batch - mean) / torch.sqrt(var + eps)


def snd(norm_fn: Callable[[torch.Tensor], torch.Tensor], data: torch.Tensor, batch_size: int,
        num_points: int = 64, num_draws: int = 16, generator: Optional[torch.Generator] = None) -> float:
    """Empirical SND (Eq. 10) of ``norm_fn`` averaged over ``num_points`` samples of ``data`` (M, d).

    ``norm_fn`` maps a (B, d) batch to its normalized (B, ...) batch; row 0 is the sample x.
    """
    if data.dim() != 2:
        raise ValueError(f'snd expects a (M, d) pool of samples, got shape {tuple(data.shape)}')
    m = data.shape[0]
    if not isinstance(batch_size, int) or not 1 <= batch_size <= m:
        raise ValueError(f'SND batch_size must be an int in [1, {m}] (the pool size), got {batch_size!r}')
    if num_points < 1 or num_draws < 2:
        raise ValueError(f'SND needs num_points >= 1 and num_draws >= 2, got {num_points}, {num_draws}')
    points = torch.randperm(m, generator=generator)[:num_points]
    total = 0.0
    for i in points.tolist():
        outs = []
        for _ in range(num_draws):
            others = torch.randperm(m - 1, generator=generator)[:batch_size - 1]
            others = others + (others >= i).long()  # skip x itself
            batch = data[torch.cat([torch.tensor([i]), others])]
            outs.append(norm_fn(batch)[0].flatten())
        outs = torch.stack(outs).double()
        total += (outs - outs.mean(0, keepdim=True)).norm(dim=1).mean().item()
    return total / len(points)


def module_snd(module: nn.Module, samples: torch.Tensor, batch_size: int, num_points: int = 16,
               num_draws: int = 8, generator: Optional[torch.Generator] = None) -> float:
    """SND of a layer's training-mode forward, with each of ``samples`` (M, C) - e.g. the per-position
    channel vectors of the layer's input - fed as a (B, C, 1, 1) batch. Runs on a deep copy so the
    layer's buffers (running statistics, estimates) are untouched. Estimate-mode layers (BCN, Unitization)
    that have no update rate yet (outside training) are probed with r = 0: their normalization then has
    no batch dependence at all, which is what their SND measures."""
    probe = copy.deepcopy(module).train()
    for p in probe.parameters():
        p.requires_grad_(False)
    for m in probe.modules():
        if getattr(m, 'needs_update_rate', False) and getattr(m, 'current_rate', None) is None:
            m.current_rate = 0.0
    ref = next(iter(list(probe.parameters()) + list(probe.buffers())), samples)

    def fn(batch):
        return probe(batch.to(device=ref.device, dtype=ref.dtype)[:, :, None, None]).flatten(1).cpu()

    with torch.no_grad():
        return snd(fn, samples, batch_size, num_points, num_draws, generator)
