"""Group normalization followed by a proxy-normalized activation step (GN+PN; LN+PN with one group).

Paper: Labatie et al., "Proxy-Normalizing Activations to Match Batch Normalization while Removing Batch
Dependence", arXiv:2106.03743 (NeurIPS 2021), Sec. 5 Eq. 7, App. A.1 and App. B. Eq. 7 replaces
``affine -> activation`` after a GN without affine::

    z        = GN(x)
    y        = (phi(gamma * z + beta) - E[phi(gamma * Y + beta)]) / sqrt(Var[phi(gamma * Y + beta)] + eps_pn)
    Y_c      ~ N(beta~_c, (1 + gamma~_c)^2)            (per-channel Gaussian proxy)

E and Var are taken over n deterministic quantiles ``sqrt(2) * erfinv(2 * (i + 0.5) / n - 1)`` (App. B), so
the layer is batch-independent and the same in train and eval. It *contains* phi: nothing may apply another
activation to its output (``act_cfg=None``, ``PNResNet``; ``ProxyNormCheckHook`` checks). docs/proxy_norm.md.
"""
import functools
import math
import statistics
from typing import Any, NamedTuple, Optional, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._activations import PROXY_NORM_ACTIVATIONS, activation, activation_module
from ._activations import resolve_activation as _resolve_activation
from ._statnorm import StatNorm2d
from .declare import Switch, declare
from .eval_form import ChannelAffine, EvalForm, frozen_group_norm
from .groups import check_group_values, group_policy, resolve_groups

__all__ = ['GroupProxyNorm', 'proxy_quantiles', 'PROXY_NORM_ACTIVATIONS']

def proxy_quantiles(num_samples: int, dtype: torch.dtype = torch.float64,
                    device=None) -> torch.Tensor:
    """The n proxy samples: standard-normal quantiles at (i + 0.5) / n (App. B), computed in float64, then cast."""
    i = torch.arange(num_samples, dtype=torch.float64, device=device)
    q = math.sqrt(2.0) * torch.special.erfinv(2.0 * (i + 0.5) / num_samples - 1.0)
    return q.to(dtype)


@functools.lru_cache(maxsize=64)
def _cached_quantiles(num_samples: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # outside inference mode: a cached inference tensor could not be saved for a later backward
    with torch.inference_mode(False):
        return proxy_quantiles(num_samples, dtype, device)


@functools.lru_cache(maxsize=16)
def _quantile_values(num_samples: int) -> Tuple[float, ...]:
    # Python floats for export: erfinv has no ONNX operator and a cached tensor could be a tracer's fake one
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


class Residuals(NamedTuple):
    """What :func:`coeff_vjp` reads of :func:`coeff_map`'s work."""
    d: torch.Tensor  # the sample-channel means minus their group's (N, G, per)
    r: torch.Tensor  # 1 / sigma_g
    w: torch.Tensor  # gamma
    a3: torch.Tensor  # A (N, G, per)
    y: torch.Tensor  # the proxy samples (C, n)
    z: torch.Tensor  # gamma y + beta
    out: torch.Tensor  # phi(z)
    pmean: torch.Tensor  # E[phi(z)] per channel
    k: Optional[torch.Tensor]  # K (None without proxy scaling)
    q: torch.Tensor  # the quantiles
    act: Any  # phi (an Activation)


def coeff_map(cfg, m, v, mean, var, params, positions, count):
    """Eq. 7 as y = K phi(A (x - m) + B) + L from x's per-(n, c) moments m, v: A = gamma / sigma_g,
    B = beta + A (m - mu_g); per channel K = 1 / sqrt(Var[phi(gamma Y + beta)] + eps_pn), L = -E[...] K. Pure."""
    weight, bias, proxy_beta, proxy_gamma = params
    dtype = m.dtype
    w, b = (p if p.dtype == dtype else p.to(dtype) for p in (weight, bias))  # .to: 2 us even where a no-op
    n, c = m.shape
    g = cfg.num_groups
    per = c // g
    m3 = m.view(n, g, per)
    d = m3 - m3.mean(2, keepdim=True)
    r = torch.rsqrt(torch.addcmul(v.view(n, g, per), d, d).mean(2, keepdim=True) + cfg.eps)
    a3 = r * w.view(g, per)
    b3 = torch.addcmul(b.view(g, per), a3, d)
    q = _cached_quantiles(cfg.num_samples, dtype, m.device)
    if cfg.proxy_affine:
        pb, pg = (p if p.dtype == dtype else p.to(dtype) for p in (proxy_beta, proxy_gamma))
        y = torch.addcmul(pb[:, None], 1 + pg[:, None], q)
    else:
        y = q.expand(c, -1)
    z = torch.addcmul(b[:, None], w[:, None], y)  # (C, n)
    act = activation(cfg.act, cfg.act_kwargs)
    out = act.forward(z)
    pvar, pmean = torch.var_mean(out, dim=1, correction=0)  # expectation over the proxy: 1/n
    k = torch.rsqrt(pvar + cfg.proxy_eps) if cfg.proxy_scaling else None
    l_ = -pmean * k if cfg.proxy_scaling else -pmean
    kk = k.expand(n, c) if cfg.proxy_scaling else m.new_ones(1).expand_as(m)
    coeffs = a3.view(n, c), b3.view(n, c), kk, l_.expand(n, c)
    return coeffs, Residuals(d=d, r=r, w=w, a3=a3, y=y, z=z, out=out, pmean=pmean, k=k, q=q, act=act)

def coeff_vjp(cfg, res, grads, wants_stats):
    """Closed-form VJP of :func:`coeff_map`: (dm, dv, None, None, d(weight, bias, proxy_beta, proxy_gamma))."""
    d, r, w, a3, y, z, out, pmean, k, q, act = (res.d, res.r, res.w, res.a3, res.y, res.z, res.out, res.pmean, res.k,
                                               res.q, res.act)
    ga, gb, gk, gl = grads
    n, c = ga.shape
    g = cfg.num_groups
    per = c // g
    ga3, gb3 = ga.view(n, g, per), gb.view(n, g, per)
    ga_t = torch.addcmul(ga3, gb3, d)  # B = beta + A d
    dw = (ga_t * r).sum(0).view(c)
    dvg = (ga_t * w.view(g, per)).sum(2, keepdim=True) * r.pow(3) * (-0.5 / per)
    gd = torch.addcmul(gb3 * a3, d, dvg, value=2.0)
    dm = (gd - gd.mean(2, keepdim=True)).view(n, c)
    dv = dvg.expand(n, g, per).reshape(n, c)
    db = gb.sum(0)
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


def _triton_coeff_map(cfg, kernel, kwargs, m, v, mean, var, params, positions, count, first=None):
    """:func:`coeff_map` as one Triton launch (``kernel``: ``kernels.proxy_norm.coeff_map``, ``kwargs`` its
    configuration); ``first``: the engine's moments merge, run in the same launch."""
    q = _cached_quantiles(cfg.num_samples, m.dtype, m.device)
    return kernel(m, v, mean, var, params, positions, count, quantiles=q, first=first, **kwargs)


# the switch's 'gn-pn': GN in every slot, GN+PN in a PNResNet backbone (norm_switch.switch_norm)
@declare('GNPN', switches=(Switch('gn-pn', dict(type='GNAuto', requires_grad=True), groups=True,
                                  hooks=('ProxyNormCheckHook', )), ),
         state_keys=('proxy_beta', 'proxy_gamma'), state_name='gn-pn', convert='gnpn',
         cases={'gnpn-relu': dict(act='relu'), 'gnpn-gelu': dict(act='gelu'),
                'lnpn-silu': dict(num_groups=1, act='silu', proxy_affine=False)})
class GroupProxyNorm(StatNorm2d, nn.GroupNorm):
    """GN+PN (``dict(type='GNPN')``): ``weight``/``bias`` are gamma/beta (GN's names, so GN checkpoints load),
    ``proxy_beta``/``proxy_gamma`` beta~/gamma~; statistics in float32 (float64 for float64), also under autocast.

    Args:
        num_channels: channels C (positional, as mmcv's ``build_norm_layer`` passes it).
        num_groups: GN groups: an int dividing C (None: 32; 1: LN+PN) or ``'auto'`` (layers/groups.py).
        channels_per_group: instead of ``num_groups``, about this many channels per group.
        eps: of the **GN stage** (``build_norm_layer`` always passes ``eps``).
        act: phi, a name (``'relu'``, ``'gelu'``, ``'silu'``, ...: ``_activations.py``) or an mmcv-style dict such
            as ``dict(type='LeakyReLU', negative_slope=0.1)`` (``inplace`` ignored); unknown ones raise ``ValueError``.
        proxy_eps: eps_pn of the **PN step** (Eq. 7); 0.03 as in the paper (App. A.1).
        num_samples: proxy quantiles n (200 in the official code).
        proxy_scaling: False applies only the proxy centering (the paper's choice before the final pooling).
        proxy_affine: learn beta~, gamma~ (init 0); False: the "omitted" variant of App. A.3.3 (Y ~ N(0, 1)).
        fused: one pass with an analytic backward keeping only the input (default); False: the reference ops.
        backend: ``'aten'``, ``'triton'``, ``'auto'`` or None (``$NORMDENSE_BACKEND``, else auto); docs/gpu.md.
        device, dtype: of the parameters, as torch.nn's layers take them (``skip_init``, meta init).
    """
    # build_norm_layer names it 'gn1', 'gn2', ... as in GN models, so GN checkpoints map by key
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
                 channels_per_group: Optional[int] = None,
                 device=None,
                 dtype=None):
        if (isinstance(num_channels, bool) or not isinstance(num_channels, int)
                or num_channels <= 0):
            raise ValueError(f'GNPN: num_channels must be a positive int, got {num_channels!r}')
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
        super().__init__(num_groups, num_channels, eps=eps, affine=True, device=device, dtype=dtype)
        self.act = act_name
        self.group_policy = policy
        self.act_kwargs = act_kwargs
        self.proxy_eps = float(proxy_eps)
        self.num_samples = num_samples
        self.proxy_scaling = bool(proxy_scaling)
        self.proxy_affine = bool(proxy_affine)
        self._init_statnorm(num_channels, None, False, fused, backend)
        if self.proxy_affine:
            self.proxy_beta = nn.Parameter(torch.zeros(num_channels, device=device, dtype=dtype))
            self.proxy_gamma = nn.Parameter(torch.zeros(num_channels, device=device, dtype=dtype))
        else:
            self.register_parameter('proxy_beta', None)
            self.register_parameter('proxy_gamma', None)
        # proxy samples are not a buffer: model.half() would round them and state dicts would carry a key
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

    def _proxy_moments(self, weight, bias, proxy_beta, proxy_gamma, dtype, q=None):
        if q is None:
            q = _cached_quantiles(self.num_samples, dtype, weight.device)
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

    def _check_input(self, x: torch.Tensor) -> None:
        if x.dim() < 2 or x.shape[1] != self.num_channels:
            raise ValueError(f'GNPN expects input (N, {self.num_channels}, ...), '
                             f'got shape {tuple(x.shape)}')
        if self.num_groups == self.num_channels:
            check_group_values(x, self.num_channels, self.num_groups, 'GNPN')

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        # Eq. 7: batch-independent, the same in train and eval
        return self._eq7(x, self.stat_dtype(x, self.weight), self.weight, self.bias, self.proxy_beta,
                         self.proxy_gamma)

    _FIRST_STAGE = False

    def eval_form(self, dtype: torch.dtype = torch.float64) -> EvalForm:
        """Eq. 7 at inference, where the proxy statistics are constants of the parameters: ``nn.GroupNorm`` with
        gamma, beta, then phi's torch.nn module, then K phi + L per channel (a ``ChannelAffine``), K = 1 /
        sqrt(Var_proxy + eps_pn) (1 without proxy scaling), L = -E_proxy K, computed in ``dtype``. Nothing goes
        into a conv: the GN stage is per sample, and an affine after phi would move a next conv's zero padding.
        The quantiles are Python constants (erfinv has no ONNX operator)."""
        weight = self.weight
        q = torch.tensor(_quantile_values(self.num_samples), dtype=dtype, device=weight.device)
        mean, var = self._proxy_moments(weight, self.bias, self.proxy_beta, self.proxy_gamma, dtype, q)
        k = torch.rsqrt(var + self.proxy_eps) if self.proxy_scaling else torch.ones_like(var)
        gn = frozen_group_norm(self.num_groups, weight, self.bias, self.eps)
        proxy = ChannelAffine.of(k, -mean * k, weight.dtype, self.num_channels)
        rest = nn.Sequential(gn, activation_module(self.act, self.act_kwargs), proxy)
        return EvalForm(None, None, rest.train(False), weight.dtype, self.num_channels)

    def _statnorm_params(self):
        try:  # from the dict: attribute access goes through Module.__getattr__, a Python call each
            p = self._parameters
            return p['weight'], p['bias'], p['proxy_beta'], p['proxy_gamma']
        except KeyError:  # a parametrized or replaced parameter
            return self.weight, self.bias, self.proxy_beta, self.proxy_gamma

    def _statnorm_act(self):
        return activation(self.act, self.act_kwargs)

    def _config(self) -> 'PNConfig':
        return PNConfig(self.num_groups, self.eps, self.act, self.act_kwargs, self.proxy_eps, self.num_samples,
                        self.proxy_scaling, self.proxy_affine)

    def _coeff_maps(self, kernel: bool):
        cfg = self._config()
        if kernel:
            from ..kernels import proxy_norm as kernels  # triton imported only when it runs
            kw = _triton_kwargs(cfg)
            return (functools.partial(_triton_coeff_map, cfg, kernels.coeff_map, kw),
                    functools.partial(kernels.coeff_vjp, **kw))
        return functools.partial(coeff_map, cfg), functools.partial(coeff_vjp, cfg)

    def _eq7(self, x: torch.Tensor, dtype: torch.dtype, weight, bias, proxy_beta, proxy_gamma) -> torch.Tensor:
        """Eq. 7 with the given parameters, computed in ``dtype`` with autocast disabled."""
        with torch.autocast(device_type=x.device.type, enabled=False):
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
