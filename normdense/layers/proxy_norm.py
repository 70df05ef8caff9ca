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
and its affine) and per-channel K, L (the proxy moments), from the per-(n, c) moments of x, with an
analytic backward that keeps only x (``normdense/layers/_fused.py``). ``fused=False`` is the reference
composition below (``F.group_norm``, phi, proxy normalization) that the tests compare it against.

``recompute=True`` is deprecated (the fused path keeps only the input); with ``fused=False`` it keeps only
the layer's input for backward (plain autograd keeps the input and two activation-sized intermediates, 3x
nn.GroupNorm's activation memory, plus three (C, n) tensors of the proxy statistics) and recomputes GN,
phi, the proxy statistics and the normalization in backward; see ``normdense/layers/_recompute.py``. The layer draws no random numbers (the proxy samples are
deterministic quantiles), so the recomputation is exact without saving any RNG state.

No mmcv/mmengine imports here: registration happens in ``normdense/registry.py``.
"""
import functools
import math
from typing import Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._activations import PROXY_NORM_ACTIVATIONS, activation_fn
from ._activations import resolve_activation as _resolve_activation
from ._checks import check_group_values
from ._fused import compute_dtype, group_moments, stat_norm, warn_recompute_deprecated
from ._recompute import checkpoint_once, recompute_active

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


def _stat_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 if anything is float64, else float32: proxy statistics never run in fp16/bf16."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


class GroupProxyNorm(nn.GroupNorm):
    """GN (no affine) + proxy-normalized activation step, Eq. 7 of the PN paper ("GN+PN").

    Built by mmcv's ``build_norm_layer(dict(type='GNPN', num_groups=32), C)``, which calls
    ``GroupProxyNorm(C, **cfg)`` and always passes ``eps`` (1e-5 unless set).

    Args:
        num_channels: number of channels C (first positional argument, as ``build_norm_layer``
            passes it).
        num_groups: groups of the GN stage; must divide ``num_channels``. ``num_groups=1`` gives
            LN+PN (statistics over all channels and positions of a sample).
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
        compiled: the fused path's passes as torch.compile'd kernels (opt-in; the first call compiles,
            see ``normdense/layers/_compiled.py``).
        recompute: deprecated (the fused path keeps only the input). With ``fused=False``: in
            training, save only the input for backward (one nn.GroupNorm's activation
            memory instead of three; the proxy statistics' (C, n) tensors are not kept either) and
            recompute the whole layer in backward, at the cost of a second forward. Default ``False``
            (plain autograd). No effect in eval mode or without grad.

    Parameters: ``weight``/``bias`` are gamma/beta of the activation step (GroupNorm's own names so
    GN checkpoints load), ``proxy_beta``/``proxy_gamma`` are beta~/gamma~. The proxy statistics are
    computed in float32 (float64 for float64 parameters/inputs), also under autocast.
    """
    # build_norm_layer names the attribute abbr + postfix ('gn1', 'gn2', ...): the same names as
    # mmdet/mmseg GN models, so GN checkpoints map by key (proxy params then start at 0).
    _abbr_ = 'gn'

    def __init__(self,
                 num_channels: int,
                 num_groups: int = 32,
                 eps: float = 1e-5,
                 act: Union[str, dict] = 'relu',
                 proxy_eps: float = 0.03,
                 num_samples: int = 200,
                 proxy_scaling: bool = True,
                 proxy_affine: bool = True,
                 recompute: bool = False,
                 fused: bool = True,
                 compiled: bool = False):
        if (isinstance(num_channels, bool) or not isinstance(num_channels, int)
                or num_channels <= 0):
            raise ValueError(f'GNPN: num_channels must be a positive int, got {num_channels!r}')
        if (isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups <= 0
                or num_channels % num_groups != 0):
            raise ValueError(
                f'GNPN: num_groups={num_groups!r} must be a positive int dividing '
                f'num_channels={num_channels} (use num_groups=1 for LN+PN)')
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
        self.act_kwargs = act_kwargs
        self.proxy_eps = float(proxy_eps)
        self.num_samples = num_samples
        self.proxy_scaling = bool(proxy_scaling)
        self.proxy_affine = bool(proxy_affine)
        self.recompute = bool(recompute)
        self.fused = bool(fused)
        self.compiled = bool(compiled)
        if self.recompute and self.fused:
            warn_recompute_deprecated('GroupProxyNorm')
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
        check_group_values(x, self.num_channels, self.num_groups, 'GNPN')
        dtype = _stat_dtype(x, self.weight)
        params = (self.weight, self.bias, self.proxy_beta, self.proxy_gamma)
        if self.fused and x.numel() > 0:
            with torch.autocast(device_type=x.device.type, enabled=False):
                xs = x if compute_dtype(x) == dtype else x.to(dtype)
                return stat_norm(xs, functools.partial(self._coeffs, dtype=dtype), params,
                                 act=activation_fn(self.act, self.act_kwargs), out_dtype=x.dtype,
                                 recompute_coeffs=True, compiled=self.compiled)  # not the (C, n) proxy graph
        if recompute_active(self, x):
            # Everything, the (C, n) proxy statistics included, is recomputed in backward: only x is
            # kept. The parameters are passed in, so the recomputation uses the forward's tensors.
            return checkpoint_once(lambda first, inp, *ps: self._eq7(inp, dtype, *ps), x, *params)
        return self._eq7(x, dtype, *params)

    def _coeffs(self, m, v, weight, bias, proxy_beta, proxy_gamma, dtype):
        """Eq. 7 as y = K phi(A (x - m) + B) + L: A = gamma / sigma_g and B = beta + A (m - mu_g) of the GN
        stage per (n, c), K, L = 1 / s and -mean / s of the proxy moments per channel (expanded to (N, C))."""
        gmean, gvar = group_moments(m, v, self.num_groups)
        per_group = self.num_channels // self.num_groups
        r = torch.rsqrt(gvar + self.eps).repeat_interleave(per_group, 1)
        a = weight.to(dtype) * r
        b = bias.to(dtype) + a * (m - gmean.repeat_interleave(per_group, 1))  # pre-activation mean per (n, c)
        mean, var = self._proxy_moments(weight, bias, proxy_beta, proxy_gamma, dtype)
        k = torch.rsqrt(var + self.proxy_eps) if self.proxy_scaling else torch.ones_like(var)
        return a, b, k.expand_as(a), (-mean * k).expand_as(a)

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
                f'proxy_scaling={self.proxy_scaling}, proxy_affine={self.proxy_affine}'
                + ('' if self.fused else ', fused=False') + (', compiled=True' if self.compiled else '')
                + (', recompute=True' if self.recompute else ''))
