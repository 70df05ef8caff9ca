"""Iterative Normalization (IterNorm): group-wise whitening by Newton's iteration.

Paper: Huang et al., "Iterative Normalization: Beyond Standardization towards Efficient Whitening"
(arXiv:1904.03441, CVPR 2019), Algorithm 1, Eq. 3-8. Per group of d channels, X in R^{d x m}, m = N*H*W::

    mu       = X 1 / m;  X_C = X - mu 1^T;  Sigma = X_C X_C^T / m + eps I   (Alg. 1 lines 4-6)
    Sigma_N  = Sigma / tr(Sigma)                                           (Eq. 4)
    P_0 = I, P_k = (3 P_{k-1} - P_{k-1}^3 Sigma_N) / 2, k = 1..T           (Eq. 3; coupled: newton_whitening_matrix)
    W        = P_T / sqrt(tr(Sigma))                                       (Eq. 5, ~ Sigma^{-1/2})
    X_hat    = W X_C,  then gamma * X_hat + beta

Training uses batch statistics and moves the running mean and whitening matrix with momentum (Eq. 8, init 0
and I), except in groups whose data covariance has tr(C) <= d * eps (no covariance; why: docs/iternorm.md);
eval uses them (an affine 1x1 conv). Training needs m >= 2 (``ValueError``). Gradients by autograd through the
T iterations, in float32 (float64 for float64 input) with autocast off; no host sync (docs/iternorm.md).
``method='zca'``: exact ZCA by eigendecomposition (DBN, Eq. 2), for analysis (unstable backward).
"""
from typing import List, Tuple

import torch
import torch.nn as nn

from ._estimate import in_backward
from ._recompute import checkpoint_once, recompute_active
from ._utils import affine_parameters, compiling, f64, memory_format_of, refuse_unbatched_update
from .declare import Switch, declare
from .eval_form import EvalForm

__all__ = ['IterNorm', 'newton_whitening_matrix', 'zca_whitening_matrix']


def _batched_eye(batch: int, size: int, like: torch.Tensor) -> torch.Tensor:
    return torch.eye(size, dtype=like.dtype, device=like.device).expand(batch, size, size)


def newton_whitening_matrix(xc: torch.Tensor, eps: float, T: int,
                            coupled: bool = True) -> torch.Tensor:
    """Algorithm 1 lines 6-12 for centred groups ``xc`` (G, d, m) -> W (G, d, d).

    ``coupled=False`` runs Eq. 3 literally; ``coupled=True`` (the layer's) runs ``M_k = (3 I - P_{k-1} Y_{k-1}) / 2``,
    ``P_k = M_k P_{k-1}``, ``Y_k = Y_{k-1} M_k``, ``Y_0 = Sigma_N``: the same P_k in exact arithmetic at the same
    cost, but stable at large T where the literal form amplifies round-off (docs/iternorm.md).
    """
    g, d, m = xc.shape
    eye = _batched_eye(g, d, xc)
    sigma = torch.baddbmm(eye, xc, xc.transpose(1, 2), beta=eps, alpha=1.0 / m)
    # tr(Sigma) >= d * eps > 0, so constant or all-zero groups still give a finite W
    trace = sigma.diagonal(dim1=-2, dim2=-1).sum(-1).view(g, 1, 1)
    sigma_n = sigma / trace
    p = eye
    if coupled:
        y = sigma_n
        for k in range(T):
            # P_0 = I: the first step needs no product
            mk = 1.5 * eye - 0.5 * (y if k == 0 else torch.bmm(p, y))
            y = torch.bmm(y, mk)
            p = mk if k == 0 else torch.bmm(mk, p)
    else:
        for k in range(T):
            if k == 0:
                p = 1.5 * eye - 0.5 * sigma_n  # P_0 = I: the cube is I
            else:
                p3 = torch.bmm(torch.bmm(p, p), p)
                p = torch.baddbmm(p, p3, sigma_n, beta=1.5, alpha=-0.5)
    return p / trace.sqrt()


def zca_whitening_matrix(xc: torch.Tensor, eps: float) -> torch.Tensor:
    """Exact Sigma^{-1/2} = D diag(lambda)^{-1/2} D^T by eigendecomposition (DBN, Eq. 2)."""
    g, d, m = xc.shape
    eye = _batched_eye(g, d, xc)
    sigma = torch.baddbmm(eye, xc, xc.transpose(1, 2), beta=eps, alpha=1.0 / m)
    evals, evecs = torch.linalg.eigh(sigma)
    # exact eigenvalues are >= eps; the clamp only removes round-off below it
    inv_sqrt = evals.clamp_min(eps).rsqrt()
    return torch.matmul(evecs * inv_sqrt.unsqueeze(-2), evecs.transpose(-2, -1))


@declare('IterNorm', switches=(Switch('iternorm', dict(type='IterNorm', group_size=64, T=5)), ),
         state_keys=('running_wm', ), state_name='iternorm', convert='iternorm', decays_as_norm=True)
class IterNorm(nn.Module):
    """IterNorm (Algorithm 1 + Eq. 8) for (N, C, *) input. Buffers: ``running_mean`` (C,), ``running_wm`` (G, g, g)
    with g = min(group_size, C); a smaller last group of r channels sits in ``running_wm[-1, :r, :r]``.

    Args:
        num_features: channels C (positional, as mmcv's ``build_norm_layer`` passes it).
        group_size: channels per group (64 in the paper), split in order; the last group is smaller if needed.
        T: Newton iterations (5 in the paper; T=0 only divides by sqrt(tr(Sigma))); ignored by ``method='zca'``.
        eps: added to the covariance diagonal (Alg. 1 line 6); must be > 0.
        momentum: lambda of the running averages (Eq. 8), in (0, 1].
        affine: learn the per-channel gamma (``weight``) and beta (``bias``).
        method: ``'newton'`` (IterNorm) or ``'zca'`` (exact eigendecomposition whitening, DBN).
        recompute: keep only the input for backward and recompute the layer there (docs/performance.md).
        device, dtype: of the parameters and buffers, as for ``nn.BatchNorm2d`` (so ``nn.utils.skip_init`` works).
    """
    # 'bn1', 'bn2', ... as the BN it replaces in the paper, so BN checkpoints' affine and mean map by key
    _abbr_ = 'bn'

    def __init__(self,
                 num_features: int,
                 group_size: int = 64,
                 T: int = 5,
                 eps: float = 1e-5,
                 momentum: float = 0.1,
                 affine: bool = True,
                 method: str = 'newton',
                 recompute: bool = False,
                 device=None,
                 dtype=None):
        super().__init__()
        for arg, val in (('num_features', num_features), ('group_size', group_size)):
            if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
                raise ValueError(f'IterNorm: {arg} must be a positive int, got {val!r}')
        if isinstance(T, bool) or not isinstance(T, int) or T < 0:
            raise ValueError(f'IterNorm: T must be an int >= 0, got {T!r}')
        if not eps > 0:
            raise ValueError(f'IterNorm: eps must be > 0 (keeps tr(Sigma) > 0), got {eps!r}')
        if not 0 < momentum <= 1:
            raise ValueError(f'IterNorm: momentum must be in (0, 1], got {momentum!r}')
        if method not in ('newton', 'zca'):
            raise ValueError(f"IterNorm: method must be 'newton' or 'zca', got {method!r}")
        self.num_features = num_features
        self.group_size = min(group_size, num_features)
        self.T = T
        self.eps = float(eps)
        self.momentum = float(momentum)
        self.affine = affine
        self.method = method
        self.recompute = bool(recompute)

        g = self.group_size
        full, rest = divmod(num_features, g)
        self.group_sizes: List[int] = [g] * full + ([rest] if rest else [])
        # (first channel, first group, number of groups, group size): equal groups are whitened in one batch
        self._blocks: List[Tuple[int, int, int, int]] = [(0, 0, full, g)]
        if rest:
            self._blocks.append((full * g, full, 1, rest))

        factory = dict(device=device, dtype=dtype)
        affine_parameters(self, num_features, affine, **factory)
        self.register_buffer('running_mean', torch.zeros(num_features, **factory))
        self.register_buffer('running_wm', torch.zeros(len(self.group_sizes), g, g, **factory))
        self.reset_running_stats()

    @property
    def num_groups(self) -> int:
        return len(self.group_sizes)

    def reset_running_stats(self) -> None:
        self.running_mean.zero_()
        self.running_wm.zero_()
        for _, g0, n, size in self._blocks:
            self.running_wm[g0:g0 + n, :size, :size] = torch.eye(size, device=self.running_wm.device,
                                                                  dtype=self.running_wm.dtype)

    def reset_parameters(self) -> None:
        self.reset_running_stats()
        if self.affine:
            nn.init.ones_(self.weight)
            nn.init.zeros_(self.bias)

    def whitening_matrix(self, xc: torch.Tensor) -> torch.Tensor:
        if self.method == 'zca':
            return zca_whitening_matrix(xc, self.eps)
        return newton_whitening_matrix(xc, self.eps, self.T)

    def _live_groups(self, xc: torch.Tensor) -> torch.Tensor:
        """(G,) bool: groups of ``xc`` (G, d, m) whose data covariance has tr(C) > d * eps (no host sync)."""
        d, m = xc.shape[1:]
        return xc.square().sum(dim=(1, 2)) > (d * m) * self.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 2 or x.size(1) != self.num_features:
            raise ValueError(f'IterNorm expects input (N, {self.num_features}, ...), '
                             f'got shape {tuple(x.shape)}')
        if x.numel() == 0:
            if not self.affine:
                return x
            shape = (1, -1) + (1, ) * (x.dim() - 2)
            # keep gamma/beta in the graph for DDP
            return x * self.weight.view(shape) + self.bias.view(shape)
        if self.training and x.numel() // x.size(1) < 2:
            raise ValueError(
                f'IterNorm needs at least 2 observations (N*H*W) per channel in training to whiten, got input '
                f'{tuple(x.shape)}: use it where batch x spatial size >= 2 (e.g. not on (1, C) features or a '
                f'1x1 map at batch 1), or put the layer in eval mode')
        if self.training:
            refuse_unbatched_update(self, x, self.running_mean)
        if recompute_active(self, x):
            return checkpoint_once(lambda first, inp, w, b: self._whiten(inp, True, first, w, b), x, self.weight,
                                   self.bias)
        # an activation checkpoint's recomputation (with_cp=True) updates nothing: the forward did. torch.compile
        # cannot trace the graph-task query, and its graphs never rerun the forward's Python in backward
        update = self.training and (compiling() or not in_backward())
        return self._whiten(x, self.training, update, self.weight, self.bias)

    def _whiten(self, x: torch.Tensor, training: bool, update: bool, weight, bias) -> torch.Tensor:
        """Algorithm 1 with batch (``training``; Eq. 8 if ``update``) or running statistics, then the affine."""
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        n, c = x.shape[:2]
        with torch.autocast(device_type=x.device.type, enabled=False):
            xm = x.to(dtype).transpose(0, 1).reshape(c, -1)
            m = xm.size(1)
            outs = []
            for c0, g0, ng, size in self._blocks:
                xb = xm[c0:c0 + ng * size].view(ng, size, m)
                if training:
                    mean = xb.mean(dim=2, keepdim=True)
                    xc = xb - mean
                    wm = self.whitening_matrix(xc)
                    if update:
                        with torch.no_grad():  # Eq. 8
                            live = self._live_groups(xc)
                            rm = self.running_mean[c0:c0 + ng * size].view(ng, size)
                            rm.copy_(torch.where(live.view(ng, 1),
                                                 rm.lerp(mean.detach().view(ng, size).to(rm.dtype), self.momentum), rm))
                            rw = self.running_wm[g0:g0 + ng, :size, :size]
                            rw.copy_(torch.where(live.view(ng, 1, 1), rw.lerp(wm.detach().to(rw.dtype), self.momentum),
                                                 rw))
                else:
                    mean = self.running_mean[c0:c0 + ng * size].to(dtype).view(ng, size, 1)
                    xc = xb - mean
                    wm = self.running_wm[g0:g0 + ng, :size, :size].to(dtype)
                outs.append(torch.bmm(wm, xc).reshape(ng * size, m))
            y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
            y = y.view(c, n, *x.shape[2:]).transpose(0, 1)
            if self.affine:
                shape = (1, c) + (1, ) * (x.dim() - 2)
                y = torch.addcmul(bias.to(dtype).view(shape), y, weight.to(dtype).view(shape))
        # the layout nn.BatchNorm2d gives (channels_last in, channels_last out)
        return y.to(x.dtype).contiguous(memory_format=memory_format_of(x))

    def eval_linear(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(matrix, bias), float64, of the eval-mode map ``gamma * W_run (x - mu_run) + beta``: a (C, C)
        block-diagonal matrix (one whitening block per group) and a (C,) vector."""
        wm = torch.zeros(self.num_features, self.num_features, dtype=torch.float64, device=self.running_wm.device)
        for c0, g0, ng, size in self._blocks:
            for i in range(ng):
                s = c0 + i * size
                wm[s:s + size, s:s + size] = f64(self.running_wm[g0 + i, :size, :size])
        if self.affine:
            wm = f64(self.weight)[:, None] * wm
        shift = -wm @ f64(self.running_mean)
        if self.affine:
            shift = shift + f64(self.bias)
        return wm, shift

    def eval_form(self, dtype: torch.dtype = torch.float64) -> EvalForm:
        """The eval map ``gamma * W_run (x - mu_run) + beta`` (Eq. 8's running statistics) as a (C, C) matrix and
        shift (it mixes channels: a conv takes it only ungrouped), standalone a ``ChannelLinear``."""
        matrix, shift = self.eval_linear()
        return EvalForm(matrix.to(dtype), shift.to(dtype), nn.Identity(), self.running_mean.dtype,
                        self.num_features)

    def extra_repr(self) -> str:
        return (f'{self.num_features}, group_size={self.group_size}, '
                f'groups={self.group_sizes if len(set(self.group_sizes)) > 1 else self.num_groups}, '
                f'T={self.T}, eps={self.eps}, momentum={self.momentum}, affine={self.affine}, '
                f'method={self.method!r}' + (', recompute=True' if self.recompute else ''))
