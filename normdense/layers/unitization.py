"""Unitization (Huang et al., "An Internal Covariate Shift Bounding Algorithm for Deep Neural Networks by
Unitizing Layers' Outputs", CVPR 2020; Algorithm 1-2, Eq. 16).

Two stages, for an input X of shape (N, C, *spatial):

1. Batch standardization per channel, without affine (Algorithm 2, line 5; Algorithm 1, lines 1-4)::

       x_hat[k, i, j] = (x[k, i, j] - mu_i) / sqrt(sigma2_i + eps)

2. Per-sample partial unitization (Eq. 16 with the conv-layer norm of Algorithm 2, lines 9-14)::

       s_k      = sum_{i, j} x_hat[k, i, j]^2 / n          (all channels and positions of sample k)
       p_k      = 1 / sqrt(s_k + eps)
       x_bar    = (p_k * alpha_i + 1 - alpha_i) * x_hat[k, i, j]
       y        = gamma_i * x_bar + beta_i

   alpha is trainable per channel and initialised at 0 (Sec. 4.2), so a fresh layer equals BN exactly.
   ``n`` defaults to H*W (the number of positions of the current input, Sec. 3.6: "the norm is divided by
   a constant related to the number of the pixels"); a fixed ``n`` keeps the divisor constant across
   image sizes, which the paper does for its multi-scale ImageNet testing (Sec. 4.3). For (N, C) input
   n defaults to 1 and stage 2 is exactly Algorithm 1 (p = 1/sqrt(||x_hat||^2 + eps)). The text of
   line 9 is garbled in our copy of the paper ("s <- s/(nHW)"); we follow the prose, which makes n the
   whole divisor with default HW.

Statistics of stage 1:

* ``mode='batch'`` (the paper): batch mean/biased variance in training, running statistics (updated
  with ``momentum``, unbiased variance, as ``nn.BatchNorm``) in eval.
* ``mode='estimate'`` (OUR extension, not in the paper): stage 1 normalizes with BCN-style estimates
  mu_hat, sigma_hat^2 (init 0 and 1, Algorithm 1 of the WS/BCN paper) that the loss does not train. Each
  training forward first moves them with rate r (``normdense.layers._estimate``), then
  normalizes with them (once per training iteration, as BCN: a shared layer's calls and an activation
  checkpoint's recomputation do not move them again); eval uses them unchanged. This removes the batch
  dependence of stage 1 so the layer trains at batch size 1 on 1x1 maps (stage 2 is per sample anyway). r
  comes from ``EstimateRateHook`` (alias ``BCNRateHook``; the optimizer's current lr, as BCN) or a fixed
  ``update_rate``, in [0, 1]; a training forward with neither raises ``RuntimeError``. The estimates live in
  the ``running_mean``/``running_var`` buffers (kept float32 under ``model.half()``/``bfloat16()``); an empty
  input (a RoI head with no RoIs) still joins ``sync_stats``'s all-reduce, with a count of 0.

Conventions of the only public implementation (a Keras repository), as options; the defaults are the
paper's:

* ``norm_divisor='hw_squared'``: the per-sample squared norm is divided by (H*W)^2 instead of H*W (its
  ResNets pass ``image_size = H*W`` where the layer divides by ``image_size`` once more). Applies when
  ``n`` is None.
* ``var_correction='keras'``: training batches are normalized with the batch variance times
  m / (m - 1 - eps), m = N*H*W values per channel (running statistics are unchanged).

``fused=True`` (default) computes both stages as one map A x + B per (sample, channel) from the per-(n, c)
moments of x (:func:`coeff_map`), with a closed-form backward (:func:`coeff_vjp`) that keeps only x (the
StatNorm engine, ``normdense/layers/_statnorm.py``); ``fused=False`` is the reference composition below, which
the tests compare it against.
"""
import functools
import numbers
from typing import NamedTuple, Optional, Tuple

import torch
import torch.nn as nn

from ._estimate import EstimateRateMixin, in_backward
from ._statnorm import StatNorm2d
from ._utils import affine_parameters, exporting, standardization_affine

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
    # training batch variance factor: 1 (the paper) or m / (m - 1 - eps) (the Keras code)
    return count / (count - 1 - cfg.eps) if cfg.var_correction == 'keras' else 1.0


def _divisor(cfg, positions: int) -> float:
    # Algorithm 2 line 9: n, else H*W (the paper) or (H*W)^2 (the Keras code)
    if cfg.n is not None:
        return cfg.n
    return float(positions) ** (2 if cfg.norm_divisor == 'hw_squared' else 1)


def coeff_map(cfg, m, v, mean, var, params, positions, count):
    """Both stages as per-(n, c) (A, B) of y = A (x - m) + B, from the per-(n, c) moments m, v of x and
    stage 1's statistics (mean, var; the batch moments when ``count`` is given): with
    rs = 1 / sqrt(var + eps), sum_{c, l} x_hat^2 = sum_c L (v + (m - mean)^2) rs^2 (Algorithm 2 lines
    9-10), p = 1 / sqrt(s + eps) (Eq. 16), A = gamma (p alpha + 1 - alpha) rs, B = A (m - mean) + beta
    (the output's mean per (n, c)). Pure."""
    alpha, w, b = (None if p is None else p.to(m.dtype) for p in params)
    if count is not None:
        var = var * _var_factor(cfg, count)
    rs = torch.rsqrt(var + cfg.eps)
    mc = m - mean
    e = torch.addcmul(v, mc, mc)  # mean over positions of (x - mean)^2, per (n, c)
    rs2 = rs * rs
    k = positions / _divisor(cfg, positions)
    p = torch.rsqrt((e * rs2).sum(1, keepdim=True) * k + cfg.eps)  # (N, 1)
    sc0 = torch.addcmul(1.0 - alpha, p, alpha)
    scale = sc0 * w if cfg.affine else sc0
    a = scale * rs
    b_ = torch.addcmul(b, a, mc) if cfg.affine else a * mc
    return (a, b_), (rs, rs2, mc, e, p, alpha, sc0, w, scale, a, k, count)

def coeff_vjp(cfg, res, grads, wants_stats):
    """Closed-form VJP of :func:`coeff_map`: (dm, dv, dmean, dvar, (d alpha, d weight, d bias))."""
    rs, rs2, mc, e, p, alpha, sc0, w, scale, a, k, count = res
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
    ds = (g_sc0 * alpha).sum(1, keepdim=True) * p.pow(3) * (-0.5 * k)  # d loss / d (sum_c e rs^2), (N, 1)
    de = ds * rs2
    dm = torch.addcmul(gb * a, de, mc, value=2.0)
    dmean = dvar = None
    if wants_stats:
        dmean = -dm.sum(0)
        g_rs = torch.addcmul((ga_t * scale).sum(0), (ds * e).sum(0), rs, value=2.0)
        dvar = g_rs * rs.pow(3) * (-0.5 * _var_factor(cfg, count))
    return dm, de, dmean, dvar, (dalpha, dw, db)


class Unitization2d(StatNorm2d, EstimateRateMixin, nn.Module):
    """Unitization layer (Algorithm 2); see the module docstring.

    Args:
        num_features: channels C (positional, as mmcv's ``build_norm_layer`` passes it).
        eps: epsilon of both the standardization (Algorithm 1 line 4) and p (line 5 / Eq. 16).
        momentum: running-statistics momentum of ``'batch'`` mode (``None``: cumulative average).
        affine: learn gamma and beta (line 14). alpha is always learned.
        n: divisor of the per-sample squared norm (Algorithm 2 line 9). ``None`` (default) uses the
            number of spatial positions of the current input (H*W); a positive number fixes it.
        mode: ``'batch'`` (the paper) or ``'estimate'`` (BCN-style running estimates; our extension).
        update_rate: fixed r in [0, 1] for ``'estimate'`` mode; ``None`` takes it from ``EstimateRateHook``.
        sync_stats: all-reduce the estimate update across processes (estimate mode only), as BCN does.
        norm_divisor: ``'hw'`` (the paper) or ``'hw_squared'`` (the Keras code) when ``n`` is None.
        var_correction: ``'none'`` (the paper) or ``'keras'`` (training batch variance times
            m / (m - 1 - eps)).
        fused: one fused pass with an analytic backward keeping only the input (default); ``False`` runs
            the reference composition.
        backend: the fused path's kernels: ``'aten'``, ``'triton'`` (CUDA; CPU tensors only under
            ``TRITON_INTERPRET=1``), ``'auto'`` (Triton for CUDA tensors when it imports, else ATen) or None
            (default: the environment variable ``NORMDENSE_BACKEND``, else auto). docs/gpu.md.
    """
    _abbr_ = 'un'

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1,
                 affine: bool = True, n: Optional[float] = None, mode: str = 'batch',
                 update_rate: Optional[float] = None, sync_stats: bool = True, norm_divisor: str = 'hw',
                 var_correction: str = 'none', fused: bool = True, backend: Optional[str] = None):
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
        self.alpha = nn.Parameter(torch.zeros(num_features))
        affine_parameters(self, num_features, affine)
        self._init_statnorm(num_features, mode, sync_stats, fused, backend, momentum)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.alpha)
        if self.affine:
            nn.init.ones_(self.weight)
            nn.init.zeros_(self.bias)
        self._reset_statnorm_buffers()

    def _stage1_stats(self, x: torch.Tensor):
        """Mean and variance that standardize x (Algorithm 2 line 5), updating buffers in training."""
        dims = [d for d in range(x.dim()) if d != 1]
        if self.mode == 'estimate':
            # Constants for autograd: the estimates are not trained by the loss (WS/BCN Algorithm 1).
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
        if not in_backward():  # a checkpoint's recomputation tracks nothing: the forward did
            self._track(mean.detach(), var.detach(), count)
        return mean, var * _var_factor(self._config(), count)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 2 or x.shape[1] != self.num_features:
            raise ValueError(f'Unitization2d({self.num_features}) expects (N, {self.num_features}, ...) input, '
                             f'got shape {tuple(x.shape)}')
        if exporting():
            return self._export_form(x)
        return self._forward(x)

    def _eval_form(self, x: torch.Tensor) -> torch.Tensor:
        """The eval output in standard ops (ONNX export): both stages with the running statistics or estimates."""
        xf = self.compute_input(x)
        return self._unitize(xf, self.running_mean.to(xf.dtype), self.running_var.to(xf.dtype), self.alpha,
                             self.weight, self.bias).to(x.dtype)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == 0:
            # mmdet's RoI heads can see zero RoIs: no statistics to take (they would be NaN and poison
            # the running buffers); keep the parameters in the graph for DDP. Estimate mode still joins
            # the other ranks' all-reduce of the update (with a count of 0), so the collectives line up.
            if self.mode == 'estimate' and self.training:
                self._stage1_stats(self.compute_input(x))
            return self._watch(x * 0 + sum(p.sum() for p in self.parameters()) * 0)
        if self.fused and (self.mode == 'estimate' or not self.training or x.numel() // x.shape[1] > 1):
            return self._statnorm_forward(x)
        xf = self.compute_input(x)
        mean, var = self._stage1_stats(xf)
        return self._watch(self._unitize(xf, mean, var, self.alpha, self.weight, self.bias).to(x.dtype))

    def _statnorm_params(self):
        return self.alpha, self.weight, self.bias

    def _config(self) -> 'UnitizationConfig':
        return UnitizationConfig(self.eps, self.affine, self.n, self.norm_divisor, self.var_correction)

    def _coeff_maps(self, triton: bool):
        cfg = self._config()
        if triton:
            from ..kernels import unitization as kernels  # triton imported only when the Triton backend runs
            return (functools.partial(kernels.coeff_map, **cfg._asdict()),
                    functools.partial(kernels.coeff_vjp, affine=cfg.affine))
        return functools.partial(coeff_map, cfg), functools.partial(coeff_vjp, cfg)

    def _unitize(self, x: torch.Tensor, mean: torch.Tensor, var: torch.Tensor, alpha: torch.Tensor, weight,
                 bias) -> torch.Tensor:
        """Stage 1 with the given statistics, then stage 2 and the affine (x in its compute dtype;
        ``weight``/``bias`` None without affine)."""
        bshape = (1, -1) + (1,) * (x.dim() - 2)
        x_hat = (x - mean.view(bshape)) * torch.rsqrt(var.view(bshape) + self.eps)
        n = _divisor(self._config(), x[0, 0].numel())
        s = x_hat.pow(2).flatten(1).sum(1) / n                                  # (N,)
        p = torch.rsqrt(s + self.eps)
        alpha = alpha.to(x.dtype)
        scale = p[:, None] * alpha[None, :] + (1.0 - alpha)[None, :]          # (N, C)
        if self.affine:
            # gamma * (scale * x_hat) + beta with the per-sample, per-channel factors fused.
            scale = scale * weight.to(x.dtype)[None, :]
            return x_hat * scale.view(scale.shape + (1,) * (x.dim() - 2)) + bias.to(x.dtype).view(bshape)
        return x_hat * scale.view(scale.shape + (1,) * (x.dim() - 2))

    def eval_affine(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(scale, shift) per channel, float64, of the eval-mode stage 1 ``(x - mu) / sqrt(var + eps)``;
        stage 2 (the per-sample unitization) depends on the data and stays."""
        return standardization_affine(self.running_mean, self.running_var, self.eps)

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
