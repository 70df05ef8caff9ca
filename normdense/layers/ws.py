"""Weight Standardization (Qiao et al., "Micro-Batch Training with Batch-Channel Normalization and Weight
Standardization", arXiv:1903.10520, Sec. 4.1, Eq. 5-7). Per output channel i, over its C_in/groups x kH x kW
weights::

    W_hat[i, j] = (W[i, j] - mu_i) / sigma_i                                  (Eq. 5)
    y = W_hat * x                                                             (Eq. 6)
    mu_i = mean_j W[i, j],  sigma_i = sqrt(mean_j W[i, j]^2 - mu_i^2 + eps)   (Eq. 7)

No affine (the next norm has one). Where eps goes differs between the paper and the authors' code (``formula``):

``'paper'``         sigma = sqrt(var_biased + eps)          Eq. 7 (the default)
``'std_unbiased'``  sigma = std_unbiased + eps              the authors' first release and mmcv's ConvWS
``'var_unbiased'``  sigma = sqrt(var_unbiased + eps)        the code that trained the authors' BCN models

The formula and eps travel with the weights (``_extra_state``; docs/ws_bcn.md).
"""
import logging
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._utils import autocast_enabled, memory_format_of
from .declare import declare
from .eval_form import EvalForm, plain_conv

# Checkpoints store a formula as its index here: append new formulas, never reorder.
WS_FORMULAS = ('paper', 'std_unbiased', 'var_unbiased')
EXTRA_STATE_KEY = '_extra_state'


def _check_formula(formula):
    if formula not in WS_FORMULAS:
        raise ValueError(f'unknown weight standardization formula {formula!r}; choose one of {WS_FORMULAS}')


def standardize_weight(weight: torch.Tensor, eps: float = 1e-5, formula: str = 'paper') -> torch.Tensor:
    """The standardized weight of Eq. 5/7, differentiable, in at least fp32 (a small fan-in's variance under- or
    overflows in fp16), in ``weight``'s memory format (a channels_last module convolves as nn.Conv2d does)."""
    _check_formula(formula)
    layout = memory_format_of(weight)
    w = weight if weight.dtype in (torch.float32, torch.float64) else weight.float()
    flat = w.reshape(w.shape[0], -1)
    if formula == 'paper' and eps > 0 and flat.shape[1] > 1:
        # Eq. 7 is exactly layer_norm over each fan-in: one fused kernel (docs/performance.md)
        with torch.autocast(device_type=w.device.type, enabled=False):
            out = F.layer_norm(flat, (flat.shape[1], ), eps=eps)
        return out.reshape(w.shape).contiguous(memory_format=layout)
    var, mean = torch.var_mean(flat, dim=1, keepdim=True, correction=0 if formula == 'paper' else 1)
    if formula == 'std_unbiased':
        out = (flat - mean) / (var.sqrt() + eps)
    else:
        out = (flat - mean) * torch.rsqrt(var + eps)
    return out.reshape(w.shape).contiguous(memory_format=layout)


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
    """One warning line through mmengine's current logger."""
    try:
        from mmengine.logging import print_log
    except ImportError:  # pragma: no cover - normdense installs mmengine
        import warnings
        warnings.warn(message, stacklevel=3)
        return
    print_log(message, logger='current', level=logging.WARNING)


# The last load call (its missing-keys list, shared by every module's _load_from_state_dict; holding it keeps its
# id from being reused) and the (configured, loaded) switches already reported for it.
_reported = [None, set()]


@declare('WSConv2d')
class WSConv2d(nn.Conv2d):
    """``nn.Conv2d`` (``conv_cfg=dict(type='WSConv2d')``) convolving with its raw ``weight`` standardized (Eq. 5-7).

    Loading a state dict saved with another formula or eps switches the layer to them, with one warning line per
    load; state dicts without ``_extra_state`` keep the configured values.

    Args:
        eps: numerical guard of Eq. 7; must be > 0.
        formula: where eps goes (module docstring; default ``'paper'``).
    """

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, groups=1,
                 bias=True, padding_mode='zeros', eps=1e-5, formula='paper', device=None, dtype=None):
        _check_formula(formula)
        if not eps > 0:
            raise ValueError(f'WSConv2d eps must be positive, got {eps!r}')
        super().__init__(in_channels, out_channels, kernel_size, stride=stride, padding=padding,
                         dilation=dilation, groups=groups, bias=bias, padding_mode=padding_mode,
                         device=device, dtype=dtype)
        self.eps = eps
        self.formula = formula

    def standardized_weight(self) -> torch.Tensor:
        return standardize_weight(self.weight, self.eps, self.formula)

    def eval_form(self, dtype: torch.dtype = torch.float64) -> EvalForm:
        """The eval conv: an ``nn.Conv2d`` holding the standardized weight (Eq. 5, 7) under the layer's formula and
        eps, i.e. those loaded with the weights (``_extra_state``)."""
        with torch.no_grad():
            return EvalForm(None, None, plain_conv(self, self.standardized_weight()), self.weight.dtype,
                            self.out_channels)

    def forward(self, x):
        weight = self.standardized_weight()
        if weight.dtype != x.dtype and not autocast_enabled(x.device.type):
            weight = weight.to(x.dtype)
        return self._conv_forward(x, weight, self.bias)

    def extra_repr(self):
        return super().extra_repr() + f', eps={self.eps}, formula={self.formula!r}'

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
            eps = self.eps  # a state dict cast by .half() rounds eps: the same value
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
        # missing_keys is one list per load call: set_extra_state reports each switch once per load
        self._ws_loading = (missing_keys, prefix)
        try:
            super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                          unexpected_keys, error_msgs)
        finally:
            del self._ws_loading
        key = prefix + EXTRA_STATE_KEY
        if key not in state_dict and key in missing_keys:
            # saved before the formula was saved (or by a plain conv): keep the configured one
            missing_keys.remove(key)

    @classmethod
    def convert_conv(cls, module: nn.Module, eps: float = 1e-5, formula: str = 'paper',
                     exclude=lambda name, conv: False) -> nn.Module:
        """Swap every plain ``nn.Conv2d`` in ``module`` (or ``module`` itself) for a WSConv2d with the same raw
        weights (so the function changes unless they were trained with WS); ``exclude(name, conv)`` keeps convs
        plain. Returns the converted module (new only when ``module`` is a Conv2d), as detectron2's converters."""
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
