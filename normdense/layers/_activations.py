"""The activations phi that ``GroupProxyNorm`` (GN+PN) can contain, by name, and the resolution of a name or an
mmcv-style ``act_cfg`` dict into (canonical name, keyword arguments). Functional (torch only): the layer
applies phi both to its input and to the proxy samples."""
import functools
from typing import Dict, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ['PROXY_NORM_ACTIVATIONS', 'ACTIVATION_MODULES', 'activation_module', 'resolve_activation', 'activation', 'Activation']

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
# the torch.nn module of each (same keyword arguments): phi in a fused GN+PN (normdense.deploy.fuse)
ACTIVATION_MODULES = {
    'relu': 'ReLU', 'relu6': 'ReLU6', 'leaky_relu': 'LeakyReLU', 'elu': 'ELU', 'celu': 'CELU', 'selu': 'SELU',
    'gelu': 'GELU', 'silu': 'SiLU', 'mish': 'Mish', 'softplus': 'Softplus', 'hardswish': 'Hardswish',
    'sigmoid': 'Sigmoid', 'tanh': 'Tanh',
}
assert set(ACTIVATION_MODULES) == set(PROXY_NORM_ACTIVATIONS)
# Names are matched case-insensitively with '_'/'-' removed, so mmcv-style 'ReLU', 'LeakyReLU',
# 'GELU', 'SiLU', 'Swish', 'HSwish' all resolve.
_ACT_ALIASES = {
    'swish': 'silu', 'hswish': 'hardswish', 'leakyrelu': 'leaky_relu',
}
# keys that mmcv act_cfg dicts carry but that make no sense for a functional activation
_IGNORED_ACT_KEYS = ('inplace', )


def resolve_activation(act: Union[str, dict]) -> Tuple[str, dict]:
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


class Activation:
    """phi and its closed-form derivative (the ATen backward op autograd itself uses): ``forward(z)``,
    ``backward(g, z, out)`` = g * phi'(z) with ``out`` = phi(z). One object per (name, arguments)."""

    def __init__(self, name: str, kwargs: dict):
        self.name, self.kwargs = name, dict(kwargs)
        self.forward = functools.partial(PROXY_NORM_ACTIVATIONS[name][0], **self.kwargs)
        self._backward = _BACKWARD[name]

    def backward(self, g: torch.Tensor, z: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return self._backward(g, z, out, self.kwargs)

    def __repr__(self):
        return f'Activation({self.name!r}, {self.kwargs})'


_aten = torch.ops.aten
_SELU_ALPHA, _SELU_SCALE = 1.6732632423543772848170429916717, 1.0507009873554804934193349852946
# g * phi'(z), from torch's derivatives.yaml formulas: one ATen op each
_BACKWARD = {
    'relu': lambda g, z, out, kw: _aten.threshold_backward(g, out, 0),
    'relu6': lambda g, z, out, kw: _aten.hardtanh_backward(g, z, 0.0, 6.0),
    'leaky_relu': lambda g, z, out, kw: _aten.leaky_relu_backward(g, z, kw['negative_slope'], False),
    'elu': lambda g, z, out, kw: _aten.elu_backward(g, kw['alpha'], 1, 1, False, z),
    'celu': lambda g, z, out, kw: _aten.elu_backward(g, kw['alpha'], 1, 1.0 / kw['alpha'], False, z),
    'selu': lambda g, z, out, kw: _aten.elu_backward(g, _SELU_ALPHA, _SELU_SCALE, 1, False, z),
    'gelu': lambda g, z, out, kw: _aten.gelu_backward(g, z, approximate=kw['approximate']),
    'silu': lambda g, z, out, kw: _aten.silu_backward(g, z),
    'mish': lambda g, z, out, kw: _aten.mish_backward(g, z),
    'softplus': lambda g, z, out, kw: _aten.softplus_backward(g, z, kw['beta'], kw['threshold']),
    'hardswish': lambda g, z, out, kw: _aten.hardswish_backward(g, z),
    'sigmoid': lambda g, z, out, kw: _aten.sigmoid_backward(g, out),
    'tanh': lambda g, z, out, kw: _aten.tanh_backward(g, out),
}
assert set(_BACKWARD) == set(PROXY_NORM_ACTIVATIONS)


@functools.lru_cache(maxsize=None)
def _activation(name, items):
    return Activation(name, dict(items))


def activation(name: str, kwargs: dict) -> Activation:
    """The :class:`Activation` of a resolved (name, kwargs): the same object for equal configurations."""
    return _activation(name, tuple(sorted(kwargs.items())))


def activation_module(name: str, kwargs: dict) -> nn.Module:
    """phi of a resolved (name, kwargs) as its torch.nn module (``nn.GELU(approximate='tanh')``, ...)."""
    return getattr(nn, ACTIVATION_MODULES[name])(**kwargs)
