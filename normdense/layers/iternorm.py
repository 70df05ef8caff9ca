"""Iterative Normalization (IterNorm): group-wise whitening by Newton's iteration.

Paper: Huang et al., "Iterative Normalization: Beyond Standardization towards Efficient Whitening"
(arXiv:1904.03441, CVPR 2019), Algorithm 1, Eq. 3-8, Sec. 3.3.

For each channel group (d channels) of an unrolled input X in R^{d x m} (m = N*H*W: every pixel of
every sample is an observation, so batch size 1 works):

    mu       = X 1 / m                                  (Alg. 1 line 4)
    X_C      = X - mu 1^T                               (line 5)
    Sigma    = X_C X_C^T / m + eps I                    (line 6)
    Sigma_N  = Sigma / tr(Sigma)                        (Eq. 4: eigenvalues in (0, 1] -> converges)
    P_0 = I, P_k = (3 P_{k-1} - P_{k-1}^3 Sigma_N) / 2  (Eq. 3, k = 1..T; computed in the
                                                         equivalent coupled form, see
                                                         newton_whitening_matrix)
    W        = P_T / sqrt(tr(Sigma))                    (Eq. 5, ~ Sigma^{-1/2})
    X_hat    = W X_C,  then a per-channel affine gamma * X_hat + beta

Training uses batch statistics and updates the running mean and running whitening matrix with
momentum lambda (Eq. 8, init 0 and I); eval uses the running ones, so the layer is then an affine
1x1 convolution. Training needs m >= 2 observations (N*H*W, as BatchNorm needs more than one value per
channel): with one, the centred data is all zero, the output carries no information and the running
whitening matrix would drift towards eps^{-1/2} I, so a training forward with m = 1 raises ``ValueError``
(an empty input passes through untouched).

A group whose batch carries no covariance leaves its running mean and whitening matrix as they were
(the training output is still the paper's, finite: W X_C with X_C ~ 0). Sigma = C + eps I with the data
covariance C = X_C X_C^T / m; for C = 0 (a dead feature map, zero padding, a constant group) W is
eps^{-1/2} I up to T's convergence, and Eq. 8 averages W itself (not Sigma, as BatchNorm averages the
variance), so a single such batch at momentum 0.1 adds up to 0.1 * eps^{-1/2} = 32 to the running
matrix's diagonal (24 for d = 64, T = 5) and eval scales normal inputs as much. The criterion is
tr(C) <= d * eps (per group, a tensor condition: no host sync): the mean channel variance is at most
eps, so Sigma is dominated by the regulariser rather than the data and W reflects eps, not the
features (at tr(C) = d * eps the whitened output's variance is already only ~1/2). Features whose
variance stays below eps in *every* batch thus keep the initial running matrix (identity); rescale them
or lower eps. The criterion is per group: a dead channel inside a live group is whitened as the paper
says (its direction, eigenvalue eps, gets W's largest gain), as BatchNorm's running variance tracks a
dead channel.

On CUDA a training step never waits for the host: no value is read back (the running-statistics update above
is a tensor condition) and no tensor is built from Python data; the Newton steps are batched matrix products
over all groups of one size at once (at most two blocks: the equal groups and a smaller last one), so the
launches per step do not grow with the number of groups (tests/layers/test_iternorm_sync.py).

Gradients flow by autograd through the T iterations (the paper's Eq. 6-7 manual backward is not needed).
The whitening runs in float32 (float64 for float64 inputs) with autocast disabled.

``recompute=True`` (off by default) keeps only the layer's input for backward (plain autograd keeps the
centred groups and the whitened output, twice nn.GroupNorm's activation memory) and recomputes the
whole whitening in backward; see ``normdense/layers/_recompute.py`` and docs/performance.md.

``method='zca'`` computes the exact ZCA whitening matrix D diag(lambda)^{-1/2} D^T by eigen-
decomposition, as DBN does (Eq. 2), for comparison. Its backward is ill-conditioned when
eigenvalues repeat (e.g. m < d or constant channels give repeated eigenvalues eps); this is DBN's
known instability, so use it for analysis rather than training.

No mmcv/mmengine imports here: registration happens in ``normdense/registry.py``.
"""
from typing import List, Tuple

import torch
import torch.nn as nn

from ._utils import affine_parameters, f64
from ._estimate import in_backward
from ._recompute import checkpoint_once, recompute_active

__all__ = ['IterNorm', 'newton_whitening_matrix', 'zca_whitening_matrix']


def _batched_eye(batch: int, size: int, like: torch.Tensor) -> torch.Tensor:
    return torch.eye(size, dtype=like.dtype, device=like.device).expand(batch, size, size)


def newton_whitening_matrix(xc: torch.Tensor, eps: float, T: int,
                            coupled: bool = True) -> torch.Tensor:
    """Algorithm 1 lines 6-12 for centred groups ``xc`` of shape (G, d, m) -> W of shape (G, d, d).

    ``coupled=False`` runs Eq. 3 literally, ``P_k = (3 P_{k-1} - P_{k-1}^3 Sigma_N) / 2``.
    ``coupled=True`` (used by the layer) runs the coupled form ``M_k = (3 I - P_{k-1} Y_{k-1}) / 2``,
    ``P_k = M_k P_{k-1}``, ``Y_k = Y_{k-1} M_k`` with ``Y_0 = Sigma_N``: since ``Y_k = Sigma_N P_k``
    and all iterates commute with Sigma_N, it yields the **same P_k for every k in exact
    arithmetic** and costs the same three matrix products per step. It differs only in rounding:
    the literal form amplifies round-off once converged (the commutation it relies on is lost in
    floating point; at large T the literal form diverges from exact ZCA, in float32 to NaN, where the
    coupled one stays close: docs/iternorm.md).
    """
    g, d, m = xc.shape
    eye = _batched_eye(g, d, xc)
    sigma = torch.baddbmm(eye, xc, xc.transpose(1, 2), beta=eps, alpha=1.0 / m)
    # tr(Sigma) >= d * eps > 0 because eps > 0 is enforced, so degenerate (constant or all-zero)
    # groups still give a finite W.
    trace = sigma.diagonal(dim1=-2, dim2=-1).sum(-1).view(g, 1, 1)
    sigma_n = sigma / trace
    p = eye
    if coupled:
        y = sigma_n
        for k in range(T):
            # P_0 = I: first step is (3 I - Sigma_N) / 2 without a product
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


class IterNorm(nn.Module):
    """IterNorm layer (Algorithm 1 + Eq. 8) for inputs (N, C, *) -- conv maps or (N, C) features.

    Built by mmcv's ``build_norm_layer(dict(type='IterNorm'), C)`` which calls
    ``IterNorm(C, **cfg)`` and always passes ``eps``.

    Args:
        num_features: number of channels C.
        group_size: channels per whitening group (64 in the paper's experiments). Channels are
            split in order into groups of ``group_size``; if C is not a multiple, the **last group is
            smaller** (C % group_size channels). C < group_size gives one group of C channels.
            A group of 1 channel reduces to batch standardization (BN), as noted in the paper.
        T: Newton iterations (5 in the paper; T controls the extent of whitening, T=0 only
            divides by sqrt(tr(Sigma))). Ignored by ``method='zca'``. Large T is numerically safe
            (coupled iteration) but whitens small-eigenvalue directions, i.e. noise, the more.
        eps: added to the covariance diagonal (Alg. 1 line 6); must be > 0 so tr(Sigma) > 0.
        momentum: lambda of the running averages (Eq. 8), in (0, 1].
        affine: learn the per-channel gamma (``weight``, init 1) and beta (``bias``, init 0).
        method: ``'newton'`` (IterNorm) or ``'zca'`` (exact eigendecomposition whitening, DBN).
        recompute: in training, save only the input for backward (one nn.GroupNorm's activation
            memory instead of two) and recompute mean, whitening matrix and output in backward, at the
            cost of a second forward. The running statistics (Eq. 8) are still updated once per
            forward. Default ``False`` (plain autograd). No effect in eval mode or without grad.

    Buffers: ``running_mean`` (C,) and ``running_wm`` (G, g, g) with g = min(group_size, C); a
    smaller last group of r channels occupies ``running_wm[-1, :r, :r]`` (the rest stays 0).
    """
    # build_norm_layer names the attribute abbr + postfix: 'bn1', 'bn2', ... as for the BatchNorm
    # that IterNorm replaces in the paper, so the ResNet keys of BN checkpoints (bn1.weight, ...)
    # map onto the per-channel affine by name ('running_var' is then unexpected and 'running_wm'
    # missing: mmengine's non-strict loading only warns).
    _abbr_ = 'bn'

    def __init__(self,
                 num_features: int,
                 group_size: int = 64,
                 T: int = 5,
                 eps: float = 1e-5,
                 momentum: float = 0.1,
                 affine: bool = True,
                 method: str = 'newton',
                 recompute: bool = False):
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
        # (first channel, first group index, number of groups, group size): equal-size groups are
        # whitened together in one batched computation (at most two blocks).
        self._blocks: List[Tuple[int, int, int, int]] = [(0, 0, full, g)]
        if rest:
            self._blocks.append((full * g, full, 1, rest))

        affine_parameters(self, num_features, affine)
        self.register_buffer('running_mean', torch.zeros(num_features))
        self.register_buffer('running_wm', torch.zeros(len(self.group_sizes), g, g))
        self.reset_running_stats()

    @property
    def num_groups(self) -> int:
        return len(self.group_sizes)

    def reset_running_stats(self) -> None:
        self.running_mean.zero_()
        self.running_wm.zero_()
        for _, g0, n, size in self._blocks:
            self.running_wm[g0:g0 + n, :size, :size] = torch.eye(size, device=self.running_wm.device)

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
        """(G,) bool: groups of centred data ``xc`` (G, d, m) whose data covariance C = X_C X_C^T / m has
        tr(C) > d * eps, i.e. a mean channel variance above eps (see the module docstring). A tensor
        condition, so the update stays free of host syncs."""
        d, m = xc.shape[1:]
        return xc.square().sum(dim=(1, 2)) > (d * m) * self.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 2 or x.size(1) != self.num_features:
            raise ValueError(f'IterNorm expects input (N, {self.num_features}, ...), '
                             f'got shape {tuple(x.shape)}')
        if x.numel() == 0:  # e.g. a RoI head that received no RoIs: nothing to whiten
            if not self.affine:
                return x
            shape = (1, -1) + (1, ) * (x.dim() - 2)
            # keep gamma/beta in the graph (DDP expects every parameter to get a gradient)
            return x * self.weight.view(shape) + self.bias.view(shape)
        if self.training and x.numel() // x.size(1) < 2:
            raise ValueError(
                f'IterNorm needs at least 2 observations (N*H*W) per channel in training to whiten, got input '
                f'{tuple(x.shape)}: use it where batch x spatial size >= 2 (e.g. not on (1, C) features or a '
                f'1x1 map at batch 1), or put the layer in eval mode')
        if recompute_active(self, x):
            # training mode fixed at forward time; the running statistics are updated by the forward
            # call only (first=True), the recomputation in backward only rebuilds the graph
            # (the affine parameters are passed in, so the recomputation uses the forward's tensors)
            return checkpoint_once(lambda first, inp, w, b: self._whiten(inp, True, first, w, b), x, self.weight,
                                   self.bias)
        # an activation checkpoint's recomputation in backward (with_cp=True) updates nothing: the forward did
        return self._whiten(x, self.training, self.training and not in_backward(), self.weight, self.bias)

    def _whiten(self, x: torch.Tensor, training: bool, update: bool, weight, bias) -> torch.Tensor:
        """Algorithm 1 with batch statistics (``training``; Eq. 8 updates if ``update``) or the running
        ones, then the affine ``weight``/``bias`` (None without affine)."""
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        n, c = x.shape[:2]
        with torch.autocast(device_type=x.device.type, enabled=False):
            # unroll: (N, C, *) -> (C, m), m = N * prod(spatial)
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
                        with torch.no_grad():  # Eq. 8, for the groups whose batch carries a covariance
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
        return y.to(x.dtype).contiguous()

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

    def extra_repr(self) -> str:
        return (f'{self.num_features}, group_size={self.group_size}, '
                f'groups={self.group_sizes if len(set(self.group_sizes)) > 1 else self.num_groups}, '
                f'T={self.T}, eps={self.eps}, momentum={self.momentum}, affine={self.affine}, '
                f'method={self.method!r}' + (', recompute=True' if self.recompute else ''))
