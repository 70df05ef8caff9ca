"""Weight Standardization (Qiao et al., "Micro-Batch Training with Batch-Channel Normalization and
Weight Standardization", Sec. 4.1, Eq. 5-7).

Per output channel i, over the I = C_in/groups x kH x kW weights feeding it::

    W_hat[i, j] = (W[i, j] - mu_i) / sigma_i                       (Eq. 5)
    y = W_hat * x                                                  (Eq. 6)
    mu_i = mean_j W[i, j],  sigma_i = sqrt(mean_j W[i, j]^2 - mu_i^2 + eps)   (Eq. 7)

No affine: the norm layer that follows provides it. Where eps goes differs between the paper and the
authors' public code, so it is an explicit choice (``formula``):

``'paper'``         sigma = sqrt(var_biased + eps)          Eq. 7 (the default)
``'std_unbiased'``  sigma = std_unbiased + eps              the authors' first release and mmcv's ConvWS
``'var_unbiased'``  sigma = sqrt(var_unbiased + eps)        the code that trained the authors' BCN models

The three are different functions of the same weights (biased vs unbiased variance, eps inside or
outside the root; the difference compounds through a network), so the formula and eps a conv was trained
with are saved *with its weights*: ``WSConv2d``'s state dict holds ``_extra_state`` = float64
``[index in WS_FORMULAS, eps]`` (a tensor, so ``.cpu()``, ``.half()``, weights-only loads and mmengine's
checkpoint tools handle it like any weight). Loading sets them, so a
reload, ``load_from``, ``--resume``, ``tools/test.py`` and ``tools/deploy.py`` compute the trained function
whatever the config says; a disagreeing config gets one warning line per load. State dicts without the
entry (saved before it existed) load strictly and keep the configured formula.
"""
import logging
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._utils import autocast_enabled

# Checkpoints store a formula as its index here: append new formulas, never reorder.
WS_FORMULAS = ('paper', 'std_unbiased', 'var_unbiased')
EXTRA_STATE_KEY = '_extra_state'  # torch's name for get_extra_state()'s entry in a state dict


def _check_formula(formula):
    if formula not in WS_FORMULAS:
        raise ValueError(f'unknown weight standardization formula {formula!r}; choose one of {WS_FORMULAS}')


def standardize_weight(weight: torch.Tensor, eps: float = 1e-5, formula: str = 'paper') -> torch.Tensor:
    """Return the standardized weight of Eq. 5/7, differentiable, computed in at least fp32.

    Half-precision weights (autocast, fp16 training) are standardized in fp32 because the variance of a
    small fan-in overflows or underflows in fp16; the caller's conv casts the result as usual.
    """
    _check_formula(formula)
    w = weight if weight.dtype in (torch.float32, torch.float64) else weight.float()
    flat = w.reshape(w.shape[0], -1)
    if formula == 'paper' and eps > 0 and flat.shape[1] > 1:
        # Eq. 7 as written is exactly layer_norm over each output channel's fan-in (biased variance, eps
        # inside the root): one fused kernel instead of var_mean + arithmetic (timings: docs/performance.md).
        with torch.autocast(device_type=w.device.type, enabled=False):
            out = F.layer_norm(flat, (flat.shape[1], ), eps=eps)
        return out.reshape(w.shape)
    var, mean = torch.var_mean(flat, dim=1, keepdim=True, correction=0 if formula == 'paper' else 1)
    if formula == 'std_unbiased':
        out = (flat - mean) / (var.sqrt() + eps)
    else:
        out = (flat - mean) * torch.rsqrt(var + eps)
    return out.reshape(w.shape)


def ws_state(formula: str, eps: float) -> torch.Tensor:
    """The ``_extra_state`` tensor recording a WS formula and eps: float64 ``[WS_FORMULAS.index, eps]``."""
    _check_formula(formula)
    return torch.tensor([float(WS_FORMULAS.index(formula)), float(eps)], dtype=torch.float64)


def decode_ws_state(state) -> tuple:
    """``(formula, eps)`` from a :func:`ws_state` tensor (any dtype or device); ``ValueError`` if malformed."""
    if not torch.is_tensor(state) or state.numel() != 2:
        raise ValueError(f'expected a 2-element tensor [formula index, eps], got {_describe(state)}')
    index, eps = state.detach().reshape(-1).double().cpu().tolist()
    if not (index == int(index) and 0 <= index < len(WS_FORMULAS)):
        raise ValueError(f'formula index {index} is not one of 0..{len(WS_FORMULAS) - 1} {WS_FORMULAS} (a '
                         'checkpoint from a newer normdense?)')
    if not (math.isfinite(eps) and eps > 0):
        raise ValueError(f'eps must be positive, got {eps}')
    return WS_FORMULAS[int(index)], eps


def _describe(obj):
    return f'a {obj.dtype} tensor of shape {tuple(obj.shape)}' if torch.is_tensor(obj) else type(obj).__name__


def _log_warning(message: str) -> None:
    """One warning line through mmengine's current logger (the layer itself needs only torch)."""
    try:
        from mmengine.logging import print_log
    except ImportError:  # pragma: no cover - normdense installs mmengine
        import warnings
        warnings.warn(message, stacklevel=3)
        return
    print_log(message, logger='current', level=logging.WARNING)


# The load call seen last (its missing-keys list, which torch and mmengine pass unchanged to every module's
# _load_from_state_dict) and the (configured, loaded) switches already reported for it. Holding the list
# keeps its id from being reused by a later call.
_reported = [None, set()]


class WSConv2d(nn.Conv2d):
    """Conv2d whose weight is standardized per output channel before every convolution (Eq. 5-7).

    A drop-in for ``nn.Conv2d`` (and for mmcv ``conv_cfg=dict(type='WSConv2d')`` in ConvModule,
    mmdet/mmseg ResNet, FPN and RoI heads). The stored ``weight`` is the raw W that SGD updates; the
    convolution uses ``standardized_weight()``.

    The formula and eps are part of the state dict (``_extra_state``, see the module docstring): loading
    weights saved with other values switches the layer to them and logs one line per load (per
    configured/loaded pair); weights saved without them keep the configured values.

    Args:
        eps: numerical guard of Eq. 7.
        formula: where eps goes, see the module docstring (default: the paper's).
    """

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, groups=1,
                 bias=True, padding_mode='zeros', eps=1e-5, formula='paper', device=None, dtype=None):
        _check_formula(formula)
        if not eps > 0:  # eps <= 0 divides by zero (or a negative) for a constant filter
            raise ValueError(f'WSConv2d eps must be positive, got {eps!r}')
        super().__init__(in_channels, out_channels, kernel_size, stride=stride, padding=padding,
                         dilation=dilation, groups=groups, bias=bias, padding_mode=padding_mode,
                         device=device, dtype=dtype)
        self.eps = eps
        self.formula = formula

    def standardized_weight(self) -> torch.Tensor:
        return standardize_weight(self.weight, self.eps, self.formula)

    def forward(self, x):
        weight = self.standardized_weight()
        if weight.dtype != x.dtype and not autocast_enabled(x.device.type):
            weight = weight.to(x.dtype)
        return self._conv_forward(x, weight, self.bias)

    def extra_repr(self):
        return super().extra_repr() + f', eps={self.eps}, formula={self.formula!r}'

    # ---- the formula travels with the weights -------------------------------------------------------
    def get_extra_state(self) -> torch.Tensor:
        return ws_state(self.formula, self.eps)

    def set_extra_state(self, state) -> None:
        where = getattr(self, '_ws_loading', None)
        name = f'{where[1]}{EXTRA_STATE_KEY}' if where else EXTRA_STATE_KEY
        try:
            formula, eps = decode_ws_state(state)
        except ValueError as e:
            raise ValueError(f'WSConv2d: cannot read the WS formula saved in {name}: {e}') from None
        if state.dtype != torch.float64 and torch.tensor(self.eps, dtype=state.dtype).item() == eps:
            eps = self.eps  # a state dict cast to a lower precision (e.g. .half()) rounds eps: same value
        configured = (self.formula, self.eps)
        self.formula, self.eps = formula, eps
        if configured == (formula, eps):
            return
        pair = (configured, (formula, eps))
        if where is not None:
            if _reported[0] is not where[0]:
                _reported[:] = [where[0], set()]
            if pair in _reported[1]:
                return
            _reported[1].add(pair)
        _log_warning(
            f'WSConv2d: the loaded weights were trained with WS formula {formula!r} (eps={eps:g}), recorded in '
            f'their state dict ({name}); the WSConv2d layers configured with {configured[0]!r} '
            f'(eps={configured[1]:g}) use the trained one. Set formula={formula!r}, eps={eps:g} in conv_cfg to '
            'match the weights and silence this line.')

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # missing_keys: the same list for every module of one load call, so set_extra_state reports each
        # switch once per load rather than once per conv
        self._ws_loading = (missing_keys, prefix)
        try:
            super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                          unexpected_keys, error_msgs)
        finally:
            del self._ws_loading
        key = prefix + EXTRA_STATE_KEY
        if key not in state_dict and key in missing_keys:
            # saved before the formula was part of the state (or by a plain conv): keep the configured one
            missing_keys.remove(key)

    @classmethod
    def convert_conv(cls, module: nn.Module, eps: float = 1e-5, formula: str = 'paper',
                     exclude=lambda name, conv: False) -> nn.Module:
        """Swap every plain ``nn.Conv2d`` in ``module`` (or ``module`` itself) for a WSConv2d with the
        same weights, in the style of detectron2's ``FrozenBatchNorm2d.convert_frozen_batchnorm``.

        The raw weights are copied, so the *effective* kernel becomes their standardized version: the
        network's function changes unless the weights were already standardized (e.g. trained with WS).
        ``exclude(name, conv)`` keeps chosen convs plain (the paper leaves RPN head and predictors plain).
        Returns the converted module (a new object only when ``module`` itself is a Conv2d).
        """
        return _convert_convs(cls, module, '', eps, formula, exclude)


def _convert_convs(cls, module, name, eps, formula, exclude):
    if type(module) is nn.Conv2d and not exclude(name, module):
        new = cls(module.in_channels, module.out_channels, module.kernel_size, stride=module.stride,
                  padding=module.padding, dilation=module.dilation, groups=module.groups,
                  bias=module.bias is not None, padding_mode=module.padding_mode, eps=eps, formula=formula,
                  device=module.weight.device, dtype=module.weight.dtype)
        with torch.no_grad():
            new.weight.copy_(module.weight)
            if module.bias is not None:
                new.bias.copy_(module.bias)
        new.train(module.training)
        return new
    for child_name, child in module.named_children():
        full = f'{name}.{child_name}' if name else child_name
        new_child = _convert_convs(cls, child, full, eps, formula, exclude)
        if new_child is not child:
            setattr(module, child_name, new_child)
    return module
