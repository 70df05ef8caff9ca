"""Unitization (Huang et al., "An Internal Covariate Shift Bounding Algorithm for Deep Neural Networks by
Unitizing Layers' Outputs", CVPR 2020; Algorithm 1-2, Eq. 16). For X of shape (N, C, *spatial):

1. Batch standardization per channel, without affine (Algorithm 2 line 5; Algorithm 1 lines 1-4)::

       x_hat[k, i, j] = (x[k, i, j] - mu_i) / sqrt(sigma2_i + eps)

2. Per-sample partial unitization (Eq. 16; Algorithm 2 lines 9-14)::

       s_k      = sum_{i, j} x_hat[k, i, j]^2 / n          (all channels and positions of sample k)
       p_k      = 1 / sqrt(s_k + eps)
       x_bar    = (p_k * alpha_i + 1 - alpha_i) * x_hat[k, i, j]
       y        = gamma_i * x_bar + beta_i

alpha starts at 0 (Sec. 4.2), so a fresh layer is BN. n defaults to H*W (Sec. 3.6; 1 for (N, C) input, which is
Algorithm 1). ``mode='estimate'`` (our extension) standardizes with BCN-style running estimates instead of batch
statistics. Options, the Keras code's conventions and why: docs/unitization_equinorm.md.
"""
import functools
import numbers
from typing import Any, NamedTuple, Optional, Tuple

import torch
import torch.nn as nn

from ._estimate import EstimateRateMixin, in_backward
from ._statnorm import StatNorm2d
from ._utils import affine_parameters, standardization_affine
from .declare import Switch, declare
from .eval_form import EvalForm

UNITIZATION_MODES = ('batch', 'estimate')
NORM_DIVISORS = ('hw', 'hw_squared')
VAR_CORRECTIONS = ('none', 'keras')


class UnitizationConfig(NamedTuple):
    eps: float
    affine: bool
    n: Optional[float]
    norm_divisor: str
    var_correction: str


def _var_factor(cfg, count) -> float:
    return count / (count - 1 - cfg.eps) if cfg.var_correction == 'keras' else 1.0


def _divisor(cfg, positions: int) -> float:
    # Algorithm 2 line 9
    if cfg.n is not None:
        return cfg.n
    return float(positions) ** (2 if cfg.norm_divisor == 'hw_squared' else 1)


class Residuals(NamedTuple):
    """What :func:`coeff_vjp` reads of :func:`coeff_map`'s work."""
    rs: torch.Tensor  # 1 / sqrt(var + eps)
    rs2: torch.Tensor  # rs^2
    mc: torch.Tensor  # m - mean
    e: torch.Tensor  # v + mc^2
    p: torch.Tensor  # Eq. 16's p per sample (N, 1)
    alpha: torch.Tensor
    sc0: torch.Tensor  # p alpha + 1 - alpha
    w: Optional[torch.Tensor]  # gamma (None without affine)
    scale: torch.Tensor  # sc0 gamma
    a: torch.Tensor  # A
    k: float  # L / n
    count: Any  # the batch statistics' values per channel, or None


def coeff_map(cfg, m, v, mean, var, params, positions, count):
    """Both stages as per-(n, c) (A, B) of y = A (x - m) + B from x's per-(n, c) moments m, v (``count``: batch
    statistics): sum x_hat^2 = sum_c L (v + (m - mean)^2) rs^2, A = gamma (p alpha + 1 - alpha) rs. Pure."""
    dt = m.dtype  # p.to(dt) costs about 2 us even where it returns p
    alpha, w, b = (p if p is None or p.dtype == dt else p.to(dt) for p in params)
    if count is not None:
        var = var * _var_factor(cfg, count)
    rs = torch.rsqrt(var + cfg.eps)
    mc = m - mean
    e = torch.addcmul(v, mc, mc)
    rs2 = rs * rs
    k = positions / _divisor(cfg, positions)
    p = torch.rsqrt((e * rs2).sum(1, keepdim=True) * k + cfg.eps)
    sc0 = torch.addcmul(1.0 - alpha, p, alpha)
    scale = sc0 * w if cfg.affine else sc0
    a = scale * rs
    b_ = torch.addcmul(b, a, mc) if cfg.affine else a * mc
    return (a, b_), Residuals(rs=rs, rs2=rs2, mc=mc, e=e, p=p, alpha=alpha, sc0=sc0, w=w, scale=scale, a=a, k=k,
                              count=count)

def coeff_vjp(cfg, res, grads, wants_stats):
    """Closed-form VJP of :func:`coeff_map`: (dm, dv, dmean, dvar, (d alpha, d weight, d bias))."""
    rs, rs2, mc, e, p, alpha, sc0, w, scale, a, k, count = (res.rs, res.rs2, res.mc, res.e, res.p, res.alpha, res.sc0,
                                                            res.w, res.scale, res.a, res.k, res.count)
    ga, gb = grads
    ga_t = torch.addcmul(ga, gb, mc)  # B = A mc + beta
    g_scale = ga_t * rs
    if cfg.affine:
        dw, db = (g_scale * sc0).sum(0), gb.sum(0)
        g_sc0 = g_scale * w
    else:
        dw = db = None
        g_sc0 = g_scale
    dalpha = (g_sc0 * (p - 1.0)).sum(0)
    ds = (g_sc0 * alpha).sum(1, keepdim=True) * p.pow(3) * (-0.5 * k)  # d loss / d sum_c e rs^2
    de = ds * rs2
    dm = torch.addcmul(gb * a, de, mc, value=2.0)
    dmean = dvar = None
    if wants_stats:
        dmean = -dm.sum(0)
        g_rs = torch.addcmul((ga_t * scale).sum(0), (ds * e).sum(0), rs, value=2.0)
        dvar = g_rs * rs.pow(3) * (-0.5 * _var_factor(cfg, count))
    return dm, de, dmean, dvar, (dalpha, dw, db)


def partial_unitize(cfg, x_hat: torch.Tensor, alpha: torch.Tensor, weight, bias) -> torch.Tensor:
    """Stage 2 and the affine (Eq. 16; Algorithm 2 lines 9-14) on the standardized x_hat (N, C, *) in its compute
    dtype: p = 1 / sqrt(sum x_hat^2 / n + eps) per sample, y = gamma (p alpha + 1 - alpha) x_hat + beta."""
    bshape = (1, -1) + (1,) * (x_hat.dim() - 2)
    n = _divisor(cfg, x_hat[0, 0].numel())
    s = x_hat.pow(2).flatten(1).sum(1) / n
    p = torch.rsqrt(s + cfg.eps)
    alpha = alpha.to(x_hat.dtype)
    scale = p[:, None] * alpha[None, :] + (1.0 - alpha)[None, :]  # (N, C)
    if cfg.affine:
        scale = scale * weight.to(x_hat.dtype)[None, :]
        return x_hat * scale.view(scale.shape + (1,) * (x_hat.dim() - 2)) + bias.to(x_hat.dtype).view(bshape)
    return x_hat * scale.view(scale.shape + (1,) * (x_hat.dim() - 2))


@declare('Unitization', switches=(Switch('unitization', dict(type='Unitization', mode='estimate', requires_grad=True),
                                          hooks=('EstimateRateHook', )), ),
         state_keys=('alpha', ), state_name='unitization', convert='unitization', decays_as_norm=True,
         cases={'unitization-batch': {}, 'unitization-estimate': dict(mode='estimate', update_rate=0.1)})
class Unitization2d(StatNorm2d, EstimateRateMixin, nn.Module):
    """Unitization layer (Algorithm 2).

    Args:
        num_features: channels C (positional, as mmcv's ``build_norm_layer`` passes it).
        eps: of both the standardization and p (Eq. 16); must be > 0.
        momentum: batch mode's running-statistics momentum (None: cumulative average).
        affine: learn gamma and beta (alpha is always learned).
        n: divisor of the squared norm (Algorithm 2 line 9); None (default): the input's H*W.
        mode: ``'batch'`` (the paper) or ``'estimate'`` (running estimates moved with r, as BCN's).
        update_rate: fixed r in [0, 1]; None: ``EstimateRateHook``'s lr, else a training forward raises.
        sync_stats: all-reduce the estimate update across processes (estimate mode).
        norm_divisor: ``'hw'`` (the paper) or ``'hw_squared'`` (the Keras code), with ``n=None``.
        var_correction: ``'none'`` (the paper) or ``'keras'`` (training batch variance times m / (m - 1 - eps)).
        fused: one pass with an analytic backward keeping only the input (default); False: the reference ops.
        backend: ``'aten'``, ``'triton'``, ``'auto'`` or None (``$NORMDENSE_BACKEND``, else auto); docs/gpu.md.
        device, dtype: of the parameters and buffers, as torch.nn's layers take them (``skip_init``, meta init).
    """
    _abbr_ = 'un'

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1,
                 affine: bool = True, n: Optional[float] = None, mode: str = 'batch',
                 update_rate: Optional[float] = None, sync_stats: bool = True, norm_divisor: str = 'hw',
                 var_correction: str = 'none', fused: bool = True, backend: Optional[str] = None, device=None,
                 dtype=None):
        super().__init__()
        if not isinstance(num_features, int) or num_features <= 0:
            raise ValueError(f'Unitization num_features must be a positive int, got {num_features!r}')
        if mode not in UNITIZATION_MODES:
            raise ValueError(f'Unitization mode must be one of {UNITIZATION_MODES}, got {mode!r}')
        if n is not None and (isinstance(n, bool) or not isinstance(n, numbers.Real) or not n > 0):
            raise ValueError(f'Unitization n must be None (= H*W) or a positive number, got {n!r}')
        if not eps > 0:
            raise ValueError(f'Unitization eps must be positive, got {eps!r}')
        if momentum is not None and not 0.0 <= momentum <= 1.0:
            raise ValueError(f'Unitization momentum must lie in [0, 1] or be None, got {momentum!r}')
        if norm_divisor not in NORM_DIVISORS:
            raise ValueError(f'Unitization norm_divisor must be one of {NORM_DIVISORS}, got {norm_divisor!r}')
        if norm_divisor != 'hw' and n is not None:
            raise ValueError(f'Unitization norm_divisor={norm_divisor!r} applies to n=None only; with a fixed n, '
                             f'pass the divisor you want as n')
        if var_correction not in VAR_CORRECTIONS:
            raise ValueError(f'Unitization var_correction must be one of {VAR_CORRECTIONS}, got {var_correction!r}')
        self._init_estimate_rate(mode, update_rate)
        self.norm_divisor = norm_divisor
        self.var_correction = var_correction
        self.num_features = num_features
        self.eps = float(eps)
        self.affine = affine
        self.n = None if n is None else float(n)
        self.alpha = nn.Parameter(torch.zeros(num_features, device=device, dtype=dtype))
        affine_parameters(self, num_features, affine, device, dtype)
        self._init_statnorm(num_features, mode, sync_stats, fused, backend, momentum, device, dtype)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.alpha)
        if self.affine:
            nn.init.ones_(self.weight)
            nn.init.zeros_(self.bias)
        self._reset_statnorm_buffers()

    def _stage1_stats(self, x: torch.Tensor):
        """Stage 1's mean and variance (Algorithm 2 line 5), updating buffers in training."""
        dims = [d for d in range(x.dim()) if d != 1]
        if self.mode == 'estimate':
            mean, var = self.estimates_from_input(x) if self.training else (self.running_mean, self.running_var)
            return mean.to(x.dtype), var.to(x.dtype)
        if not self.training:
            return self.running_mean.to(x.dtype), self.running_var.to(x.dtype)
        count = x.numel() // x.shape[1]
        if count < 2:
            raise ValueError(
                f"Unitization2d(mode='batch') needs more than 1 value per channel in training to take batch "
                f"statistics, got input of shape {tuple(x.shape)}; use mode='estimate' for batch size 1 "
                f"on 1x1 maps")
        var, mean = torch.var_mean(x, dim=dims, correction=0)
        if not in_backward():  # a checkpoint's recomputation: the forward tracked
            self._track(mean.detach(), var.detach(), count)
        return mean, var * _var_factor(self._config(), count)

    def _check_input(self, x: torch.Tensor) -> None:
        if x.dim() < 2 or x.shape[1] != self.num_features:
            raise ValueError(f'Unitization2d({self.num_features}) expects (N, {self.num_features}, ...) input, '
                             f'got shape {tuple(x.shape)}')

    def _fusable(self, x: torch.Tensor) -> bool:
        # empty input (its own answer below) or batch statistics of one value (the reference's error)
        return x.numel() > 0 and (self.mode == 'estimate' or not self.training or x.numel() // x.shape[1] > 1)

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == 0:
            # zero RoIs: no statistics (NaN), parameters kept in the graph for DDP; estimate mode still joins
            # the other ranks' all-reduce (count 0) so collectives line up
            if self.mode == 'estimate' and self.training:
                self._stage1_stats(self.compute_input(x))
            return self._watch(x * 0 + sum(p.sum() for p in self.parameters()) * 0)
        xf = self.compute_input(x)
        mean, var = self._stage1_stats(xf)
        return self._watch(self._unitize(xf, mean, var, self.alpha, self.weight, self.bias).to(x.dtype))

    def _statnorm_params(self):
        try:  # from the dict: attribute access goes through Module.__getattr__, a Python call each
            p = self._parameters
            return p['alpha'], p['weight'], p['bias']
        except KeyError:  # a parametrized or replaced parameter
            return self.alpha, self.weight, self.bias

    def _config(self) -> 'UnitizationConfig':
        return UnitizationConfig(self.eps, self.affine, self.n, self.norm_divisor, self.var_correction)

    def _coeff_maps(self, kernel: bool):
        cfg = self._config()
        if kernel:
            from ..kernels import unitization as kernels
            return (functools.partial(kernels.coeff_map, **cfg._asdict()),
                    functools.partial(kernels.coeff_vjp, affine=cfg.affine))
        return functools.partial(coeff_map, cfg), functools.partial(coeff_vjp, cfg)

    def _unitize(self, x: torch.Tensor, mean: torch.Tensor, var: torch.Tensor, alpha: torch.Tensor, weight,
                 bias) -> torch.Tensor:
        """Both stages and the affine with the given statistics (x in its compute dtype)."""
        bshape = (1, -1) + (1,) * (x.dim() - 2)
        x_hat = (x - mean.view(bshape)) * torch.rsqrt(var.view(bshape) + self.eps)
        return partial_unitize(self._config(), x_hat, alpha, weight, bias)

    def eval_affine(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(scale, shift) per channel, float64, of the eval-mode stage 1; stage 2 depends on the data."""
        return standardization_affine(self.running_mean, self.running_var, self.eps)

    def eval_form(self, dtype: torch.dtype = torch.float64) -> EvalForm:
        """Stage 1 with the running statistics (estimates) as a per-channel affine, which a conv before it absorbs,
        then stage 2 (Eq. 16, per sample) as a :class:`UnitizationStage2`; standalone, stage 2 takes stage 1 as its
        input affine."""
        scale, shift = self.eval_affine()
        return EvalForm(scale.to(dtype), shift.to(dtype),
                        UnitizationStage2(self, torch.ones_like(scale), torch.zeros_like(scale)), self.alpha.dtype,
                        self.num_features, UnitizationStage2(self, scale, shift))

    def extra_repr(self) -> str:
        s = f'{self.num_features}, eps={self.eps}, affine={self.affine}, n={self.n or "H*W"}, mode={self.mode!r}'
        if self.norm_divisor != 'hw':
            s += f', norm_divisor={self.norm_divisor!r}'
        if self.var_correction != 'none':
            s += f', var_correction={self.var_correction!r}'
        s += self._statnorm_repr()
        if self.mode == 'estimate':
            rate = self.update_rate if self.update_rate is not None else 'lr (EstimateRateHook)'
            return s + f', update_rate={rate}'
        return s + f', momentum={self.momentum}'


class UnitizationStage2(nn.Module):
    """Unitization2d's eval form after stage 1: ``in_scale``/``in_shift`` (stage 1 where no conv absorbed it,
    else 1 and 0), then :func:`partial_unitize` with the layer's alpha, affine and configuration."""

    def __init__(self, src: Unitization2d, in_scale: torch.Tensor, in_shift: torch.Tensor):
        super().__init__()
        self.num_features = src.num_features
        self.cfg = src._config()  # eps, affine, n, divisor, variance correction: what partial_unitize reads
        self.register_buffer('alpha', src.alpha.detach().clone())
        if src.affine:
            self.register_buffer('weight', src.weight.detach().clone())
            self.register_buffer('bias', src.bias.detach().clone())
        else:
            self.weight = self.bias = None
        self.register_buffer('in_scale', in_scale.detach().to(src.alpha.dtype).clone())
        self.register_buffer('in_shift', in_shift.detach().to(src.alpha.dtype).clone())
        self.train(False)

    def forward(self, x):
        if x.numel() == 0:
            return x
        in_dtype = x.dtype
        if in_dtype in (torch.float16, torch.bfloat16):
            x = x.float()
        bshape = (1, -1) + (1,) * (x.dim() - 2)
        x_hat = x * self.in_scale.to(x.dtype).view(bshape) + self.in_shift.to(x.dtype).view(bshape)
        return partial_unitize(self.cfg, x_hat, self.alpha, self.weight, self.bias).to(in_dtype)

    def extra_repr(self):
        return f'{self.num_features}, eps={self.cfg.eps}, n={self.cfg.n or "H*W"}'
