"""Batch-Channel Normalization (Qiao et al., "Micro-Batch Training with Batch-Channel Normalization and
Weight Standardization", Sec. 7, Eq. 40-43, Algorithm 1).

BCN(X) = CN(BN'(X)):

    X_dot[:, c] = gamma^b_c (X[:, c] - mu_hat_c) / sigma_hat_c + beta^b_c                  (Eq. 40)
    Y_dot[b, g] = gamma^c_g (X_dot[b, g] - mu_bg) / sigma_bg + beta^c_g, over C/G x H x W   (Eq. 42)

where mu_hat_c, sigma_hat_c make the first stage zero-mean, unit-variance over the data (Eq. 41).

``mode='batch'`` (large batch, Eq. 43): mu_hat, sigma_hat are the batch statistics (an ordinary BN,
running statistics with ``momentum`` for eval), optionally synchronized across processes.

``mode='estimate'`` (micro batch, Algorithm 1): the first stage always normalizes with running estimates
(init 0 and 1) that the loss does not train. Each training forward first updates them with rate r::

    mu_dot_c     = mean_{b,h,w} X[b, c, h, w]                        (step 1)
    sigma_dot2_c = mean_{b,h,w} (X[b, c, h, w] - mu_hat_c)^2          (step 2, around the *estimate*)
    mu_hat_c     += r (mu_dot_c - mu_hat_c)                           (step 3)
    sigma_hat2_c += r (sigma_dot2_c - sigma_hat2_c)                   (step 4)

and then normalizes with the updated estimates (steps 5-8); eval uses the same estimates. The update happens
once per training iteration: a layer called several times in one (a head shared over FPN levels) normalizes
each call with the iteration's starting estimates moved towards that call's moments and moves its buffers
once, towards the moments of all calls; an activation checkpoint's recomputation in backward repeats the
forward's values and updates nothing (``normdense/layers/_estimate.py``). The paper sets
r to the learning rate: ``EstimateRateHook`` (alias ``BCNRateHook``; normdense.hooks) copies the optimizer's
current lr into every estimate-mode layer before each iteration, or ``update_rate`` fixes r; r must lie in
[0, 1] wherever it is set (``normdense/layers/_estimate.py``, shared with Unitization). A training forward with neither
raises instead of silently leaving the estimates at their initial values (the public code's r buffer
starts at 0 and nothing sets it). In multi-process training the moments of steps 1-2 are averaged over
all processes (``sync_stats``) so every replica keeps identical estimates.

sigma_hat is taken as sqrt(sigma_hat2 + eps) for numerical safety, as BN does (eps > 0 is required).
The estimates stay float32 when the module is cast to fp16/bf16 (an r-sized update is below bf16's
resolution). Batch 1 on a 1x1 map works in estimate mode as long as each group of the channel stage has
>= 2 channels: with one value per group, Eq. 42 would output its bias alone, so that raises ``ValueError``.

Integration choices (documented in the README):
* BCN subclasses ``nn.GroupNorm`` because its output stage *is* a group norm. OpenMMLab treats it as a
  GN: mmengine's ``norm_decay_mult`` applies to all four of its affine parameters, mmdet's default init
  constant-initializes it, and mmdet's ``norm_eval=True`` (which only touches ``_BatchNorm``) leaves it
  in training mode as a whole: estimates keep adapting during fine-tuning as in the paper, never a
  half-frozen layer. Use ``update_rate=0.0`` to freeze the estimates explicitly.
* The channel-norm affine is per group (Eq. 42 and the authors' release, shape (G,)); ``group_affine=
  False`` makes it per channel (shape (C,)).
* ``fused=True`` (default) computes both stages as one map per (sample, channel) from the per-(n, c)
  moments of x (:func:`coeff_map`), with its closed-form VJP (:func:`coeff_vjp`) and a backward that keeps
  only x (the StatNorm engine, ``normdense/layers/_statnorm.py``): one reduction and one elementwise pass,
  like nn.GroupNorm. ``fused=False`` is the reference composition (an affine, then ``F.group_norm``) that
  the tests compare the fused path against.
"""
import functools
from typing import NamedTuple, Optional, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._distributed import reference_synced_moments, world_size
from ._estimate import EstimateRateMixin, in_backward
from ._statnorm import StatNorm2d
from ._utils import exporting, standardization_affine
from .groups import check_group_values, group_policy, resolve_groups

BCN_MODES = ('batch', 'estimate')


class BCNConfig(NamedTuple):
    num_groups: int
    eps: float
    group_affine: bool


def coeff_map(cfg, m, v, mean, var, params, positions, count):
    """Eq. 40-42 as per-(n, c) (A, B) of y = A (x - m) + B, from the per-(n, c) moments m, v of x and the
    first stage's statistics (mean, var): the first stage u = a (x - mean) + beta^b with
    a = gamma^b / sqrt(var + eps) (Eq. 40), the per-(n, g) moments of u from those of x (law of total
    variance), then the channel stage (Eq. 42): A = gamma^c a / sigma_g, B = gamma^c (mu_u - mu_g) /
    sigma_g + beta^c (B is the output's mean per (n, c): centred terms only). Pure."""
    bw, bb, w, b = (p.to(m.dtype) for p in params)
    n, c = m.shape
    g = cfg.num_groups
    per = c // g
    rs = torch.rsqrt(var + cfg.eps)
    a = bw * rs
    mc = m - mean
    a2 = a * a
    um = torch.addcmul(bb, mc, a).view(n, g, per)  # per-(n, c) mean of u
    d = um - um.mean(2, keepdim=True)
    r = torch.rsqrt(torch.addcmul((v * a2).view(n, g, per), d, d).mean(2, keepdim=True) + cfg.eps)
    wv, bv = (w.view(g, 1), b.view(g, 1)) if cfg.group_affine else (w.view(g, per), b.view(g, per))
    s = r * wv
    coeffs = (s * a.view(g, per)).view(n, c), torch.addcmul(bv, s, d).view(n, c)
    return coeffs, (rs, a, a2, mc, v, d, r, wv, s, bw)


def coeff_vjp(cfg, res, grads, wants_stats):
    """Closed-form VJP of :func:`coeff_map`: (dm, dv, dmean, dvar, (d batch_weight, d batch_bias, d weight,
    d bias)) for the gradients (gA, gB) of (A, B)."""
    rs, a, a2, mc, v, d, r, wv, s, bw = res
    ga, gb = grads
    n, c = ga.shape
    g = cfg.num_groups
    per = c // g
    ga3, gb3 = ga.view(n, g, per), gb.view(n, g, per)
    gs = torch.addcmul(ga3 * a.view(g, per), gb3, d)  # d loss / d s, per (n, c)
    if cfg.group_affine:
        gs = gs.sum(2, keepdim=True)
        db, dw, dr = gb3.sum((0, 2)), (gs * r).sum((0, 2)), gs * wv
    else:
        db, dw, dr = gb3.sum(0).view(c), (gs * r).sum(0).view(c), (gs * wv).sum(2, keepdim=True)
    # r = (var_g + eps)^-1/2, var_g = mean over the group of (uv + d^2): d var_g / P per (n, g)
    dvg = dr * r.pow(3) * (-0.5 / per)
    gd = torch.addcmul(gb3 * s, d, dvg, value=2.0)
    dum = (gd - gd.mean(2, keepdim=True)).view(n, c)  # d = um - mean_g(um)
    duv = (dvg * v.view(n, g, per)).view(n, c)
    dv = (dvg * a2.view(g, per)).view(n, c)
    dm = dum * a
    # a enters A = s a, um = a mc + beta^b, uv = a^2 v
    da = torch.addcmul((ga3 * s).view(n, c).addcmul_(dum, mc), duv, a, value=2.0).sum(0)
    dbw, dbb = da * rs, dum.sum(0)
    dmean = dvar = None
    if wants_stats:  # batch statistics: mean and var are functions of m, v (the engine chains them)
        dmean = -dm.sum(0)
        dvar = da * bw * rs.pow(3) * -0.5
    return dm, dv, dmean, dvar, (dbw, dbb, dw, db)



class BatchChannelNorm2d(StatNorm2d, EstimateRateMixin, nn.GroupNorm):
    """Batch-Channel Normalization (Eq. 40-43, Algorithm 1); see the module docstring.

    Args:
        num_features: channels C (positional, as mmcv's ``build_norm_layer`` passes it).
        num_groups: groups G of the channel stage (Eq. 42): an int (exact; must divide C; default (None) 32
            as in the paper) or ``'auto'`` (fits each layer's C; layers/groups.py; the norm switch's choice).
        channels_per_group: instead of ``num_groups``, about this many channels per group (layers/groups.py).
        mode: ``'estimate'`` (micro batch, Algorithm 1; default) or ``'batch'`` (Eq. 43).
        eps: added to both stages' variances.
        momentum: running-statistics momentum of ``'batch'`` mode (eval statistics), as in BN.
        update_rate: fixed r in [0, 1] for ``'estimate'`` mode. ``None`` (default) takes r from
            ``EstimateRateHook`` (the optimizer's current learning rate) or ``set_update_rate``.
        sync_stats: average the moments across processes in distributed training (estimate mode: the
            estimates' update; batch mode: the normalizing batch statistics, differentiably, like
            SyncBN). Default on for estimate mode; off for batch mode, where it costs a collective in
            the forward pass.
        group_affine: per-group channel-stage affine (Eq. 42, default) instead of per-channel.
        fused: one fused pass with an analytic backward keeping only the input (default); ``False``
            runs the reference composition of torch ops.
        backend: the fused path's kernels: ``'aten'``, ``'triton'`` (CUDA; CPU tensors only under
            ``TRITON_INTERPRET=1``), ``'auto'`` (Triton for CUDA tensors when it imports, else ATen) or None
            (default: the environment variable ``NORMDENSE_BACKEND``, else auto). docs/gpu.md.
    """
    _abbr_ = 'bcn'
    _SYNC_BATCH = True

    def __init__(self, num_features: int, num_groups: Union[int, str, None] = None, mode: str = 'estimate',
                 eps: float = 1e-5, momentum: float = 0.1, update_rate: Optional[float] = None,
                 sync_stats: Optional[bool] = None, group_affine: bool = True, fused: bool = True,
                 backend: Optional[str] = None, channels_per_group: Optional[int] = None):
        if mode not in BCN_MODES:
            raise ValueError(f'BCN mode must be one of {BCN_MODES}, got {mode!r}')
        # group policy (layers/groups.py): the channel stage and its per-group affine get the resolved G
        policy = group_policy(num_groups, channels_per_group)
        num_groups = resolve_groups(num_features, num_groups, channels_per_group, layer='BCN')
        if not eps > 0:  # eps <= 0 divides by zero on a constant group or channel
            raise ValueError(f'BCN eps must be positive, got {eps!r}')
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0.0 <= momentum <= 1.0:
            raise ValueError(f'BCN momentum (batch mode\'s running statistics) must be a number in [0, 1], '
                             f'got {momentum!r}')
        super().__init__(num_groups, num_features, eps=eps, affine=False)
        self._init_estimate_rate(mode, update_rate)
        self.group_affine = group_affine
        self.group_policy = policy
        # Batch-knowledge stage (Eq. 40) and channel stage (Eq. 42) affines. The channel stage's keep
        # GroupNorm's names so GN checkpoints map onto it.
        affine_shape = num_groups if group_affine else num_features
        self.weight = nn.Parameter(torch.ones(affine_shape))
        self.bias = nn.Parameter(torch.zeros(affine_shape))
        self.batch_weight = nn.Parameter(torch.ones(num_features))
        self.batch_bias = nn.Parameter(torch.zeros(num_features))
        self._init_statnorm(num_features, mode, (mode == 'estimate') if sync_stats is None else sync_stats, fused,
                            backend, momentum)

    def _batch_stage(self, x):
        if self.mode == 'estimate':
            # Copies in eval: the graph must not hold the buffers that a later call updates in place
            mean, var = self.estimates_from_input(x) if self.training else (self.running_mean.clone(),
                                                                            self.running_var.clone())
        elif self.training and self.sync_stats and world_size() > 1:
            mean, var = self._reference_synced_stats(x)
        elif x.numel() == 0:  # no samples (e.g. zero RoIs): nothing to normalize or to track
            mean, var = self.running_mean, self.running_var
        else:
            # a checkpoint's recomputation in backward tracks into copies (the forward did; and the same ops
            # must save the same tensors, which non-reentrant checkpointing checks)
            again = self.training and in_backward()
            mean, var = (self.running_mean.clone(), self.running_var.clone()) if again else (self.running_mean,
                                                                                              self.running_var)
            if self.training and not again:  # F.batch_norm tracks the statistics; the count is ours (nn.BatchNorm's)
                self.num_batches_tracked.add_(1)
            return F.batch_norm(x, mean, var, self.batch_weight, self.batch_bias, self.training, self.momentum,
                                self.eps)
        return self._affine(x, mean, var, self.batch_weight, self.batch_bias)

    def _reference_synced_stats(self, x):
        """Batch mode across processes: differentiable synced moments (``_distributed.reference_synced_moments``,
        not the engine's: autograd through it checks the engine's hand-written VJP), running statistics updated.
        In float32 for half inputs (a count of 121600 values is inf in fp16, and half sums lose the mean)."""
        with torch.autocast(x.device.type, enabled=False):
            mean, var, count = reference_synced_moments(self.compute_input(x))
        if not in_backward():
            self._track(mean.detach(), var.detach(), count)
        return mean, var

    def _affine(self, x, mean, var, batch_weight, batch_bias):
        # One fused per-channel affine: gamma^b (x - mu_hat) / sigma_hat + beta^b.
        scale = batch_weight * torch.rsqrt(var.to(batch_weight.dtype) + self.eps)
        shift = batch_bias - mean.to(scale.dtype) * scale
        return x * scale.view(1, -1, 1, 1).to(x.dtype) + shift.view(1, -1, 1, 1).to(x.dtype)

    def _channel_stage(self, x, weight, bias):
        if self.group_affine:
            # A per-group affine equals a per-channel one with each group's value repeated, which lets
            # group_norm apply it in the same kernel.
            per_group = self.num_channels // self.num_groups
            weight, bias = weight.repeat_interleave(per_group), bias.repeat_interleave(per_group)
        return F.group_norm(x, self.num_groups, weight, bias, self.eps)

    def forward(self, x):
        if x.dim() in (2, 3):  # (N, C[, L]), as nn.GroupNorm and BN1d take it (EncNet's codeword norm, a
            # classifier head's BN1d slot): an L x 1 (1 x 1) map
            return self.forward(x.reshape(*x.shape, *(1, ) * (4 - x.dim()))).reshape(x.shape)
        if x.dim() != 4:
            raise ValueError(f'BatchChannelNorm2d expects (N, C, H, W), (N, C, L) or (N, C) input, got shape '
                             f'{tuple(x.shape)}')
        if self.num_groups == self.num_channels:  # only one channel per group can make a single-value group
            check_group_values(x, self.num_channels, self.num_groups, 'BatchChannelNorm2d')
        if exporting():
            return self._export_form(x)
        if self.fused and self._fusable(x):
            return self._statnorm_forward(x)
        # the engine's dtype policy (StatNorm2d): under CUDA autocast F.group_norm returns float32
        return self._watch(self._channel_stage(self._batch_stage(x), self.weight, self.bias).to(x.dtype))

    def _eval_form(self, x):
        """The eval output in standard ops (ONNX export): Eq. 40 with the running statistics or estimates as one
        per-channel affine, then Eq. 42 as ``F.group_norm``."""
        u = self._affine(self.compute_input(x), self.running_mean, self.running_var, self.batch_weight,
                         self.batch_bias)
        return self._channel_stage(u, self.weight, self.bias).to(x.dtype)

    def _fusable(self, x) -> bool:
        # no positions or samples, or batch statistics of one value: the reference path has the answer
        # (an empty output, or F.batch_norm's error)
        if x.numel() == 0:
            return False
        return self.mode == 'estimate' or not self.training or x.shape[0] * x.shape[2] * x.shape[3] > 1

    def _statnorm_params(self):
        return self.batch_weight, self.batch_bias, self.weight, self.bias

    def _coeff_maps(self, triton: bool):
        cfg = BCNConfig(self.num_groups, self.eps, self.group_affine)
        if triton:
            from ..kernels import bcn as kernels  # triton imported only when the Triton backend runs
            return (functools.partial(kernels.coeff_map, **cfg._asdict()),
                    functools.partial(kernels.coeff_vjp, **cfg._asdict()))
        return functools.partial(coeff_map, cfg), functools.partial(coeff_vjp, cfg)

    def reset_parameters(self):
        # nn.GroupNorm.__init__ calls this before our parameters exist.
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
        """(scale, shift) per channel, float64, of the eval-mode first stage (Eq. 40 with the running
        statistics or estimates); the channel stage (Eq. 42) stays per sample."""
        return standardization_affine(self.running_mean, self.running_var, self.eps, self.batch_weight,
                                      self.batch_bias)

    @classmethod
    def convert_norm(cls, module: nn.Module, num_groups: int = 32, **bcn_kwargs) -> nn.Module:
        """Swap every ``nn.BatchNorm2d`` (incl. SyncBatchNorm) and ``nn.GroupNorm`` in ``module`` (or ``module``
        itself) for a BCN, in the style of detectron2's ``convert_frozen_batchnorm``:
        ``layers/_convert.py``'s :func:`convert_to_bcn`, which says what carries over."""
        from ._convert import convert_to_bcn
        return convert_to_bcn(cls, module, num_groups, **bcn_kwargs)
