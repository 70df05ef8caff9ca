"""A layer's inference form: the plain modules that compute its eval output (as timm keeps
``FrozenBatchNormAct2d`` beside ``BatchNormAct2d``).

Every normdense layer has one method, ``eval_form(dtype=torch.float64)``, returning an :class:`EvalForm`: the
layer's eval output is ``rest(linear x + shift)``, where ``linear`` (a per-channel scale or a (C, C) matrix) and
``shift`` are the part a preceding conv can absorb (None where nothing can: GN+PN, the convs themselves), and
``rest`` the modules that stay. The layer's export path runs :meth:`EvalForm.module` and
``normdense.deploy.fuse`` folds ``linear``, ``shift`` into the neighbouring conv or uses the same module, so the
eval arithmetic of each layer is written once, in the layer's file. The modules are built by assigning their
tensors, never by ``copy_`` or ``.to``: both of torch's ONNX exporters record them then.
"""
from typing import NamedTuple, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from .declare import declare

__all__ = ['EvalForm', 'ChannelAffine', 'ChannelLinear', 'frozen', 'frozen_group_norm', 'has_eval_form', 'plain_conv']


def frozen(t: torch.Tensor, dtype: Optional[torch.dtype] = None) -> nn.Parameter:
    """A parameter holding ``t`` (detached, in ``dtype``), not trained: what an eval form's modules hold."""
    return nn.Parameter(t.detach().to(t.dtype if dtype is None else dtype), requires_grad=False)


def frozen_group_norm(num_groups: int, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> nn.GroupNorm:
    """An eval-mode ``nn.GroupNorm`` holding ``weight``/``bias`` per channel (in their dtype, on their device)."""
    gn = nn.GroupNorm(num_groups, weight.shape[0], eps=eps, device=weight.device, dtype=weight.dtype)
    gn.weight, gn.bias = frozen(weight), frozen(bias)
    return gn.train(False)


@declare('ChannelAffine', decays_as_norm=True)
class ChannelAffine(nn.Module):
    """y = gamma_c x + beta_c after an EquiNorm conv (Sec. 4), for ``norm_cfg=dict(type='ChannelAffine')``;
    ``eps`` is accepted (``build_norm_layer`` always passes it) and unused; ``device``, ``dtype``: of the parameters,
    as for ``nn.BatchNorm2d``. Also the per-channel affine of the other layers' eval forms (:meth:`of`)."""
    _abbr_ = 'ca'

    def __init__(self, num_features: int, eps: float = 1e-5, affine: bool = True, device=None, dtype=None):
        super().__init__()
        if not isinstance(num_features, int) or num_features <= 0:
            raise ValueError(f'ChannelAffine num_features must be a positive int, got {num_features!r}')
        if not affine:
            raise ValueError('ChannelAffine with affine=False would be an identity; drop the norm layer instead')
        self.num_features = num_features
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(num_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(num_features, device=device, dtype=dtype))

    @classmethod
    def of(cls, scale: torch.Tensor, shift: torch.Tensor, dtype: torch.dtype, channels: int) -> 'ChannelAffine':
        """``scale x + shift`` per channel (``channels`` of them: a traced size is no int), in ``dtype``, eval mode."""
        aff = cls(channels)
        aff.weight, aff.bias = frozen(scale, dtype), frozen(shift, dtype)
        aff.check_input = False  # built for its layer's channels; no shape check recorded into an exported graph
        return aff.train(False)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
        nn.init.zeros_(self.bias)

    check_input = True  # a config's layer: its input's channels are checked (one line naming the shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.check_input and (x.dim() < 2 or x.shape[1] != self.num_features):
            raise ValueError(f'ChannelAffine({self.num_features}) expects (N, {self.num_features}, ...) input, '
                             f'got shape {tuple(x.shape)}')
        shape = (1, -1) + (1,) * (x.dim() - 2)
        return x * self.weight.view(shape).to(x.dtype) + self.bias.view(shape).to(x.dtype)

    def eval_affine(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(scale, shift) per channel, float64: the layer is its own eval-time map."""
        return self.weight.detach().double(), self.bias.detach().double()

    def eval_form(self, dtype: torch.dtype = torch.float64) -> 'EvalForm':
        scale, shift = self.eval_affine()
        return EvalForm(scale.to(dtype), shift.to(dtype), nn.Identity(), self.weight.dtype, self.num_features)

    def extra_repr(self) -> str:
        return f'{self.num_features}'


class ChannelLinear(nn.Module):
    """``y[:, o] = sum_c weight[o, c] x[:, c] + bias[o]`` for (N, C, *) inputs (an eval-mode IterNorm)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor):
        super().__init__()
        self.weight, self.bias = frozen(weight), frozen(bias)

    def forward(self, x):
        if x.dim() == 4:
            return F.conv2d(x, self.weight.to(x.dtype)[:, :, None, None], self.bias.to(x.dtype))
        y = torch.movedim(x, 1, -1) @ self.weight.to(x.dtype).t() + self.bias.to(x.dtype)
        return torch.movedim(y, -1, 1)

    def extra_repr(self):
        return f'{self.weight.shape[1]}, {self.weight.shape[0]}'


def plain_conv(conv: nn.Conv2d, weight: torch.Tensor, cls=nn.Conv2d) -> nn.Conv2d:
    """A ``cls`` (an ``nn.Conv2d``) with ``conv``'s geometry, bias and device, holding ``weight`` (in ``conv``'s
    dtype): the eval form of a conv whose kernel is normalized (WS, EquiNorm)."""
    new = cls(conv.in_channels, conv.out_channels, conv.kernel_size, stride=conv.stride, padding=conv.padding,
              dilation=conv.dilation, groups=conv.groups, bias=conv.bias is not None, padding_mode=conv.padding_mode,
              device=conv.weight.device, dtype=conv.weight.dtype)
    new.weight = nn.Parameter(weight.detach().to(conv.weight.dtype))
    if conv.bias is not None:
        new.bias = nn.Parameter(conv.bias.detach().clone())
    return new.train(False)


class EvalForm(NamedTuple):
    """A layer's eval output as ``rest(linear x + shift)`` (module docstring).

    ``linear``: None, a (C,) per-channel scale or a (C, C) matrix, and ``shift`` (C,), in the dtype
    ``eval_form`` was asked for (float64 for folding); their shape is decided by the layer type, never by values,
    so a fused model built from a config has the structure of the fused trained one. ``rest``: the modules that
    stay, in eval mode. ``dtype``: what the layer's parameters hold (the standalone modules' dtype); ``channels``: C.
    ``standalone``: the layer's own module for the whole form where it has one (Unitization takes stage 1 as its
    input affine), else :meth:`module` composes it."""
    linear: Optional[torch.Tensor]
    shift: Optional[torch.Tensor]
    rest: nn.Module
    dtype: torch.dtype
    channels: int
    standalone: Optional[nn.Module] = None

    def module(self) -> nn.Module:
        """The whole eval output as one module, where no conv takes ``linear`` and ``shift``."""
        if self.standalone is not None:
            return self.standalone.train(False)
        if self.linear is None:
            return self.rest.train(False)
        if self.linear.dim() == 1:
            first = ChannelAffine.of(self.linear, self.shift, self.dtype, self.channels)
        else:
            first = ChannelLinear(self.linear.to(self.dtype), self.shift.to(self.dtype))
        if isinstance(self.rest, nn.Identity):
            return first.train(False)
        return nn.Sequential(first, self.rest).train(False)


def has_eval_form(module: nn.Module) -> bool:
    """Whether ``module`` gives its inference form (the normdense layers)."""
    return callable(getattr(type(module), 'eval_form', None))
