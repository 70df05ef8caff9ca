"""Batch-Channel Normalization (Qiao et al., "Micro-Batch Training with Batch-Channel Normalization and Weight
Standardization", arXiv:1903.10520, Sec. 7, Eq. 40-43, Algorithm 1). BCN(X) = CN(BN'(X)):

    X_dot[:, c] = gamma^b_c (X[:, c] - mu_hat_c) / sigma_hat_c + beta^b_c                  (Eq. 40)
    Y_dot[b, g] = gamma^c_g (X_dot[b, g] - mu_bg) / sigma_bg + beta^c_g, over C/G x H x W   (Eq. 42)

``mode='batch'`` (Eq. 43): mu_hat, sigma_hat (Eq. 41) are batch statistics (a BN). ``mode='estimate'`` (Algorithm 1):
running estimates (init 0 and 1, not trained by the loss), moved with rate r before normalizing (steps 5-8)::

    mu_hat_c     += r (mean_{b,h,w} X[b, c, h, w] - mu_hat_c)                       (steps 1, 3)
    sigma_hat2_c += r (mean_{b,h,w} (X[b, c, h, w] - mu_hat_c)^2 - sigma_hat2_c)    (steps 2, 4; the old mu_hat)

once per training iteration (``_estimate.py``); sigma_hat = sqrt(sigma_hat2 + eps). Rationale: docs/ws_bcn.md.
"""
import functools
from typing import NamedTuple, Optional, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._distributed import reference_synced_moments, world_size
from ._estimate import EstimateRateMixin, in_backward
from ._statnorm import StatNorm2d
from ._utils import standardization_affine
from .declare import Switch, declare
from .eval_form import EvalForm, frozen_group_norm
from .groups import check_group_values, group_policy, resolve_groups

BCN_MODES = ('batch', 'estimate')


class BCNConfig(NamedTuple):
    num_groups: int
    eps: float
    group_affine: bool


class Residuals(NamedTuple):
    """What :func:`coeff_vjp` reads of :func:`coeff_map`'s work (channel-sized)."""
    rs: torch.Tensor  # 1 / sqrt(var + eps)
    a: torch.Tensor  # gamma^b rs
    a2: torch.Tensor  # a^2
    mc: torch.Tensor  # m - mean
    v: torch.Tensor
    d: torch.Tensor  # u's sample-channel means minus their group's
    r: torch.Tensor  # 1 / sigma_g
    w: torch.Tensor  # gamma^c
    s: torch.Tensor  # r gamma^c
    bw: torch.Tensor  # gamma^b


def coeff_map(cfg, m, v, mean, var, params, positions, count):
    """Eq. 40-42 as per-(n, c) (A, B) of y = A (x - m) + B from x's per-(n, c) moments m, v: u = a (x - mean) +
    beta^b, a = gamma^b / sqrt(var + eps); u's group moments by the law of total variance; A = gamma^c a / sigma_g,
    B = gamma^c (mu_u - mu_g) / sigma_g + beta^c. Pure."""
    dt = m.dtype  # p.to(dt) costs about 2 us even where it returns p
    bw, bb, w, b = (p if p.dtype == dt else p.to(dt) for p in params)
    n, c = m.shape
    g = cfg.num_groups
    per = c // g
    rs = torch.rsqrt(var + cfg.eps)
    a = bw * rs
    mc = m - mean
    a2 = a * a
    um = torch.addcmul(bb, mc, a).view(n, g, per)
    d = um - um.mean(2, keepdim=True)
    r = torch.rsqrt(torch.addcmul((v * a2).view(n, g, per), d, d).mean(2, keepdim=True) + cfg.eps)
    wv, bv = (w.view(g, 1), b.view(g, 1)) if cfg.group_affine else (w.view(g, per), b.view(g, per))
    s = r * wv
    coeffs = (s * a.view(g, per)).view(n, c), torch.addcmul(bv, s, d).view(n, c)
    # w, not its view: a view held by the backward's state pins the parameter (swap_tensors refuses to move it)
    return coeffs, Residuals(rs=rs, a=a, a2=a2, mc=mc, v=v, d=d, r=r, w=w, s=s, bw=bw)


def coeff_vjp(cfg, res, grads, wants_stats):
    """Closed-form VJP of :func:`coeff_map`: (dm, dv, dmean, dvar, d(batch_weight, batch_bias, weight, bias))."""
    rs, a, a2, mc, v, d, r, s, bw, w = res.rs, res.a, res.a2, res.mc, res.v, res.d, res.r, res.s, res.bw, res.w
    ga, gb = grads
    n, c = ga.shape
    g = cfg.num_groups
    per = c // g
    wv = w.view(g, 1) if cfg.group_affine else w.view(g, per)
    ga3, gb3 = ga.view(n, g, per), gb.view(n, g, per)
    gs = torch.addcmul(ga3 * a.view(g, per), gb3, d)
    if cfg.group_affine:
        gs = gs.sum(2, keepdim=True)
        db, dw, dr = gb3.sum((0, 2)), (gs * r).sum((0, 2)), gs * wv
    else:
        db, dw, dr = gb3.sum(0).view(c), (gs * r).sum(0).view(c), (gs * wv).sum(2, keepdim=True)
    # r = (var_g + eps)^-1/2 with var_g = group mean of (uv + d^2)
    dvg = dr * r.pow(3) * (-0.5 / per)
    gd = torch.addcmul(gb3 * s, d, dvg, value=2.0)
    dum = (gd - gd.mean(2, keepdim=True)).view(n, c)
    duv = (dvg * v.view(n, g, per)).view(n, c)
    dv = (dvg * a2.view(g, per)).view(n, c)
    dm = dum * a
    # a enters A = s a, um = a mc + beta^b, uv = a^2 v
    da = torch.addcmul((ga3 * s).view(n, c).addcmul_(dum, mc), duv, a, value=2.0).sum(0)
    dbw, dbb = da * rs, dum.sum(0)
    dmean = dvar = None
    if wants_stats:
        dmean = -dm.sum(0)
        dvar = da * bw * rs.pow(3) * -0.5
    return dm, dv, dmean, dvar, (dbw, dbb, dw, db)



@declare('BCN', switches=(Switch('bcn-ws', dict(type='BCN', mode='estimate'), groups=True, conv='WSConv2d',
                                hooks=('EstimateRateHook', )), ),
         state_keys=('batch_weight', ), state_name='bcn', convert='bcn',
         cases={'bcn-estimate': dict(mode='estimate', update_rate=0.1), 'bcn-batch': dict(mode='batch'),
                'bcn-batch-channel-affine': dict(mode='batch', group_affine=False)})
class BatchChannelNorm2d(StatNorm2d, EstimateRateMixin, nn.GroupNorm):
    """BCN (module docstring) of (N, C, H, W), (N, C, L) or (N, C) input; ``ValueError`` where a group holds one value.

    Args:
        num_features: channels C (positional, as mmcv's ``build_norm_layer`` passes it).
        num_groups: channel-stage groups G: an int dividing C (None: the paper's 32) or ``'auto'`` (layers/groups.py).
        channels_per_group: instead of ``num_groups``, about this many channels per group.
        mode: ``'estimate'`` (Algorithm 1, default) or ``'batch'`` (Eq. 43).
        eps: added to both stages' variances; must be > 0.
        momentum: batch mode's running-statistics momentum (eval statistics), in [0, 1].
        update_rate: fixed r in [0, 1]; None: ``EstimateRateHook``'s lr or ``set_update_rate``, else training raises.
        sync_stats: average the moments across processes (batch mode: like SyncBN); None: on in estimate mode only.
        group_affine: per-group channel-stage affine, shape (G,) (Eq. 42, default); False: per channel.
        fused: one pass with an analytic backward keeping only the input (default); False: the reference ops.
        backend: ``'aten'``, ``'triton'``, ``'auto'`` or None (``$NORMDENSE_BACKEND``, else auto); docs/gpu.md.
        device, dtype: of the parameters and buffers, as torch.nn's layers take them (``skip_init``, meta init).
    """
    _abbr_ = 'bcn'
    _SYNC_BATCH = True

    def __init__(self, num_features: int, num_groups: Union[int, str, None] = None, mode: str = 'estimate',
                 eps: float = 1e-5, momentum: float = 0.1, update_rate: Optional[float] = None,
                 sync_stats: Optional[bool] = None, group_affine: bool = True, fused: bool = True,
                 backend: Optional[str] = None, channels_per_group: Optional[int] = None, device=None, dtype=None):
        if mode not in BCN_MODES:
            raise ValueError(f'BCN mode must be one of {BCN_MODES}, got {mode!r}')
        policy = group_policy(num_groups, channels_per_group)
        num_groups = resolve_groups(num_features, num_groups, channels_per_group, layer='BCN')
        if not eps > 0:
            raise ValueError(f'BCN eps must be positive, got {eps!r}')
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0.0 <= momentum <= 1.0:
            raise ValueError(f'BCN momentum (batch mode\'s running statistics) must be a number in [0, 1], '
                             f'got {momentum!r}')
        super().__init__(num_groups, num_features, eps=eps, affine=False, device=device, dtype=dtype)
        self._init_estimate_rate(mode, update_rate)
        self.group_affine = group_affine
        self.group_policy = policy
        # the channel stage keeps GroupNorm's names so GN checkpoints load
        affine_shape = num_groups if group_affine else num_features
        factory = dict(device=device, dtype=dtype)
        self.weight = nn.Parameter(torch.ones(affine_shape, **factory))
        self.bias = nn.Parameter(torch.zeros(affine_shape, **factory))
        self.batch_weight = nn.Parameter(torch.ones(num_features, **factory))
        self.batch_bias = nn.Parameter(torch.zeros(num_features, **factory))
        self._init_statnorm(num_features, mode, (mode == 'estimate') if sync_stats is None else sync_stats, fused,
                            backend, momentum, **factory)

    def _batch_stage(self, x):
        if self.mode == 'estimate':
            # copies in eval: the graph must not hold buffers that a later call updates in place
            mean, var = self.estimates_from_input(x) if self.training else (self.running_mean.clone(),
                                                                            self.running_var.clone())
        elif self.training and self.sync_stats and world_size() > 1:
            mean, var = self._reference_synced_stats(x)
        elif x.numel() == 0:
            mean, var = self.running_mean, self.running_var
        else:
            # a checkpoint's recomputation tracks into copies: the forward tracked, and it must save the same tensors
            again = self.training and in_backward()
            mean, var = (self.running_mean.clone(), self.running_var.clone()) if again else (self.running_mean,
                                                                                              self.running_var)
            if self.training and not again:  # F.batch_norm does not count batches
                self.num_batches_tracked.add_(1)
            return F.batch_norm(x, mean, var, self.batch_weight, self.batch_bias, self.training, self.momentum,
                                self.eps)
        return self._affine(x, mean, var, self.batch_weight, self.batch_bias)

    def _reference_synced_stats(self, x):
        """Batch mode across processes by autograd (the engine VJP's reference), in float32 (fp16 overflows counts)."""
        with torch.autocast(x.device.type, enabled=False):
            mean, var, count = reference_synced_moments(self.compute_input(x))
        if not in_backward():
            self._track(mean.detach(), var.detach(), count)
        return mean, var

    def _affine(self, x, mean, var, batch_weight, batch_bias):
        scale = batch_weight * torch.rsqrt(var.to(batch_weight.dtype) + self.eps)
        shift = batch_bias - mean.to(scale.dtype) * scale
        return x * scale.view(1, -1, 1, 1).to(x.dtype) + shift.view(1, -1, 1, 1).to(x.dtype)

    def _channel_affine(self, weight, bias):
        """The channel stage's affine per channel (Eq. 42's per-group gamma^c, beta^c repeated over each group)."""
        if self.group_affine:
            # repeated per channel, so group_norm applies it in the same kernel
            per_group = self.num_channels // self.num_groups
            weight, bias = weight.repeat_interleave(per_group), bias.repeat_interleave(per_group)
        return weight, bias

    def _channel_stage(self, x, weight, bias):
        weight, bias = self._channel_affine(weight, bias)
        return F.group_norm(x, self.num_groups, weight, bias, self.eps)

    def _check_input(self, x):
        if x.dim() not in (2, 3, 4):  # (N, C) and (N, C, L): e.g. EncNet's codeword norm, a classifier's BN1d slot
            raise ValueError(f'BatchChannelNorm2d expects (N, C, H, W), (N, C, L) or (N, C) input, got shape '
                             f'{tuple(x.shape)}')
        if self.num_groups == self.num_channels:
            check_group_values(x, self.num_channels, self.num_groups, 'BatchChannelNorm2d')

    def _reference(self, x):
        if x.dim() != 4:
            return self._reference(x.reshape(*x.shape, *(1, ) * (4 - x.dim()))).reshape(x.shape)
        # the engine's dtype policy: under CUDA autocast F.group_norm returns float32
        return self._watch(self._channel_stage(self._batch_stage(x), self.weight, self.bias).to(x.dtype))

    def _fusable(self, x) -> bool:
        # empty input, or batch statistics of one value: the reference path's answer (empty, or F.batch_norm's error)
        if x.numel() == 0:
            return False
        return self.mode == 'estimate' or not self.training or x.numel() // x.shape[1] > 1

    def _statnorm_params(self):
        try:  # from the dict: attribute access goes through Module.__getattr__, a Python call each
            p = self._parameters
            return p['batch_weight'], p['batch_bias'], p['weight'], p['bias']
        except KeyError:  # a parametrized or replaced parameter
            return self.batch_weight, self.batch_bias, self.weight, self.bias

    def _config(self) -> BCNConfig:
        return BCNConfig(self.num_groups, self.eps, self.group_affine)

    def _coeff_maps(self, kernel: bool):
        cfg = self._config()
        if kernel:
            from ..kernels import bcn as kernels
            return (functools.partial(kernels.coeff_map, **cfg._asdict()),
                    functools.partial(kernels.coeff_vjp, **cfg._asdict()))
        return functools.partial(coeff_map, cfg), functools.partial(coeff_vjp, cfg)

    def reset_parameters(self):
        # nn.GroupNorm.__init__ calls this before our parameters exist
        if hasattr(self, 'batch_weight'):
            for p, v in ((self.weight, 1.0), (self.bias, 0.0), (self.batch_weight, 1.0), (self.batch_bias, 0.0)):
                nn.init.constant_(p, v)
            self._reset_statnorm_buffers()

    def extra_repr(self):
        rate = self.update_rate if self.update_rate is not None else 'lr (EstimateRateHook)'
        s = f'{self.num_channels}, num_groups={self.num_groups}, mode={self.mode!r}, eps={self.eps}'
        s += f', update_rate={rate}' if self.mode == 'estimate' else f', momentum={self.momentum}'
        s += f', sync_stats={self.sync_stats}, group_affine={self.group_affine}'
        return s + self._statnorm_repr()

    def eval_affine(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(scale, shift) per channel, float64, of the eval-mode first stage (Eq. 40); Eq. 42 stays per sample."""
        return standardization_affine(self.running_mean, self.running_var, self.eps, self.batch_weight,
                                      self.batch_bias)

    def eval_form(self, dtype: torch.dtype = torch.float64) -> EvalForm:
        """Eq. 40 with the estimates (batch mode: the running statistics) as a per-channel affine, which a conv
        before it absorbs, then Eq. 42 per sample: an ``nn.GroupNorm`` (this eps) holding the channel stage's
        affine per channel."""
        scale, shift = self.eval_affine()
        weight, bias = self._channel_affine(self.weight, self.bias)
        return EvalForm(scale.to(dtype), shift.to(dtype), frozen_group_norm(self.num_groups, weight, bias, self.eps),
                        weight.dtype, self.num_channels)

    @classmethod
    def convert_norm(cls, module: nn.Module, num_groups: int = 32, **bcn_kwargs) -> nn.Module:
        """Swap every BatchNorm2d / SyncBatchNorm / GroupNorm in ``module`` for a BCN (``_convert.convert_to_bcn``)."""
        from ._convert import convert_to_bcn
        return convert_to_bcn(cls, module, num_groups, **bcn_kwargs)
