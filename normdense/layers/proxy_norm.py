"""Group normalization followed by a proxy-normalized activation step (GN+PN, LN+PN).

Paper: Labatie et al., "Proxy-Normalizing Activations to Match Batch Normalization while Removing
Batch Dependence" (``papers/proxy_normalization.txt``), Sec. 5 Eq. 7, App. A.1 and App. B.

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
:func:`find_activations_after_proxy_norm` / :class:`ActivationAfterProxyNormGuard` detect
violations (wired into ``ProxyNormCheckHook``).

``recompute=True`` (off by default) keeps only the layer's input for backward (plain autograd keeps the
input and two activation-sized intermediates, 3x nn.GroupNorm's activation memory, plus three (C, n)
tensors of the proxy statistics) and recomputes GN, phi, the proxy statistics and the normalization in
backward; see ``normdense/layers/_recompute.py``. The layer draws no random numbers (the proxy samples are
deterministic quantiles), so the recomputation is exact without saving any RNG state.

No mmcv/mmengine imports here: registration happens in ``normdense/registry.py``.
"""
import functools
import math
import weakref
from typing import Dict, List, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._recompute import checkpoint_once, recompute_active

__all__ = [
    'GroupProxyNorm', 'proxy_quantiles', 'proxy_norm_paramwise_cfg',
    'find_activations_after_proxy_norm', 'check_proxy_norm_placement',
    'ActivationAfterProxyNormGuard', 'PROXY_NORM_ACTIVATIONS'
]

# canonical name -> (function, default keyword arguments it accepts)
PROXY_NORM_ACTIVATIONS: Dict[str, Tuple[object, dict]] = {
    'relu': (F.relu, {}),
    'relu6': (F.relu6, {}),
    'leaky_relu': (F.leaky_relu, {'negative_slope': 0.01}),
    'elu': (F.elu, {'alpha': 1.0}),
    'celu': (F.celu, {'alpha': 1.0}),
    'selu': (F.selu, {}),
    'gelu': (F.gelu, {'approximate': 'none'}),
    'silu': (F.silu, {}),
    'mish': (F.mish, {}),
    'softplus': (F.softplus, {'beta': 1.0, 'threshold': 20.0}),
    'hardswish': (F.hardswish, {}),
    'sigmoid': (torch.sigmoid, {}),
    'tanh': (torch.tanh, {}),
}
# Names are matched case-insensitively with '_'/'-' removed, so mmcv-style 'ReLU', 'LeakyReLU',
# 'GELU', 'SiLU', 'Swish', 'HSwish' all resolve.
_ACT_ALIASES = {
    'swish': 'silu', 'hswish': 'hardswish', 'leakyrelu': 'leaky_relu',
}
# keys that mmcv act_cfg dicts carry but that make no sense for a functional activation
_IGNORED_ACT_KEYS = ('inplace', )


def _resolve_activation(act: Union[str, dict]) -> Tuple[str, dict]:
    """Turn ``'relu'`` / ``dict(type='LeakyReLU', negative_slope=0.1)`` into (name, kwargs).

    Raises ``ValueError`` at build time for unknown names or arguments, so a typo in a config fails
    when the model is built rather than on the first forward.
    """
    if isinstance(act, dict):
        act = dict(act)
        if 'type' not in act:
            raise ValueError(f'GNPN activation dict needs a "type" key, got {act}')
        name = act.pop('type')
        kwargs = {k: v for k, v in act.items() if k not in _IGNORED_ACT_KEYS}
    elif isinstance(act, str):
        name, kwargs = act, {}
    else:
        raise ValueError(f'GNPN act must be a str or a dict(type=...), got {act!r}')
    if not isinstance(name, str):
        raise ValueError(f'GNPN activation type must be a string, got {name!r}')
    key = name.lower().replace('_', '').replace('-', '')
    canonical = {k.replace('_', ''): k for k in PROXY_NORM_ACTIVATIONS}
    key = _ACT_ALIASES.get(key, canonical.get(key))
    if key is None:
        raise ValueError(f'GNPN: unknown activation {name!r}; choose one of '
                         f'{sorted(PROXY_NORM_ACTIVATIONS)} (aliases: {sorted(_ACT_ALIASES)})')
    allowed = PROXY_NORM_ACTIVATIONS[key][1]
    unknown = set(kwargs) - set(allowed)
    if unknown:
        raise ValueError(f'GNPN: activation {key!r} does not accept {sorted(unknown)}; '
                         f'accepted arguments: {sorted(allowed) or "none"}')
    return key, {**allowed, **kwargs}


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
        recompute: in training, save only the input for backward (one nn.GroupNorm's activation
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
                 recompute: bool = False):
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
        dtype = _stat_dtype(x, self.weight)
        params = (self.weight, self.bias, self.proxy_beta, self.proxy_gamma)
        if recompute_active(self, x):
            # Everything, the (C, n) proxy statistics included, is recomputed in backward: only x is
            # kept. The parameters are passed in, so the recomputation uses the forward's tensors.
            return checkpoint_once(lambda first, inp, *ps: self._eq7(inp, dtype, *ps), x, *params)
        return self._eq7(x, dtype, *params)

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
                + (', recompute=True' if self.recompute else ''))


def proxy_norm_paramwise_cfg(norm_decay_mult: float = 0.0,
                             proxy_decay_mult: float = 1.0) -> dict:
    """mmengine ``paramwise_cfg`` giving PN's weight-decay treatment.

    With the defaults, weight decay among the norm parameters applies only to PN's beta~/gamma~
    (``proxy_beta``/``proxy_gamma``): mmengine's ``norm_decay_mult`` covers every ``GroupNorm``
    subclass (so GNPN's gamma/beta and the plain GN/BN layers get ``norm_decay_mult``), and
    ``custom_keys`` take precedence over it for the proxy parameters. Convolution/linear weights
    keep the base decay. This is the paper's EfficientNet recipe (App. A.1: decay "on the
    convolutional weights and the additional parameters beta~, gamma~ of PN, but not on the other
    channel-wise parameters"). The paper's ResNet recipe decays *all* parameters including
    gamma/beta: that is mmengine's default (no paramwise_cfg) or ``norm_decay_mult=1.0`` here.

    Use as ``optim_wrapper = dict(..., paramwise_cfg=proxy_norm_paramwise_cfg())`` or inherit
    ``configs/_base_/proxy_norm.py`` which holds the same dict.
    """
    return dict(
        norm_decay_mult=norm_decay_mult,
        custom_keys={
            '.proxy_beta': dict(decay_mult=proxy_decay_mult),
            '.proxy_gamma': dict(decay_mult=proxy_decay_mult),
        })


# --------------------------------------------------------------------------------------------
# Detecting "activation right after PN" (PN already contains phi; a second activation would
# silently change the model).
# --------------------------------------------------------------------------------------------

# mmcv's own activation bricks (mmcv.cnn.bricks) that do not live in torch.nn.modules.activation
_EXTRA_ACTIVATION_NAMES = {'Swish', 'HSwish', 'HSigmoid', 'Clamp', 'Clip', 'GELU', 'SiLU'}


def _is_activation(module: nn.Module) -> bool:
    if isinstance(module, nn.MultiheadAttention):  # lives in torch.nn.modules.activation too
        return False
    return any(c.__module__ == 'torch.nn.modules.activation' or c.__name__ in
               _EXTRA_ACTIVATION_NAMES for c in type(module).__mro__[:-1])


def _describe(module: nn.Module) -> str:
    return type(module).__name__


def find_activations_after_proxy_norm(model: nn.Module) -> List[str]:
    """Static check: structures that apply an activation module directly to a PN output.

    Recognised structures: mmcv ``ConvModule`` (duck-typed: ``order``, ``with_activation``,
    ``norm_name``) whose norm is a :class:`GroupProxyNorm` and whose ``'act'`` comes right after
    ``'norm'`` in ``order``; and ``nn.Sequential`` containers with a PN child directly followed by
    an activation child. Activations applied inside a module's ``forward`` code (e.g. the ReLU of
    mmdet's ``ResNet`` blocks) are invisible here: :class:`ActivationAfterProxyNormGuard` catches
    those at run time. Returns one message per offending place (empty list: nothing found).
    """
    problems = []
    for name, m in model.named_modules():
        where = name or '<model>'
        order = getattr(m, 'order', None)
        norm_name = getattr(m, 'norm_name', None)
        if (isinstance(order, (tuple, list)) and isinstance(norm_name, str)
                and getattr(m, 'with_norm', False) and getattr(m, 'with_activation', False)
                and 'norm' in order and 'act' in order):
            norm = getattr(m, norm_name, None)
            if (isinstance(norm, GroupProxyNorm)
                    and list(order).index('act') == list(order).index('norm') + 1):
                act = getattr(m, 'activate', None)
                problems.append(
                    f'{where} ({_describe(m)}): {_describe(act)} applied after its '
                    f'{_describe(norm)} norm. PN already contains the activation: set '
                    f"act_cfg=None for this module (or use a plain norm such as dict(type='GN') "
                    f'if the module does not accept act_cfg)')
        if isinstance(m, nn.Sequential):
            children = list(m.named_children())
            for (n1, c1), (n2, c2) in zip(children, children[1:]):
                if isinstance(c1, GroupProxyNorm) and _is_activation(c2):
                    prefix = f'{name}.' if name else ''
                    problems.append(
                        f'{prefix}{n2} ({_describe(c2)}) directly follows the PN layer '
                        f'{prefix}{n1}: PN already contains the activation, remove it '
                        f'(e.g. nn.Identity())')
    return problems


def check_proxy_norm_placement(model: nn.Module) -> None:
    """Raise ``ValueError`` listing every place found by :func:`find_activations_after_proxy_norm`."""
    problems = find_activations_after_proxy_norm(model)
    if problems:
        raise ValueError('Activation applied on top of a proxy-normalized activation step '
                         '(GNPN):\n  ' + '\n  '.join(problems))


class ActivationAfterProxyNormGuard:
    """Run-time check for one forward pass: an activation *module* receiving a PN output.

    Catches what the static check cannot see, e.g. ``ResNet`` blocks that call ``self.relu`` on
    ``self.norm1(x)`` inside ``forward``. Uses module-local hooks (PN forward hooks record their
    output tensors; activation pre-hooks test whether their input *is* one of them), removed on
    exit; on a clean exit with violations it raises ``ValueError``. Functional activations
    (``F.relu(x)``) are not modules and cannot be seen::

        with ActivationAfterProxyNormGuard(model):
            model(inputs)
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.problems: List[str] = []
        self._handles = []
        self._outputs: Dict[int, Tuple[str, weakref.ref]] = {}

    def _record(self, name):
        def hook(module, args, output):
            if isinstance(output, torch.Tensor):
                self._outputs[id(output)] = (name, weakref.ref(output))
        return hook

    def _check(self, name):
        def pre_hook(module, args):
            for arg in args:
                if not isinstance(arg, torch.Tensor):
                    continue
                hit = self._outputs.get(id(arg))
                if hit is not None and hit[1]() is arg:
                    msg = (f'{name} ({_describe(module)}) is applied to the output of the PN layer '
                           f'{hit[0]}: PN already contains the activation (use act_cfg=None in '
                           f'ConvModules, PNResNet instead of ResNet)')
                    if msg not in self.problems:
                        self.problems.append(msg)
        return pre_hook

    def __enter__(self):
        for name, m in self.model.named_modules():
            if isinstance(m, GroupProxyNorm):
                self._handles.append(m.register_forward_hook(self._record(name)))
            elif _is_activation(m):
                self._handles.append(m.register_forward_pre_hook(self._check(name)))
        return self

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._outputs = {}

    def __exit__(self, exc_type, exc, tb):
        self.remove()
        if exc_type is None and self.problems:
            raise ValueError('Activation applied on top of a proxy-normalized activation step '
                             '(GNPN):\n  ' + '\n  '.join(self.problems))
        return False
