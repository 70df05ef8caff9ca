"""Inference folding of normdense layers (eval mode only).

``fuse(model)`` rewrites an eval-mode model in place so that no normdense layer recomputes anything that
is constant at inference. What each layer becomes is the layer's own: its ``eval_form()``
(``normdense/layers/eval_form.py``) gives the modules that compute its eval output, ``rest(linear x + shift)``.
``fuse`` does only what is its own:

* **folding**: where a conv comes right before the layer (mmcv ``ConvModule`` with conv before norm;
  mmdet/mmseg ResNet blocks and stems: ``conv{k}`` -> ``norm{k}_name``; consecutive children of
  ``nn.Sequential``), ``linear`` and ``shift`` go into that conv (a matrix only into an ungrouped conv) and the
  layer becomes ``rest``;
* **walking** the model: every other layer becomes its standalone form, every WS / EquiNorm conv its plain conv.

What the layers become (docs/deploy.md): WS and EquiNorm convs a plain ``nn.Conv2d`` (EquiNorm where its rho is
not provably 1: ``RhoScaledConv2d``); BCN its Eq. 40 affine and an ``nn.GroupNorm``; IterNorm a (C, C) map
(``ChannelLinear`` alone); Unitization its stage-1 affine and ``UnitizationStage2``; EquiNorm's ``ChannelAffine``
itself; GN+PN ``nn.GroupNorm``, phi, ``ChannelAffine`` (nothing folds). All folding arithmetic runs in float64
and is cast back to the conv's dtype. A fused model is for inference: ``fuse`` refuses a model in training mode
(``ExportError``), and fused modules do not train like the originals.
"""
from typing import List, Optional, Tuple

import torch
import torch.nn as nn

from ..errors import ExportError
from ..layers.equinorm import RhoScaledConv2d
from ..layers.eval_form import ChannelLinear, EvalForm, has_eval_form
from ..layers.unitization import UnitizationStage2

__all__ = ['fuse', 'ChannelLinear', 'RhoScaledConv2d', 'UnitizationStage2', 'channel_map_of', 'require_eval']


def require_eval(model: nn.Module, purpose: str) -> None:
    """An ``ExportError`` naming the fix where any module of ``model`` is in training mode."""
    if any(m.training for m in model.modules()):
        raise ExportError(f'{purpose} needs an eval-mode model (the layers fold or record their eval statistics): '
                          'call model.eval() first')


def channel_map_of(norm: nn.Module) -> Tuple[torch.Tensor, torch.Tensor, nn.Module]:
    """The foldable eval-time part of ``norm`` as ``(A, c, rest)``: the norm computes ``rest(A x + c)`` with A a
    (C, C) matrix (diagonal for per-channel affines), c a (C,) vector, in float64 (from its ``eval_form``)."""
    form = _form(norm)
    if form is None or form.linear is None:
        raise TypeError(f'no eval-time channel map for {type(norm).__name__}')
    a = torch.diag(form.linear) if form.linear.dim() == 1 else form.linear
    return a, form.shift, form.rest


def _form(module: nn.Module) -> Optional[EvalForm]:
    # a fused conv (nn.Conv2d, RhoScaledConv2d) has no form: it is plain already
    return module.eval_form() if has_eval_form(module) else None


def _plain_conv(conv: nn.Conv2d) -> nn.Conv2d:
    """The conv's eval form (WS, EquiNorm), or the conv itself when it is plain."""
    form = _form(conv)
    return conv if form is None else form.rest


def _fold_into_conv(conv: nn.Conv2d, linear: torch.Tensor, shift: torch.Tensor) -> Optional[nn.Conv2d]:
    """conv' with conv'(x) = A conv(x) + c (A: ``linear``, a per-channel scale or a matrix); None when A mixes
    channels and the conv is grouped (decided by structure, not values: ``EvalForm``)."""
    matrix = linear.dim() == 2
    if conv.groups != 1 and matrix:
        return None
    conv = _plain_conv(conv)
    w = conv.weight.detach().double()
    b = conv.bias.detach().double() if conv.bias is not None else w.new_zeros(w.shape[0])
    if matrix:
        new_w, new_b = torch.einsum('oc,cikl->oikl', linear, w), linear @ b + shift
    else:
        new_w, new_b = w * linear.view(-1, 1, 1, 1), linear * b + shift
    conv.weight = nn.Parameter(new_w.to(conv.weight.dtype))
    conv.bias = nn.Parameter(new_b.to(conv.weight.dtype))
    return conv


def _fuse_pair(conv: nn.Module, norm: nn.Module):
    """(new_conv, new_norm) for an adjacent conv -> norm pair, or None if it cannot be folded."""
    if not isinstance(conv, nn.Conv2d) or not (type(conv) in (nn.Conv2d, RhoScaledConv2d) or has_eval_form(conv)):
        return None
    form = _form(norm)
    if form is None or form.linear is None or form.linear.shape[0] != conv.out_channels:
        return None
    new_conv = _fold_into_conv(conv, form.linear, form.shift)
    if new_conv is None:
        return None
    return new_conv, form.rest.to(device=new_conv.weight.device).train(False)


def _replace(module: nn.Module, stats: dict) -> nn.Module:
    """A layer with an eval form, standalone: its plain conv or its whole form as one module."""
    form = module.eval_form()
    stats['convs' if form.linear is None and isinstance(form.rest, nn.Conv2d) else 'standalone'] += 1
    return form.module()


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
        setattr(module, conv_name, fused[0])
        setattr(module, norm_name, fused[1])
        stats['folded'] += 1
    for name, child in list(module._modules.items()):
        if child is None:
            continue
        if has_eval_form(child):
            setattr(module, name, _replace(child, stats))
        else:
            _fuse_module(child, stats)


def fuse(model: nn.Module, verbose: bool = False, stats: Optional[dict] = None) -> nn.Module:
    """Fold the eval-time computations of every normdense layer of ``model`` (in place); see the module
    docstring. ``model`` must be in eval mode. Returns the model (a new object only when ``model`` itself
    is a single layer). ``stats`` (a dict), if given, receives the counts of folded pairs
    (``folded``), convs made plain (``convs``) and norms replaced without a conv (``standalone``)."""
    require_eval(model, 'fuse()')
    stats = stats if stats is not None else {}
    stats.update(folded=0, convs=0, standalone=0)
    if has_eval_form(model):
        model = _replace(model, stats)
    else:
        _fuse_module(model, stats)
    if verbose:
        print(f'fuse: {stats["folded"]} conv->norm pairs folded, {stats["convs"]} convs made plain, '
              f'{stats["standalone"]} norms replaced without a conv')
    return model
