"""``--from torchvision``: a torchvision-layout BatchNorm ResNet (``conv1``, ``bn1``, ``layerX.Y.bnK``, ``fc``),
turned into a BCN (or BN) + WS *starting point*, see :func:`convert_torchvision`."""
import contextlib
from collections import OrderedDict
from typing import Dict

import torch

from ...layers.bcn import BatchChannelNorm2d
from ...layers.ws import standardize_weight
from ..resnet_keys import (CLASSIFIER, infer_layout, is_conv_key, norm_abbr, rename_norm, split_at_norm,
                           strip_prefix)
from ..spec import NORM_TYPES, BackboneSpec, Conversion, ConversionError


def ws_scale(weight: torch.Tensor, formula: str, eps: float = 1e-5) -> torch.Tensor:
    """Per output channel sigma with ``WSConv2d(formula)``'s kernel ``(W - mean) / sigma`` (float64).

    Derived from :func:`normdense.layers.ws.standardize_weight` itself, so it follows the layer exactly.
    A zero filter (standardized to 0) gets sigma = 1."""
    w = weight.detach().double().reshape(weight.shape[0], -1)
    centred = w - w.mean(1, keepdim=True)
    w_hat = standardize_weight(weight.detach().double(), eps, formula).reshape(weight.shape[0], -1)
    num, den = (centred * centred).sum(1), (centred * w_hat).sum(1)
    return torch.where(den > 0, num / den.clamp_min(1e-300), torch.ones_like(num))


@contextlib.contextmanager
def _default_dtype(dtype):
    """Build modules in ``dtype`` (float64 sources stay float64; other dtypes build in float32)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64 if dtype == torch.float64 else torch.float32)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _norm_after_conv(conv_key: str) -> str:
    """The BN that follows a conv in a torchvision ResNet: conv1->bn1, convK->bnK, downsample.0->.1."""
    path = conv_key.rsplit('.', 1)[0]
    if path.endswith('downsample.0'):
        return path[:-1] + '1'
    head, _, last = path.rpartition('.')
    new = 'bn' + last[len('conv'):]
    return f'{head}.{new}' if head else new


TORCHVISION_EFFECT = (
    'torchvision BN ResNet -> {norm}{ws}. Effect on the outputs (eval mode): {effect}')


def convert_torchvision(sd, meta=None, norm=None, ws_formula=None, num_groups=None, bcn_mode=None):
    """A torchvision-layout BatchNorm ResNet -> a BCN (or BN) + WS starting point.

    * ``norm='bcn'`` (default): each BN becomes a BCN via :meth:`BatchChannelNorm2d.convert_norm`: its
      running mean/var become the BCN statistics (the estimates in ``'estimate'`` mode) and gamma/beta the
      batch-stage affine, so BCN's first stage computes exactly the eval-mode BN; the channel stage (a
      per-sample group normalization, ``num_groups`` groups) is new and starts with identity affine.
    * ``ws_formula`` (default ``'paper'``; ``'none'`` keeps plain convs): the raw conv weights are copied and
      WSConv2d standardizes them, i.e. uses ``(W - mean_i) / sigma_i``. sigma_i is folded into the following
      norm's statistics (``running_mean / sigma``, ``running_var / sigma^2``), so the only change is the
      removed per-filter mean (and BN's eps acting as ``eps * sigma^2``): the converted network equals the
      source network with every kernel made zero-mean per output channel.
    So the output is a *starting point*, not the same function: with BCN it is the source network with
    every kernel made zero-mean and a group normalization after every BN; with ``norm='bn'`` and
    ``ws_formula='none'`` it is exactly the source network.
    """
    sd, had_module = strip_prefix(sd, 'module.')
    norm = norm or 'bcn'
    if norm not in ('bcn', 'bn'):
        raise ConversionError(f'a torchvision BN ResNet converts to --norm bcn or bn, not {norm}')
    ws_formula = ws_formula or 'paper'
    bcn_mode = bcn_mode or 'estimate'
    num_groups = num_groups or 32
    notes = ['stripped the DataParallel "module." prefix'] if had_module else []
    dropped, created = [], []
    out = OrderedDict()
    bns: Dict[str, Dict[str, torch.Tensor]] = OrderedDict()
    for k, v in sd.items():
        split = split_at_norm(k)
        if split is not None:
            bns.setdefault(split[0], OrderedDict())[split[1]] = v
        elif k.startswith('fc.'):
            dropped.append((k, CLASSIFIER))
        else:
            out[k] = v
    if ws_formula != 'none':
        for k in [k for k in out if is_conv_key(k) and k.endswith('.weight')]:
            bn = bns.get(_norm_after_conv(k))
            if bn is None or 'running_mean' not in bn or 'running_var' not in bn:
                continue  # surfaces as missing keys
            sigma = ws_scale(out[k], ws_formula)
            bn['running_mean'] = (bn['running_mean'].double() / sigma).to(bn['running_mean'].dtype)
            bn['running_var'] = (bn['running_var'].double() / sigma ** 2).to(bn['running_var'].dtype)
    abbr = norm_abbr(NORM_TYPES[norm])
    for path, params in bns.items():
        new = rename_norm(path, abbr)
        if norm == 'bn':
            for rest, t in params.items():
                out[f'{new}.{rest}'] = t
            continue
        needed = ('weight', 'bias', 'running_mean', 'running_var')
        if not all(n in params for n in needed):
            for rest, t in params.items():
                out[f'{path}.{rest}'] = t  # incomplete BN: reported (missing/unexpected)
            continue
        with _default_dtype(params['weight'].dtype):  # convert_norm builds the BCN in the default dtype
            bn = torch.nn.BatchNorm2d(params['weight'].numel())
            bn.load_state_dict({n: params[n] for n in needed}, strict=False)
            bcn = BatchChannelNorm2d.convert_norm(bn, num_groups=num_groups, mode=bcn_mode)
        for rest, t in bcn.state_dict().items():
            out[f'{new}.{rest}'] = t.detach().clone()
        for rest in ('weight', 'bias'):
            created.append((f'{new}.{rest}', 'BCN channel-stage affine starts as identity (1, 0)'))
        if 'num_batches_tracked' in params:
            dropped.append((f'{path}.num_batches_tracked', 'BatchNorm step counter (BCN counts anew)'))
    depth, deep_stem, avg_down = infer_layout(out)
    norm_cfg = (dict(type='BCN', num_groups=num_groups, mode=bcn_mode) if norm == 'bcn'
                else dict(type='BN', requires_grad=True))
    conv_cfg = None if ws_formula == 'none' else dict(type='WSConv2d', formula=ws_formula)
    spec = BackboneSpec(depth=depth, norm_cfg=norm_cfg, conv_cfg=conv_cfg, deep_stem=deep_stem, avg_down=avg_down)
    if norm == 'bn' and ws_formula == 'none':
        effect = 'identical to the source network (names only).'
    else:
        parts = []
        if ws_formula != 'none':
            parts.append('every conv kernel is made zero-mean per output channel (its scale sigma is folded into '
                         'the following norm\'s statistics; BN eps then acts as eps * sigma^2)')
        if norm == 'bcn':
            parts.append('each BN is followed by a per-sample group normalization over %d groups (BCN\'s new '
                         'channel stage, identity affine); BCN\'s first stage reproduces the eval-mode BN '
                         'exactly' % num_groups)
        effect = 'not the source function: ' + '; '.join(parts) + '. A starting point for fine-tuning.'
    choices = dict(ws_formula=None if ws_formula == 'none' else ws_formula, norm=norm_cfg['type'],
                   norm_cfg=norm_cfg, conv_cfg=conv_cfg,
                   effect=TORCHVISION_EFFECT.format(norm=norm_cfg['type'],
                                                    ws='' if ws_formula == 'none' else f' + WS ({ws_formula})',
                                                    effect=effect))
    if deep_stem:
        notes.append('the source has a deep stem: not a torchvision ResNet layout')
    return Conversion(out, spec, 'torchvision', choices, dropped=dropped, created=created, notes=notes)
