"""Power decomposition of a layer's activations (Labatie et al., Proxy Normalization, NeurIPS 2021, Sec. 3,
Eq. 5).

With mu_{x,c}, sigma_{x,c} the mean and std of channel c of input x over spatial positions alpha, and
mu_c, sigma_c, P_c the mean, std and power (mean square) over inputs x of the dataset (uniformly sampled),
the power of y in channel c splits into four terms::

    P_c[y] = (mu_c[y])^2 + (sigma_c[mu_{x,c}[y]])^2 + (mu_c[sigma_{x,c}[y]])^2 + (sigma_c[sigma_{x,c}[y]])^2
             dataset      instance (inter-x          pixel scale: inter-x similarity and variability
             scale        variability of means)      of the instance stds

(Eq. 5; it is an identity when population moments are used). The layer-level version averages each term
over channels; for a normalized y the four averages sum to 1, so they read as proportions. Failure modes
the paper reads off them: channel-wise *collapse* when the dataset-scale term takes all of P_c (y is
constant in channel c), *lack of instance variability* when the two inter-x variability terms vanish
(IN), and *channel imbalance* when P_c differs across channels.
"""
from typing import Dict, Tuple

import torch

POWER_TERMS = ('dataset', 'instance', 'pixel_similarity', 'pixel_variability')


def instance_moments(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """mu_{x,c} and sigma_{x,c} (population std over positions) of an (N, C, *spatial) tensor: (N, C) each."""
    if x.dim() < 2:
        raise ValueError(f'instance_moments expects (N, C, ...) features, got shape {tuple(x.shape)}')
    flat = x.detach().double().flatten(2) if x.dim() > 2 else x.detach().double()[:, :, None]
    var, mean = torch.var_mean(flat, dim=2, correction=0)
    return mean, var.sqrt()


def power_decomposition_from_moments(inst_mean: torch.Tensor, inst_std: torch.Tensor) -> Dict[str, torch.Tensor]:
    """The four per-channel terms of Eq. 5 and their sum ``'power'`` from (N, C) instance moments."""
    if inst_mean.shape != inst_std.shape or inst_mean.dim() != 2:
        raise ValueError('expected (N, C) instance means and stds of the same shape')
    m, s = inst_mean.double(), inst_std.double()
    terms = {
        'dataset': m.mean(0) ** 2,
        'instance': m.var(0, correction=0),
        'pixel_similarity': s.mean(0) ** 2,
        'pixel_variability': s.var(0, correction=0),
    }
    terms['power'] = sum(terms[k] for k in POWER_TERMS)
    return terms


def power_decomposition(x: torch.Tensor) -> Dict[str, torch.Tensor]:
    """Per-channel Eq. 5 terms of an (N, C, *spatial) tensor, the inputs x being its N samples."""
    return power_decomposition_from_moments(*instance_moments(x))


def power_summary(terms: Dict[str, torch.Tensor]) -> Dict[str, float]:
    """Layer-level numbers: each term averaged over channels, its share of the layer's power, and the
    channel imbalance (coefficient of variation of P_c over channels)."""
    out = {}
    total = terms['power'].mean().item()
    for k in POWER_TERMS:
        v = terms[k].mean().item()
        out[k] = v
        out[f'{k}_frac'] = v / total if total > 0 else float('nan')
    out['power'] = total
    p = terms['power']
    out['channel_imbalance'] = (p.std(correction=0) / p.mean()).item() if total > 0 else float('nan')
    return out
