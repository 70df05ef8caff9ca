"""``--from authors``: the WS/BCN authors' releases ("Micro-Batch Training with Batch-Channel Normalization
and Weight Standardization", arXiv:1903.10520).

torchvision ResNet names with a ``module.`` prefix (DataParallel). BCN norms keep the channel-stage affine as
``bnK.weight``/``bnK.bias`` of shape (1, G, 1) and the batch stage as an inner BatchNorm ``bnK.pbn.*``
(ImageNet code) or ``bnK.bn.*`` (the README's ``BCNorm``; with ``estbn_moving_speed`` it is the micro-batch
estimate variant). GN+WS releases have plain GroupNorm ``bnK.weight`` of shape (C,). Every conv is
weight-standardized: BCN code ``w / sqrt(var_unbiased + 1e-5)`` (``'var_unbiased'``, the default for BCN
checkpoints), first WS release ``w / (std_unbiased + 1e-5)`` (``'std_unbiased'``, the default for GN
checkpoints).
"""
from collections import OrderedDict
from typing import Dict

import torch

from ..resnet_keys import (CLASSIFIER, infer_layout, is_conv_key, norm_abbr, rename_norm, split_at_norm,
                           strip_prefix)
from ..spec import NORM_TYPES, BackboneSpec, Conversion, ConversionError

# What the authors' code used: their BCN ImageNet/DeepLab code and their first WS release (GN+WS models,
# mmcv's ConvWS).
AUTHORS_DEFAULT_WS = {'BCN': 'var_unbiased', 'GN': 'std_unbiased'}


def convert_authors(sd, meta=None, norm=None, ws_formula=None, num_groups=None):
    """The WS/BCN authors' layout -> a backbone (see the module docstring)."""
    sd, had_module = strip_prefix(sd, 'module.')
    notes = ['stripped the DataParallel "module." prefix'] if had_module else []
    dropped, out = [], OrderedDict()
    modules: Dict[str, Dict[str, torch.Tensor]] = OrderedDict()
    for k, v in sd.items():
        split = split_at_norm(k)
        if split is not None:
            modules.setdefault(split[0], OrderedDict())[split[1]] = v
        elif is_conv_key(k):
            out[k] = v
        elif k.startswith('fc.'):
            dropped.append((k, CLASSIFIER))
        else:
            out[k] = v  # no rule maps it: reported as unexpected by the target check
    kinds = {}
    for path, params in modules.items():
        inner = next((n for n in ('pbn', 'bn') if f'{n}.weight' in params or f'{n}.running_mean' in params), None)
        if inner is not None:
            kinds[path] = ('BCN', inner)
        elif 'running_var' in params:
            kinds[path] = ('BN', None)
        else:
            kinds[path] = ('GN', None)
    found = sorted({kind for kind, _ in kinds.values()})
    if len(found) != 1:
        raise ConversionError(f'authors checkpoint mixes norm kinds {found}')
    kind = found[0]
    if norm is not None and NORM_TYPES[norm] != kind:
        raise ConversionError(f'--norm {norm} contradicts the checkpoint, whose norms are {kind}')
    abbr = norm_abbr(kind)
    groups, modes = set(), set()
    for path, params in modules.items():
        new = rename_norm(path, abbr)
        _, inner = kinds[path]
        if kind == 'BCN':
            for name in ('weight', 'bias'):
                if name in params:
                    t = params.pop(name)
                    groups.add(t.numel())
                    out[f'{new}.{name}'] = t.reshape(-1).clone()
            moving = params.pop(f'{inner}.estbn_moving_speed', None)
            if moving is not None:
                modes.add('estimate')
                dropped.append((f'{path}.{inner}.estbn_moving_speed',
                                "the release's update-rate buffer r (BCNRateHook sets r = lr instead)"))
            else:
                modes.add('batch')
            for src, dst in (('weight', 'batch_weight'), ('bias', 'batch_bias'), ('running_mean', 'running_mean'),
                             ('running_var', 'running_var')):
                if f'{inner}.{src}' in params:
                    out[f'{new}.{dst}'] = params.pop(f'{inner}.{src}')
            if f'{inner}.num_batches_tracked' in params:
                params.pop(f'{inner}.num_batches_tracked')
                dropped.append((f'{path}.{inner}.num_batches_tracked', 'BatchNorm step counter (BCN counts anew)'))
        for rest, t in params.items():  # GN/BN tensors keep their names; leftovers surface as unexpected
            out[f'{new}.{rest}'] = t
    if kind == 'BCN':
        if len(groups) != 1:
            raise ConversionError(f'BCN layers with different group counts {sorted(groups)}')
        g = groups.pop()
        if num_groups is not None and num_groups != g:
            raise ConversionError(f'--num-groups {num_groups} contradicts the checkpoint ({g} groups)')
        mode = 'estimate' if modes == {'estimate'} else 'batch'
        norm_cfg = dict(type='BCN', num_groups=g, mode=mode)
    elif kind == 'GN':
        norm_cfg = dict(type='GN', num_groups=num_groups or 32, requires_grad=True)
        if num_groups is None:
            notes.append('GroupNorm num_groups is not stored in the weights: assumed 32 (the authors used 32)')
    else:
        norm_cfg = dict(type='BN', requires_grad=True)
    if ws_formula is None:
        if kind not in AUTHORS_DEFAULT_WS:
            raise ConversionError(f'no default WS formula for an authors {kind} checkpoint: pass --ws-formula')
        ws_formula = AUTHORS_DEFAULT_WS[kind]
        ws_reason = (f'default for the authors\' {kind} checkpoints ('
                     + ('their BCN code: w / sqrt(var_unbiased + 1e-5)' if kind == 'BCN'
                        else 'their first WS release: w / (std_unbiased + 1e-5)') + ')')
    else:
        ws_reason = 'given on the command line'
    conv_cfg = None if ws_formula == 'none' else dict(type='WSConv2d', formula=ws_formula)
    depth, deep_stem, avg_down = infer_layout(out)
    spec = BackboneSpec(depth=depth, norm_cfg=norm_cfg, conv_cfg=conv_cfg, deep_stem=deep_stem, avg_down=avg_down)
    choices = dict(ws_formula=None if ws_formula == 'none' else ws_formula, ws_formula_reason=ws_reason,
                   norm=kind, norm_cfg=norm_cfg, conv_cfg=conv_cfg)
    if kind == 'BCN':
        choices['bcn_mode_trained'] = norm_cfg['mode']
    return Conversion(out, spec, 'authors', choices, dropped=dropped, notes=notes)

