"""Group normalization followed by a proxy-normalized activation step (GN+PN, LN+PN).

Paper: Labatie et al., "Proxy-Normalizing Activations to Match Batch Normalization while Removing
Batch Dependence", arXiv:2106.03743 (NeurIPS 2021), Sec. 5 Eq. 7, App. A.1 and App. B.

A batch-independent norm (LN or GN with few groups) without affine is followed by the
*proxy-normalized activation step* of Eq. 7, which replaces the usual ``affine -> activation``::

    z        = GN(x)                                   (no affine of its own)
    y        = (phi(gamma * z + beta) - E[phi(gamma * Y + beta)])
               / sqrt(Var[phi(gamma * Y + beta)] + eps_pn)
    Y_c      ~ N(beta~_c, (1 + gamma~_c)^2)            (per-channel Gaussian proxy)

The proxy expectation/variance are taken over ``n`` deterministic standard-normal quantiles
``sqrt(2) * erfinv(2 * (i + 0.5) / n - 1)`` (App. B; n = 200 in the official code) mapped through
``beta~ + (1 + gamma~) * q``. They depend only on parameters, never on the batch, so the layer is
batch-independent and behaves identically in train and eval mode.

Because the layer *contains* the activation, nothing may apply another activation to its output:
use ``act_cfg=None`` in ConvModules and the ``PNResNet`` backbone instead of ``ResNet``.
``normdense/hooks/proxy_norm_check.py`` detects violations (``ProxyNormCheckHook``); the supported
activations phi are listed in ``normdense/layers/_activations.py``.

``fused=True`` (default) computes the layer as ``K phi(A x + B) + L`` with per-(sample, channel) A, B (GN
and its affine) and per-channel K, L (the proxy moments), from the per-(n, c) moments of x
(:func:`coeff_map`), with a closed-form backward (:func:`coeff_vjp`) that keeps only x (the StatNorm engine,
``normdense/layers/_statnorm.py``). ``fused=False`` is the reference composition (``F.group_norm``, phi,
proxy normalization) that the tests compare it against.

No mmcv/mmengine imports here: registration happens in ``normdense/registry.py``.
"""
import functools
import math
import statistics
from typing import NamedTuple, Optional, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._activations import PROXY_NORM_ACTIVATIONS, activation
from ._activations import resolve_activation as _resolve_activation
from ._statnorm import StatNorm2d
from ._utils import exporting
from .groups import check_group_values, group_policy, resolve_groups

__all__ = ['GroupProxyNorm', 'proxy_quantiles', 'PROXY_NORM_ACTIVATIONS']

def proxy_quantiles(num_samples: int, dtype: torch.dtype = torch.float64,
                    device=None) -> torch.Tensor:
    """Deterministic standard-normal proxy samples ``sqrt(2) * erfinv(2 * (i + 0.5) / n - 1)``.

    These are the quantiles at the probability mid-points (i + 0.5) / n ("samples uniformly sampled
    in probability", App. A.1 / App. B); computed in float64 and then cast.
    """
    i = torch.arange(num_samples, dtype=torch.float64, device=device)
    q = math.sqrt(2.0) * torch.special.erfinv(2.0 * (i + 0.5) / num_samples - 1.0)
    return q.to(dtype)


@functools.lru_cache(maxsize=64)
def _cached_quantiles(num_samples: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # created outside inference mode: an inference tensor in the cache could not be saved for
    # backward by a later training forward
    with torch.inference_mode(False):
        return proxy_quantiles(num_samples, dtype, device)


@functools.lru_cache(maxsize=16)
def _quantile_values(num_samples: int) -> Tuple[float, ...]:
    # the quantiles as Python floats (the same values to ~1e-16): a constant in an exported graph, where
    # torch's erfinv has no ONNX operator and a cached tensor could be a tracer's fake one
    nd = statistics.NormalDist()
    return tuple(nd.inv_cdf((i + 0.5) / num_samples) for i in range(num_samples))


class PNConfig(NamedTuple):
    num_groups: int
    eps: float
    act: str
    act_kwargs: dict
    proxy_eps: float
    num_samples: int
    proxy_scaling: bool
    proxy_affine: bool


def coeff_map(cfg, m, v, mean, var, params, positions, count):
    """Eq. 7 as y = K phi(A (x - m) + B) + L per (n, c), from the per-(n, c) moments m, v of x: the GN stage
    A = gamma / sigma_g, B = beta + A (m - mu_g) (the pre-activation's mean per (n, c)), and the proxy
    moments per channel, K = 1 / sqrt(Var[phi(gamma Y + beta)] + eps_pn), L = -E[phi(gamma Y + beta)] K
    over the deterministic proxy samples Y = beta~ + (1 + gamma~) q (App. B). Pure."""
    weight, bias, proxy_beta, proxy_gamma = params
    dtype = m.dtype
    w, b = weight.to(dtype), bias.to(dtype)
    n, c = m.shape
    g = cfg.num_groups
    per = c // g
    m3 = m.view(n, g, per)
    d = m3 - m3.mean(2, keepdim=True)
    r = torch.rsqrt(torch.addcmul(v.view(n, g, per), d, d).mean(2, keepdim=True) + cfg.eps)  # (N, G, 1)
    a3 = r * w.view(g, per)
    b3 = torch.addcmul(b.view(g, per), a3, d)
    q = _cached_quantiles(cfg.num_samples, dtype, m.device)
    if cfg.proxy_affine:
        y = torch.addcmul(proxy_beta.to(dtype)[:, None], 1 + proxy_gamma.to(dtype)[:, None], q)
    else:
        y = q.expand(c, -1)
    z = torch.addcmul(b[:, None], w[:, None], y)  # (C, n) pre-activations of the proxy
    act = activation(cfg.act, cfg.act_kwargs)
    out = act.forward(z)
    pvar, pmean = torch.var_mean(out, dim=1, correction=0)  # expectation over the proxy: 1/n
    k = torch.rsqrt(pvar + cfg.proxy_eps) if cfg.proxy_scaling else None
    l_ = -pmean * k if cfg.proxy_scaling else -pmean
    kk = k.expand(n, c) if cfg.proxy_scaling else m.new_ones(1).expand_as(m)
    coeffs = a3.view(n, c), b3.view(n, c), kk, l_.expand(n, c)
    return coeffs, (d, r, w, a3, y, z, out, pmean, k, q, act)

def coeff_vjp(cfg, res, grads, wants_stats):
    """Closed-form VJP of :func:`coeff_map`: (dm, dv, None, None, (d weight, d bias, d proxy_beta,
    d proxy_gamma)); phi' through phi's own ATen backward op (``_activations.Activation``)."""
    d, r, w, a3, y, z, out, pmean, k, q, act = res
    ga, gb, gk, gl = grads
    n, c = ga.shape
    g = cfg.num_groups
    per = c // g
    ga3, gb3 = ga.view(n, g, per), gb.view(n, g, per)
    ga_t = torch.addcmul(ga3, gb3, d)  # B = beta + A d
    dw = (ga_t * r).sum(0).view(c)
    dvg = (ga_t * w.view(g, per)).sum(2, keepdim=True) * r.pow(3) * (-0.5 / per)  # through r, / P
    gd = torch.addcmul(gb3 * a3, d, dvg, value=2.0)
    dm = (gd - gd.mean(2, keepdim=True)).view(n, c)
    dv = dvg.expand(n, g, per).reshape(n, c)
    db = gb.sum(0)
    # proxy moments: K, L per channel
    gkc, glc = gk.sum(0), gl.sum(0)
    samples = out.shape[1]
    if cfg.proxy_scaling:
        dmean = -glc * k
        dvar = torch.addcmul(gkc, glc, pmean, value=-1.0) * k.pow(3) * (-0.5)
        dout = torch.addcmul((dmean / samples)[:, None], out - pmean[:, None], (dvar * (2.0 / samples))[:, None])
    else:
        dout = (-glc / samples)[:, None].expand_as(out)
    dz = act.backward(dout, z, out)
    dw = dw + (dz * y).sum(1)
    db = db + dz.sum(1)
    dpb = dpg = None
    if cfg.proxy_affine:
        dyq = dz * w[:, None]
        dpb, dpg = dyq.sum(1), (dyq * q).sum(1)
    return dm, dv, None, None, (dw, db, dpb, dpg)


def _triton_kwargs(cfg):
    kw = cfg._asdict()
    kw.pop('num_samples')
    return kw


def _triton_coeff_map(cfg, m, v, mean, var, params, positions, count, first=None):
    """:func:`coeff_map` as one Triton launch (``normdense/kernels/proxy_norm.py``), on the same cached quantiles;
    ``first``: the engine's planned moments merge, run in the same launch."""
    from ..kernels import proxy_norm as kernels  # triton imported only when this backend is used
    q = _cached_quantiles(cfg.num_samples, m.dtype, m.device)
    return kernels.coeff_map(m, v, mean, var, params, positions, count, quantiles=q, first=first,
                             **_triton_kwargs(cfg))


def _triton_coeff_vjp(cfg, res, grads, wants_stats, defer=False):
    """:func:`coeff_vjp` as one Triton launch, for the residuals of :func:`_triton_coeff_map` (``defer``: the
    sums over many samples left as partials for the engine's dx, ``kernels.second_stage``)."""
    from ..kernels import proxy_norm as kernels
    return kernels.coeff_vjp(res, grads, wants_stats, defer=defer, **_triton_kwargs(cfg))


class GroupProxyNorm(StatNorm2d, nn.GroupNorm):
    """GN (no affine) + proxy-normalized activation step, Eq. 7 of the PN paper ("GN+PN").

    Built by mmcv's ``build_norm_layer(dict(type='GNPN', num_groups=32), C)``, which calls
    ``GroupProxyNorm(C, **cfg)`` and always passes ``eps`` (1e-5 unless set).

    Args:
        num_channels: number of channels C (first positional argument, as ``build_norm_layer``
            passes it).
        num_groups: groups of the GN stage: an int (exact; must divide ``num_channels``; default (None) 32) or
            ``'auto'`` (fits each layer's channel count; layers/groups.py; the norm switch's choice).
            ``num_groups=1`` gives LN+PN (statistics over all channels and positions of a sample).
        channels_per_group: instead of ``num_groups``, about this many channels per group.
        eps: numerical constant of the **GN stage** (inside its sqrt). It keeps the name ``eps``
            because ``build_norm_layer`` always injects ``eps=1e-5``.
        act: activation phi of the PN step, a name (``'relu'``, ``'gelu'``, ``'silu'``/``'swish'``,
            ``'leaky_relu'``, ``'elu'``, ``'mish'``, ``'softplus'``, ``'hardswish'``, ...) or an
            mmcv-style dict such as ``dict(type='LeakyReLU', negative_slope=0.1)`` (``inplace`` is
            ignored). Unknown names raise ``ValueError`` at build time.
        proxy_eps: numerical constant of the **PN step**, added to the proxy variance
            (Eq. 7). 0.03 as in the paper/official code ("smaller can lead to suboptimal
            performance", App. A.1).
        num_samples: number of deterministic proxy quantiles (200 in the official code).
        proxy_scaling: if False only the proxy *centering* is applied (the paper disables PN's
            scaling just before the final mean pooling, App. A.1).
        proxy_affine: learn the proxy parameters beta~, gamma~ (init 0). False = "omitted" variant
            of App. A.3.3 (Y ~ N(0, 1)).
        fused: one fused pass with an analytic backward keeping only the input (default); ``False`` runs
            the reference composition.
        backend: the fused path's kernels: ``'aten'``, ``'triton'`` (CUDA; CPU tensors only under
            ``TRITON_INTERPRET=1``), ``'auto'`` (Triton for CUDA tensors when it imports, else ATen) or None
            (default: the environment variable ``NORMDENSE_BACKEND``, else auto). docs/gpu.md.

    Parameters: ``weight``/``bias`` are gamma/beta of the activation step (GroupNorm's own names so
    GN checkpoints load), ``proxy_beta``/``proxy_gamma`` are beta~/gamma~. The proxy statistics are
    computed in float32 (float64 for float64 parameters/inputs), also under autocast.
    """
    # build_norm_layer names the attribute abbr + postfix ('gn1', 'gn2', ...): the same names as
    # mmdet/mmseg GN models, so GN checkpoints map by key (proxy params then start at 0).
    _abbr_ = 'gn'

    def __init__(self,
                 num_channels: int,
                 num_groups: Union[int, str, None] = None,
                 eps: float = 1e-5,
                 act: Union[str, dict] = 'relu',
                 proxy_eps: float = 0.03,
                 num_samples: int = 200,
                 proxy_scaling: bool = True,
                 proxy_affine: bool = True,
                 fused: bool = True,
                 backend: Optional[str] = None,
                 channels_per_group: Optional[int] = None):
        if (isinstance(num_channels, bool) or not isinstance(num_channels, int)
                or num_channels <= 0):
            raise ValueError(f'GNPN: num_channels must be a positive int, got {num_channels!r}')
        # group policy (layers/groups.py); num_groups=1 is LN+PN
        policy = group_policy(num_groups, channels_per_group)
        num_groups = resolve_groups(num_channels, num_groups, channels_per_group, layer='GNPN')
        if not (isinstance(num_samples, int) and num_samples >= 2):
            raise ValueError(f'GNPN: num_samples must be an int >= 2, got {num_samples!r}')
        if not eps >= 0:
            raise ValueError(f'GNPN: eps (GN stage) must be >= 0, got {eps!r}')
        if not proxy_eps >= 0:
            raise ValueError(f'GNPN: proxy_eps must be >= 0, got {proxy_eps!r}')
        act_name, act_kwargs = _resolve_activation(act)
        self._proxy_ready = False  # GroupNorm.__init__ calls reset_parameters before our params
        super().__init__(num_groups, num_channels, eps=eps, affine=True)
        self.act = act_name
        self.group_policy = policy
        self.act_kwargs = act_kwargs
        self.proxy_eps = float(proxy_eps)
        self.num_samples = num_samples
        self.proxy_scaling = bool(proxy_scaling)
        self.proxy_affine = bool(proxy_affine)
        self._init_statnorm(num_channels, None, False, fused, backend)
        if self.proxy_affine:
            self.proxy_beta = nn.Parameter(torch.zeros(num_channels))
            self.proxy_gamma = nn.Parameter(torch.zeros(num_channels))
        else:
            self.register_parameter('proxy_beta', None)
            self.register_parameter('proxy_gamma', None)
        # The proxy samples are a pure function of num_samples: not a buffer (model.half() would
        # round them and state dicts would carry a key); see _cached_quantiles.
        self._proxy_ready = True
        self.reset_parameters()

    def reset_parameters(self) -> None:
        super().reset_parameters()  # gamma = 1, beta = 0
        if getattr(self, '_proxy_ready', False) and self.proxy_affine:
            nn.init.zeros_(self.proxy_beta)
            nn.init.zeros_(self.proxy_gamma)

    def activation(self, x: torch.Tensor) -> torch.Tensor:
        """phi of Eq. 7."""
        return PROXY_NORM_ACTIVATIONS[self.act][0](x, **self.act_kwargs)

    def proxy_statistics(self, dtype: torch.dtype = torch.float32
                         ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Per-channel E[phi(gamma Y + beta)] and Var[...] of the Gaussian proxy, shape (C,) each."""
        return self._proxy_moments(self.weight, self.bias, self.proxy_beta, self.proxy_gamma, dtype)

    def _proxy_moments(self, weight, bias, proxy_beta, proxy_gamma, dtype):
        if exporting():
            q = torch.tensor(_quantile_values(self.num_samples), dtype=dtype, device=weight.device)
        else:
            q = _cached_quantiles(self.num_samples, dtype, weight.device)  # (n,)
        gamma = weight.to(dtype)[:, None]
        beta = bias.to(dtype)[:, None]
        if self.proxy_affine:
            y = proxy_beta.to(dtype)[:, None] + (1 + proxy_gamma.to(dtype))[:, None] * q
        else:
            y = q.expand(self.num_channels, -1)
        a = self.activation(gamma * y + beta)  # (C, n)
        mean = a.mean(dim=1)
        var = (a - mean[:, None]).square().mean(dim=1)  # expectation over the proxy: 1/n
        return mean, var

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 2 or x.size(1) != self.num_channels:
            raise ValueError(f'GNPN expects input (N, {self.num_channels}, ...), '
                             f'got shape {tuple(x.shape)}')
        if self.num_groups == self.num_channels:  # only one channel per group can make a single-value group
            check_group_values(x, self.num_channels, self.num_groups, 'GNPN')
        if exporting():
            return self._export_form(x)
        if self.fused and x.numel() > 0:
            return self._statnorm_forward(x)
        return self._eq7(x, self.stat_dtype(x, self.weight), self.weight, self.bias, self.proxy_beta, self.proxy_gamma)

    _FIRST_STAGE = False

    def _eval_form(self, x: torch.Tensor) -> torch.Tensor:
        """The output in standard ops (ONNX export; the same in train and eval mode): the reference Eq. 7."""
        return self._eq7(x, self.stat_dtype(x, self.weight), self.weight, self.bias, self.proxy_beta,
                         self.proxy_gamma)

    def _statnorm_params(self):
        return self.weight, self.bias, self.proxy_beta, self.proxy_gamma

    def _statnorm_act(self):
        return activation(self.act, self.act_kwargs)

    def _config(self) -> 'PNConfig':
        return PNConfig(self.num_groups, self.eps, self.act, self.act_kwargs, self.proxy_eps, self.num_samples,
                        self.proxy_scaling, self.proxy_affine)

    def _coeff_maps(self, triton: bool):
        cfg = self._config()
        if triton:
            return functools.partial(_triton_coeff_map, cfg), functools.partial(_triton_coeff_vjp, cfg)
        return functools.partial(coeff_map, cfg), functools.partial(coeff_vjp, cfg)

    def _eq7(self, x: torch.Tensor, dtype: torch.dtype, weight, bias, proxy_beta, proxy_gamma) -> torch.Tensor:
        """Eq. 7 with the given parameters, computed in ``dtype`` with autocast disabled."""
        with torch.autocast(device_type=x.device.type, enabled=False):
            # GN stage and affine fused into one group_norm call: gamma * GN(x) + beta
            u = F.group_norm(x.to(dtype), self.num_groups, weight.to(dtype), bias.to(dtype), self.eps)
            a = self.activation(u)
            mean, var = self._proxy_moments(weight, bias, proxy_beta, proxy_gamma, dtype)
            shape = (1, self.num_channels) + (1, ) * (x.dim() - 2)
            if self.proxy_scaling:
                inv_std = torch.rsqrt(var + self.proxy_eps)
                out = (a - mean.view(shape)) * inv_std.view(shape)
            else:
                out = a - mean.view(shape)
        return out.to(x.dtype)

    def extra_repr(self) -> str:
        act = self.act if not self.act_kwargs else f'{self.act}({self.act_kwargs})'
        return (f'{self.num_groups}, {self.num_channels}, eps={self.eps}, act={act}, '
                f'proxy_eps={self.proxy_eps}, num_samples={self.num_samples}, '
                f'proxy_scaling={self.proxy_scaling}, proxy_affine={self.proxy_affine}' + self._statnorm_repr())
