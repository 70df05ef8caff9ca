"""Internal covariate shift as an Earth Mover (EM, Wasserstein-1) distance between a layer's output
distributions at two training iterations (Huang et al., Unitization, CVPR 2020, Sec. 3, Eq. 2-3, 6-7).

Samples: a layer's (N, C, H, W) output is turned into N*H*W samples in R^d with d = C (the channel vector
at each position of each image; ``feature_samples``).

``ics_moment_bound`` -- the critic-free lower bound of Theorem 2 (Eq. 6-7)::

    W(p_new, p_old) >= | E_{p_new}[f_{n,C}(x)] - E_{p_old}[f_{n,C}(x)] |
    f_{n,C}(x) = 1 / (n C^(n-1) d^(1/2)) * ( sum_{|x_i|<=C} x_i^n + sum_{x_i<-C} (-C)^n + sum_{x_i>C} C^n )

valid for any real C > 0 and integer n >= 2 (f_{n,C} is 1-Lipschitz). With ``C=None`` we take C as the
largest |x_i| of both sample sets (the paper's support bound C_0), so the bound is the difference of
the mean n-th moments scaled by 1/(n C^(n-1) sqrt(d)).

``em_distance`` -- an estimate of Eq. 2. The paper estimates the dual form (Eq. 3) with a trained
1-Lipschitz critic (supplementary material), which needs an inner optimization per measurement. We use
closed forms instead, each a *lower bound* of the d-dimensional EM distance under the Euclidean ground
metric because every projection used is 1-Lipschitz:

* ``'marginal'`` (default): the exact 1-D Wasserstein-1 distance of each channel's marginal,
  W1 = integral |F_new(t) - F_old(t)| dt computed from the sorted samples, averaged over channels
  (``reduction='max'`` gives the tighter max over channels).
* ``'sliced'``: the same 1-D distance along ``num_projections`` random unit directions, averaged (the
  sliced Wasserstein distance).

Both are exact for the empirical samples given; the distance between the underlying distributions also
includes finite-sample noise (two independent draws of the same distribution have a positive distance).
"""
from typing import Optional

import torch


def feature_samples(x: torch.Tensor, max_samples: Optional[int] = None,
                    generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """(N, C, *spatial) features -> (N * prod(spatial), C) samples, optionally a random subset."""
    if x.dim() < 2:
        raise ValueError(f'feature_samples expects (N, C, ...) features, got shape {tuple(x.shape)}')
    s = x.detach().movedim(1, -1).reshape(-1, x.shape[1])
    if max_samples is not None and s.shape[0] > max_samples:
        idx = torch.randperm(s.shape[0], generator=generator)[:max_samples].to(s.device)
        s = s[idx]
    return s


def f_nC(x: torch.Tensor, n: int, C: float) -> torch.Tensor:
    """The 1-Lipschitz function of Eq. 7 evaluated on each row of x (M, d); returns (M,)."""
    if not isinstance(n, int) or n < 2:
        raise ValueError(f'Eq. 7 needs an integer order n >= 2, got {n!r}')
    if not C > 0:
        raise ValueError(f'Eq. 7 needs C > 0, got {C!r}')
    x = x.double()
    d = x.shape[1]
    inside = torch.where(x.abs() <= C, x ** n, torch.zeros_like(x))
    below = torch.where(x < -C, torch.full_like(x, (-C) ** n), torch.zeros_like(x))
    above = torch.where(x > C, torch.full_like(x, C ** n), torch.zeros_like(x))
    return (inside + below + above).sum(1) / (n * C ** (n - 1) * d ** 0.5)


def ics_moment_bound(x_new: torch.Tensor, x_old: torch.Tensor, n: int = 2, C: Optional[float] = None) -> float:
    """Lower bound of the EM distance between the two sample sets (Theorem 2, Eq. 6)."""
    _check_pair(x_new, x_old)
    if C is None:
        C = max(x_new.abs().max().item(), x_old.abs().max().item(), 1e-12)
    return (f_nC(x_new, n, C).mean() - f_nC(x_old, n, C).mean()).abs().item()


def wasserstein_1d(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Exact W1 between the empirical distributions of the columns of a (M1, K) and b (M2, K); (K,)."""
    a, b = a.double(), b.double()
    if a.dim() == 1:
        a, b = a[:, None], b[:, None]
    sa = a.sort(0).values.T.contiguous()              # (K, M1)
    sb = b.sort(0).values.T.contiguous()
    allv = torch.cat([sa, sb], 1).sort(1).values      # (K, M1 + M2): breakpoints of both CDFs
    widths = allv[:, 1:] - allv[:, :-1]
    t = allv[:, :-1].contiguous()
    fa = torch.searchsorted(sa, t, right=True).double() / sa.shape[1]
    fb = torch.searchsorted(sb, t, right=True).double() / sb.shape[1]
    return ((fa - fb).abs() * widths).sum(1)


def em_distance(x_new: torch.Tensor, x_old: torch.Tensor, method: str = 'marginal', reduction: str = 'mean',
                num_projections: int = 64, generator: Optional[torch.Generator] = None) -> float:
    """Closed-form lower-bound estimate of the EM distance (Eq. 2) between two (M, d) sample sets."""
    _check_pair(x_new, x_old)
    if reduction not in ('mean', 'max'):
        raise ValueError(f"em_distance reduction must be 'mean' or 'max', got {reduction!r}")
    if method == 'marginal':
        per = wasserstein_1d(x_new, x_old)
    elif method == 'sliced':
        dirs = torch.randn(x_new.shape[1], num_projections, generator=generator, dtype=torch.float64)
        dirs = dirs / dirs.norm(dim=0, keepdim=True)
        per = wasserstein_1d(x_new.double().cpu() @ dirs, x_old.double().cpu() @ dirs)
    else:
        raise ValueError(f"em_distance method must be 'marginal' or 'sliced', got {method!r}")
    return (per.mean() if reduction == 'mean' else per.max()).item()


def _check_pair(x_new, x_old):
    if x_new.dim() != 2 or x_old.dim() != 2 or x_new.shape[1] != x_old.shape[1]:
        raise ValueError(f'expected two (M, d) sample sets with the same d, got {tuple(x_new.shape)} and '
                         f'{tuple(x_old.shape)}')
    if x_new.shape[0] == 0 or x_old.shape[0] == 0:
        raise ValueError('empty sample set')
