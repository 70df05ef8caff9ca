"""Turn ImageNet classifier checkpoints into mmdet / mmseg ResNet backbone checkpoints.

Three source layouts (``--from``), one module each under ``normdense/convert/sources/``: ``mmpretrain``
(an mmengine Runner checkpoint of the ``configs/imagenet`` pretraining), ``authors`` (the WS/BCN authors'
releases) and ``torchvision`` (a BatchNorm ResNet, turned into a BCN/BN + WS starting point).

Output: the bare backbone keys of the target ResNet (no ``backbone.`` prefix), each WSConv2d's formula and
eps among them (``<conv>._extra_state``, see :mod:`normdense.layers.ws`), plus a ``meta`` block (source, WS
formula, norm cfg, the backbone cfg the weights fill, what was dropped and why). The
conversion is checked against the target backbone built from that cfg: keys the source cannot fill
(they would stay at their initialization), keys with no place in the target and shape mismatches are
listed, and :func:`save_backbone_checkpoint` refuses to write such a partial checkpoint unless told to.

This module is the entry point (:func:`convert_backbone`) and re-exports the package's public names, so
``from normdense.convert.backbone import ...`` keeps working.
"""
from typing import Optional

from ..layers.ws import EXTRA_STATE_KEY, WSConv2d, decode_ws_state
from .io import CONVERSION_VERSION, conversion_meta, load_source, save_backbone_checkpoint, split_checkpoint
from .resnet_keys import ARCH_DEPTHS, infer_layout, infer_widths, sequential_stem
from .sources import CONVERTERS, detect_source
from .sources.authors import AUTHORS_DEFAULT_WS, convert_authors
from .sources.mmpretrain import convert_mmpretrain
from .sources.torchvision import TORCHVISION_EFFECT, convert_torchvision, ws_scale
from .spec import (NORM_TYPES, SOURCES, TARGETS, WS_CHOICES, BackboneSpec, Conversion, ConversionError,
                   PartialConversionError)

__all__ = [
    'ARCH_DEPTHS', 'AUTHORS_DEFAULT_WS', 'BackboneSpec', 'CONVERSION_VERSION', 'Conversion', 'ConversionError',
    'NORM_TYPES', 'PartialConversionError', 'SOURCES', 'TARGETS', 'TORCHVISION_EFFECT', 'WS_CHOICES',
    'build_target_backbone', 'check_against_target', 'conversion_meta', 'convert_authors', 'convert_backbone',
    'convert_mmpretrain', 'convert_torchvision', 'detect_source', 'infer_layout', 'infer_widths', 'load_source',
    'record_ws_state', 'save_backbone_checkpoint', 'sequential_stem', 'split_checkpoint', 'ws_scale'
]


def build_target_backbone(spec: BackboneSpec, target: str):
    """Build the mmdet or mmseg backbone the converted weights are meant for (random init)."""
    from mmengine.registry import DefaultScope
    cfg = spec.to_cfg(target)
    if target == 'mmdet':
        import mmdet.models  # noqa: F401
        from mmdet.registry import MODELS
    else:
        import mmseg.models  # noqa: F401
        from mmseg.registry import MODELS
    # build_from_cfg resolves types in the *current default scope*'s registry (after an mmpretrain run that
    # would be mmpretrain's ResNet, whose deep stem has other names): pin the target's scope.
    with DefaultScope.overwrite_default_scope(target):
        return MODELS.build(cfg)


def check_against_target(sd, spec: BackboneSpec, target: str, model=None):
    """(missing, unexpected, mismatched) of ``sd`` against the target backbone's own state dict (``model``:
    the target backbone, when already built)."""
    ref = (model if model is not None else build_target_backbone(spec, target)).state_dict()
    # a missing step counter loads as 0 (torch's BatchNorm and StatNorm2d fill it; checkpoint.load_mismatch)
    missing = [k for k in ref if k not in sd and not k.endswith('num_batches_tracked')]
    unexpected = [k for k in sd if k not in ref]
    mismatched = [(k, tuple(sd[k].shape), tuple(ref[k].shape)) for k in sd
                  if k in ref and tuple(sd[k].shape) != tuple(ref[k].shape)]
    return missing, unexpected, mismatched


def record_ws_state(conv: Conversion, model) -> None:
    """Write every WSConv2d's formula and eps (its ``_extra_state``) into the converted weights, so that
    they travel with them through every later load (fine-tuning, its checkpoints, test, deploy), not only
    through ``meta['ws_formula']`` and PretrainedBackbone. The values are those of the target backbone
    built from the conversion's conv_cfg. A source that already carries them (an mmpretrain checkpoint
    saved by this version) must agree with that choice."""
    for name, m in model.named_modules():
        if not isinstance(m, WSConv2d):
            continue
        key = f'{name}.{EXTRA_STATE_KEY}'
        if key not in conv.state_dict:
            conv.state_dict[key] = m.get_extra_state()
            conv.created.append((key, f'WS formula {m.formula!r} (eps={m.eps:g}) saved with the conv\'s weights'))
            continue
        try:
            formula, eps = decode_ws_state(conv.state_dict[key])
        except ValueError as e:
            raise ConversionError(f'{key}: {e}') from None
        if (formula, eps) != (m.formula, m.eps):
            raise ConversionError(f'{key}: the source weights were trained with WS formula {formula!r} '
                                  f'(eps={eps:g}) but the conversion chose {m.formula!r} (eps={m.eps:g}); '
                                  f'pass --ws-formula {formula}')


def convert_backbone(ckpt, to: str, source: Optional[str] = None, norm: Optional[str] = None,
                     ws_formula: Optional[str] = None, num_groups: Optional[int] = None,
                     bcn_mode: Optional[str] = None) -> Conversion:
    """Convert a loaded checkpoint (see :func:`load_source`) into a backbone for ``to`` ('mmdet'/'mmseg').

    Args:
        source: 'mmpretrain', 'authors' or 'torchvision'; guessed from the keys when None.
        norm: expected norm ('bn', 'gn', 'bcn', 'gnpn', 'iternorm', 'unitization'). For mmpretrain and
            authors sources it is a check against what the checkpoint holds; for torchvision the target
            norm ('bcn', default, or 'bn').
        ws_formula: 'paper', 'std_unbiased', 'var_unbiased' or 'none' (plain convs). mmpretrain: taken
            from the stored config (a different value is an error). Authors: default 'var_unbiased' for
            BCN, 'std_unbiased' for GN checkpoints. Torchvision: the target's WS (default 'paper').
        num_groups: BCN/GN groups where the weights do not say (torchvision->BCN default 32).
        bcn_mode: torchvision->BCN only: 'estimate' (default) or 'batch'.
    """
    if to not in TARGETS:
        raise ConversionError(f'--to must be one of {TARGETS}, got {to!r}')
    if ws_formula is not None and ws_formula not in WS_CHOICES:
        raise ConversionError(f'--ws-formula must be one of {WS_CHOICES}, got {ws_formula!r}')
    if norm is not None and norm not in NORM_TYPES:
        raise ConversionError(f'--norm must be one of {tuple(NORM_TYPES)}, got {norm!r}')
    sd, meta = split_checkpoint(ckpt)
    source = source or detect_source(sd)
    if source not in SOURCES:
        raise ConversionError(f'--from must be one of {SOURCES}, got {source!r}')
    kwargs = dict(norm=norm, ws_formula=ws_formula, num_groups=num_groups)
    if source == 'torchvision':
        kwargs['bcn_mode'] = bcn_mode
    elif bcn_mode is not None:
        raise ConversionError('--bcn-mode applies to torchvision sources only (the mode does not change the '
                              'weights: set it in the fine-tuning config)')
    conv = CONVERTERS[source](sd, meta, **kwargs)
    spec = conv.spec
    spec.stem_channels, spec.base_channels = infer_widths(conv.state_dict)
    conv.target = to
    model = build_target_backbone(spec, to)
    record_ws_state(conv, model)
    conv.missing, conv.unexpected, conv.mismatched = check_against_target(conv.state_dict, spec, to, model)
    if to == 'mmseg' and not spec.deep_stem and not spec.proxy_norm:
        conv.notes.append("plain 7x7 stem: load it with type='ResNet' (deep_stem=False); mmseg's DeepLabV3 configs use "
                     "ResNetV1c, which needs a deep-stem (-v1c) pretraining")
    conv.source_meta = {k: meta[k] for k in ('epoch', 'iter', 'experiment_name', 'time', 'mmengine_version', 'seed',
                                      'checkpoint_epoch', 'checkpoint_best_acc', 'checkpoint_arch')
                if k in meta and isinstance(meta[k], (int, float, str))}
    return conv

