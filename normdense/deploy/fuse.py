"""Inference folding of normdense layers (eval mode only).

``fuse(model)`` rewrites an eval-mode model in place so that no normdense layer recomputes anything that
is constant at inference:

* ``WSConv2d``      -> ``nn.Conv2d`` holding the standardized weight, under the layer's formula and eps,
  i.e. those loaded with the weights (``_extra_state``), not necessarily the config's.
* ``EquiConv2d``    -> ``nn.Conv2d`` holding ``s (w + b)`` computed from the running input mean. EquiNorm's
  ``s`` contains ``rho = H_out W_out stride^2 / (H_in W_in)``, which depends on the input size unless
  the conv keeps the size (stride 1, "same" padding) or exactly divides it; a conv whose rho is not
  provably 1 becomes ``RhoScaledConv2d`` (weight at rho = 1, rescaled by the scalar rho per forward).
* Per-channel eval-time affine maps are folded into the preceding conv where the conv -> norm adjacency
  is known (mmcv ``ConvModule`` with conv before norm; mmdet/mmseg ResNet blocks and stems:
  ``conv{k}`` -> ``norm{k}_name``; consecutive children of ``nn.Sequential``):

  - ``BCN`` (both modes): its first stage ``gamma_b (x - mu_hat) / sigma_hat + beta_b`` goes into the
    conv, the layer becomes ``nn.GroupNorm`` with the channel-stage affine (a per-group affine expanded
    to per channel).
  - ``IterNorm``: ``gamma * W_run (x - mu_run) + beta`` (block-diagonal, a 1x1 conv) goes into the conv
    (needs an ungrouped conv because it mixes channels), the layer becomes ``nn.Identity``.
  - ``Unitization2d``: its stage 1 ``(x - mu_run) / sqrt(var_run + eps)`` goes into the conv; stage 2
    (the per-sample unitization, data dependent, so not foldable) stays as ``UnitizationStage2``.
  - ``ChannelAffine`` (EquiNorm's affine): into the conv, becomes ``nn.Identity``.

* The same layers without an adjacent conv become a single per-channel affine (``ChannelAffine``) or,
  for IterNorm, ``ChannelLinear`` (a 1x1 conv / matrix on dim 1); BCN becomes ``nn.Sequential(
  ChannelAffine, GroupNorm)`` and Unitization ``UnitizationStage2`` with its stage 1 as an input affine.
* ``GroupProxyNorm`` (GN+PN): its proxy statistics depend only on parameters, so at inference they are
  constants: it becomes ``nn.Sequential(nn.GroupNorm, phi, ChannelAffine)``: the GN stage with gamma, beta
  as nn.GroupNorm's affine, phi as its torch.nn module, and the proxy normalization as the per-channel
  affine ``K phi + L``, K = 1 / sqrt(Var_proxy + eps_pn) (1 without proxy scaling), L = -E_proxy K. Nothing
  folds into a neighbouring conv: the GN stage is per sample, and the affine after phi would move the
  zero padding of a following conv.

All folding arithmetic runs in float64 and is cast back to the conv's dtype. A fused model is for
inference: ``fuse`` raises if the model is in training mode, and fused modules do not train like the
originals (BCN's estimates no longer update, etc.).
"""
from typing import List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..layers.bcn import BatchChannelNorm2d
from ..layers.equinorm import ChannelAffine, EquiConv2d
from ..layers._activations import activation_module
from ..layers.iternorm import IterNorm
from ..layers.proxy_norm import GroupProxyNorm
from ..layers.unitization import Unitization2d
from ..layers.unitization import _divisor as unitization_divisor
from ..layers.ws import WSConv2d

__all__ = ['fuse', 'ChannelLinear', 'RhoScaledConv2d', 'UnitizationStage2', 'channel_map_of']

_NORMS = (BatchChannelNorm2d, IterNorm, Unitization2d, ChannelAffine)


# --------------------------------------------------------------------------------------------------------
# Replacement modules
# --------------------------------------------------------------------------------------------------------
class RhoScaledConv2d(nn.Conv2d):
    """A fused ``EquiConv2d``: ``rho(H, W) * conv(x, weight) + bias``, rho as in EquiNorm Sec. 4.1."""

    def _output_hw(self, h, w):
        return EquiConv2d._output_hw(self, h, w)

    def forward(self, x):
        h_out, w_out = self._output_hw(x.shape[2], x.shape[3])
        rho = h_out * w_out * self.stride[0] * self.stride[1] / float(x.shape[2] * x.shape[3])
        return self._conv_forward(x, self.weight * rho, self.bias)


class ChannelLinear(nn.Module):
    """``y[:, o] = sum_c weight[o, c] x[:, c] + bias[o]`` for (N, C, *) inputs (an eval-mode IterNorm)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
        self.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x):
        if x.dim() == 4:
            return F.conv2d(x, self.weight.to(x.dtype)[:, :, None, None], self.bias.to(x.dtype))
        y = torch.movedim(x, 1, -1) @ self.weight.to(x.dtype).t() + self.bias.to(x.dtype)
        return torch.movedim(y, -1, 1)

    def extra_repr(self):
        return f'{self.weight.shape[1]}, {self.weight.shape[0]}'


class UnitizationStage2(nn.Module):
    """Unitization2d's stage 2 (per-sample partial unitization + affine) after its stage 1 was folded away.

    ``in_scale``/``in_shift`` hold stage 1 when there was no conv to fold it into (else 1 and 0).
    """

    def __init__(self, src: Unitization2d, in_scale: torch.Tensor, in_shift: torch.Tensor):
        super().__init__()
        self.num_features = src.num_features
        self.eps = src.eps
        self.n = src.n
        self.norm_divisor = src.norm_divisor
        self.affine = src.affine
        self.register_buffer('alpha', src.alpha.detach().clone())
        if src.affine:
            self.register_buffer('weight', src.weight.detach().clone())
            self.register_buffer('bias', src.bias.detach().clone())
        else:
            self.weight = self.bias = None
        self.register_buffer('in_scale', in_scale.detach().to(src.alpha.dtype).clone())
        self.register_buffer('in_shift', in_shift.detach().to(src.alpha.dtype).clone())

    def forward(self, x):
        if x.numel() == 0:
            return x
        in_dtype = x.dtype
        if in_dtype in (torch.float16, torch.bfloat16):
            x = x.float()
        bshape = (1, -1) + (1,) * (x.dim() - 2)
        x_hat = x * self.in_scale.to(x.dtype).view(bshape) + self.in_shift.to(x.dtype).view(bshape)
        n = unitization_divisor(self, x[0, 0].numel())  # n, else H*W or (H*W)^2, as the layer
        p = torch.rsqrt(x_hat.pow(2).flatten(1).sum(1) / n + self.eps)
        alpha = self.alpha.to(x.dtype)
        scale = p[:, None] * alpha[None, :] + (1.0 - alpha)[None, :]
        if self.affine:
            scale = scale * self.weight.to(x.dtype)[None, :]
            y = x_hat * scale.view(scale.shape + (1,) * (x.dim() - 2)) + self.bias.to(x.dtype).view(bshape)
        else:
            y = x_hat * scale.view(scale.shape + (1,) * (x.dim() - 2))
        return y.to(in_dtype)

    def extra_repr(self):
        return f'{self.num_features}, eps={self.eps}, n={self.n or "H*W"}'


# --------------------------------------------------------------------------------------------------------
# Eval-time maps of the norms
# --------------------------------------------------------------------------------------------------------
def channel_map_of(norm: nn.Module) -> Tuple[torch.Tensor, torch.Tensor, nn.Module]:
    """The foldable eval-time part of ``norm`` as ``(A, c, rest)``: the norm computes ``rest(A x + c)``
    with A a (C, C) matrix (diagonal for per-channel affines), c a (C,) vector, in float64. The layer
    supplies its map (``eval_linear`` / ``eval_affine``); ``rest`` is what stays of it."""
    if not isinstance(norm, _NORMS):
        raise TypeError(f'no eval-time channel map for {type(norm).__name__}')
    if isinstance(norm, IterNorm):
        matrix, shift = norm.eval_linear()
        return matrix, shift, nn.Identity()
    scale, shift = norm.eval_affine()
    if isinstance(norm, BatchChannelNorm2d):
        rest = _group_norm_of(norm)
    elif isinstance(norm, Unitization2d):
        rest = UnitizationStage2(norm, torch.ones_like(scale), torch.zeros_like(scale))
    else:
        rest = nn.Identity()
    return torch.diag(scale), shift, rest


def _group_norm_of(bcn: BatchChannelNorm2d) -> nn.GroupNorm:
    """BCN's channel stage as a plain nn.GroupNorm (per-group affine expanded to per channel)."""
    gn = nn.GroupNorm(bcn.num_groups, bcn.num_channels, eps=bcn.eps, affine=True, device=bcn.weight.device,
                      dtype=bcn.weight.dtype)
    weight, bias = bcn.weight.detach(), bcn.bias.detach()
    if bcn.group_affine:
        per_group = bcn.num_channels // bcn.num_groups
        weight, bias = weight.repeat_interleave(per_group), bias.repeat_interleave(per_group)
    with torch.no_grad():
        gn.weight.copy_(weight)
        gn.bias.copy_(bias)
    return gn


def _standalone(norm: nn.Module) -> nn.Module:
    """Replacement of a foldable norm that has no conv in front of it."""
    a, c, rest = channel_map_of(norm)
    dtype, device = _param_like(norm)
    # decided by the layer type, never by values, so that a fused model built from a config has the
    # same structure as the fused trained one (load_fused relies on it)
    is_diag = not isinstance(norm, IterNorm)
    if isinstance(norm, Unitization2d):
        return UnitizationStage2(norm, torch.diagonal(a), c).to(device)
    if is_diag:
        with torch.device(device):  # built where it runs: no CPU copy to move
            aff = ChannelAffine(a.shape[0]).to(dtype)  # in its dtype before the copy: no float32 rounding
        with torch.no_grad():
            aff.weight.copy_(torch.diagonal(a))
            aff.bias.copy_(c)
    else:
        aff = ChannelLinear(a.to(dtype), c.to(dtype)).to(device)
    if isinstance(rest, nn.Identity):
        return aff
    return nn.Sequential(aff, rest)


def _proxy_norm_modules(pn: GroupProxyNorm) -> nn.Sequential:
    """GN+PN at inference (module docstring): GroupNorm with gamma, beta, then phi, then K phi + L."""
    with torch.no_grad():
        mean, var = pn.proxy_statistics(torch.float64)
        k = torch.rsqrt(var + pn.proxy_eps) if pn.proxy_scaling else torch.ones_like(var)
    dtype, device = pn.weight.dtype, pn.weight.device
    gn = nn.GroupNorm(pn.num_groups, pn.num_channels, eps=pn.eps, affine=True, device=device, dtype=dtype)
    with torch.device(device):
        proxy = ChannelAffine(pn.num_channels).to(dtype)
    with torch.no_grad():
        gn.weight.copy_(pn.weight)
        gn.bias.copy_(pn.bias)
        proxy.weight.copy_(k)
        proxy.bias.copy_(-mean * k)
    return nn.Sequential(gn, activation_module(pn.act, pn.act_kwargs), proxy).train(False)


def _param_like(m: nn.Module):
    for t in list(m.parameters()) + list(m.buffers()):
        if t.is_floating_point():
            return t.dtype, t.device
    return torch.get_default_dtype(), torch.device('cpu')


# --------------------------------------------------------------------------------------------------------
# Convs
# --------------------------------------------------------------------------------------------------------
def _rho_is_one(conv: nn.Conv2d) -> bool:
    """True when EquiNorm's rho is 1 for every input size (the output keeps the input's size)."""
    if isinstance(conv.padding, str):
        return conv.padding == 'same'
    return all(s == 1 and d * (k - 1) == 2 * p
               for s, p, d, k in zip(conv.stride, conv.padding, conv.dilation, conv.kernel_size))


def _plain_conv(conv: nn.Conv2d) -> nn.Conv2d:
    """An nn.Conv2d (or RhoScaledConv2d) computing exactly what the eval-mode conv computes."""
    if type(conv) in (nn.Conv2d, RhoScaledConv2d):
        return conv
    if isinstance(conv, WSConv2d):
        with torch.no_grad():
            weight = conv.standardized_weight().to(conv.weight.dtype)
        cls = nn.Conv2d
    elif isinstance(conv, EquiConv2d):
        with torch.no_grad():
            # s (w + b) at rho = 1; the real rho is reapplied per forward unless it is always 1
            weight = conv.eval_weight(rho=1.0).to(conv.weight.dtype)
        cls = nn.Conv2d if _rho_is_one(conv) else RhoScaledConv2d
    else:
        raise TypeError(f'cannot make a plain conv from {type(conv).__name__}')
    new = cls(conv.in_channels, conv.out_channels, conv.kernel_size, stride=conv.stride, padding=conv.padding,
              dilation=conv.dilation, groups=conv.groups, bias=conv.bias is not None,
              padding_mode=conv.padding_mode, device=conv.weight.device, dtype=conv.weight.dtype)
    with torch.no_grad():
        new.weight.copy_(weight)
        if conv.bias is not None:
            new.bias.copy_(conv.bias)
    new.train(conv.training)
    return new


def _fold_into_conv(conv: nn.Conv2d, a: torch.Tensor, c: torch.Tensor, diag: bool) -> Optional[nn.Conv2d]:
    """conv' with conv'(x) = A conv(x) + c; None when A mixes channels (``diag=False``) and the conv is
    grouped (decided by structure, not values, see ``_standalone``)."""
    if conv.groups != 1 and not diag:
        return None
    conv = _plain_conv(conv)
    w = conv.weight.detach().double()
    b = conv.bias.detach().double() if conv.bias is not None else w.new_zeros(w.shape[0])
    if diag:
        d = torch.diagonal(a)
        new_w = w * d.view(-1, 1, 1, 1)
    else:
        new_w = torch.einsum('oc,cikl->oikl', a, w)
    new_b = a @ b + c
    if conv.bias is None:
        conv.bias = nn.Parameter(torch.empty(w.shape[0], device=conv.weight.device, dtype=conv.weight.dtype))
    with torch.no_grad():
        conv.weight.copy_(new_w.to(conv.weight.dtype))
        conv.bias.copy_(new_b.to(conv.bias.dtype))
    return conv


def _fuse_pair(conv: nn.Module, norm: nn.Module):
    """(new_conv, new_norm) for an adjacent conv -> norm pair, or None if it cannot be folded."""
    if not (isinstance(conv, nn.Conv2d) and type(conv) in (nn.Conv2d, WSConv2d, EquiConv2d, RhoScaledConv2d)):
        return None
    if not isinstance(norm, _NORMS):
        return None
    a, c, rest = channel_map_of(norm)
    if a.shape[0] != conv.out_channels:
        return None
    new_conv = _fold_into_conv(conv, a, c, diag=not isinstance(norm, IterNorm))
    if new_conv is None:
        return None
    return new_conv, rest.to(device=new_conv.weight.device)


# --------------------------------------------------------------------------------------------------------
# Walking the module graph
# --------------------------------------------------------------------------------------------------------
def _conv_norm_pairs(module: nn.Module) -> List[Tuple[str, str]]:
    """Attribute names (conv, norm) of the known conv -> norm adjacencies directly inside ``module``."""
    pairs = []
    order = getattr(module, 'order', None)
    norm_name = getattr(module, 'norm_name', None)
    if isinstance(order, (tuple, list)) and isinstance(norm_name, str) and hasattr(module, 'conv') \
            and getattr(module, 'with_norm', False) and 'conv' in order and 'norm' in order \
            and order.index('norm') == order.index('conv') + 1:
        pairs.append(('conv', norm_name))  # mmcv ConvModule
    for k in (1, 2, 3):  # mmdet/mmseg ResNet blocks (BasicBlock, Bottleneck) and ResNet's stem
        # norm{k}_name: a property (BasicBlock, ResNet) or an instance attribute (Bottleneck)
        if f'conv{k}' in module._modules:
            norm_attr = getattr(module, f'norm{k}_name', None)
            if isinstance(norm_attr, str) and norm_attr in module._modules:
                pairs.append((f'conv{k}', norm_attr))
    if isinstance(module, nn.Sequential):
        names = list(module._modules)
        for prev, nxt in zip(names, names[1:]):
            pairs.append((prev, nxt))
    return pairs


def _fuse_module(module: nn.Module, stats: dict) -> None:
    for conv_name, norm_name in _conv_norm_pairs(module):
        conv, norm = module._modules.get(conv_name), module._modules.get(norm_name)
        if conv is None or norm is None:
            continue
        fused = _fuse_pair(conv, norm)
        if fused is None:
            continue
        new_conv, new_norm = fused
        new_norm.train(False)
        setattr(module, conv_name, new_conv)
        setattr(module, norm_name, new_norm)
        stats['folded'] += 1
    for name, child in list(module._modules.items()):
        if child is None:
            continue
        if isinstance(child, (WSConv2d, EquiConv2d)):
            setattr(module, name, _plain_conv(child))
            stats['convs'] += 1
        elif isinstance(child, _NORMS):
            new = _standalone(child)
            new.train(False)
            setattr(module, name, new)
            stats['standalone'] += 1
        elif isinstance(child, GroupProxyNorm):
            setattr(module, name, _proxy_norm_modules(child))
            stats['standalone'] += 1
        else:
            _fuse_module(child, stats)


def fuse(model: nn.Module, verbose: bool = False, stats: Optional[dict] = None) -> nn.Module:
    """Fold the eval-time computations of every normdense layer of ``model`` (in place); see the module
    docstring. ``model`` must be in eval mode. Returns the model (a new object only when ``model`` itself
    is a single layer). ``stats`` (a dict), if given, receives the counts of folded pairs
    (``folded``), convs made plain (``convs``) and norms replaced without a conv (``standalone``)."""
    if any(m.training for m in model.modules()):
        raise RuntimeError('fuse() folds eval-time statistics: call model.eval() first')
    stats = stats if stats is not None else {}
    stats.update(folded=0, convs=0, standalone=0)
    if isinstance(model, (WSConv2d, EquiConv2d)):
        model = _plain_conv(model)
        stats['convs'] += 1
    elif isinstance(model, _NORMS):
        model = _standalone(model)
        model.train(False)
        stats['standalone'] += 1
    elif isinstance(model, GroupProxyNorm):
        model = _proxy_norm_modules(model)
        stats['standalone'] += 1
    else:
        _fuse_module(model, stats)
    if verbose:
        print(f'fuse: {stats["folded"]} conv->norm pairs folded, {stats["convs"]} convs made plain, '
              f'{stats["standalone"]} norms replaced without a conv')
    return model
