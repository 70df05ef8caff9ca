"""Turn ImageNet classifier checkpoints into mmdet / mmseg ResNet backbone checkpoints.

Three source layouts (``--from``):

``mmpretrain``   an mmengine Runner checkpoint of an mmpretrain ``ImageClassifier`` (the
                 ``configs/imagenet`` pretraining configs): keys ``backbone.*``, ``head.*``; the config
                 that trained it is in ``meta['cfg']`` (conv/norm cfgs, WS formula). mmpretrain's
                 ``ResNetV1c`` builds its deep stem from ConvModules (``stem.0.conv``, ``stem.0.bn``),
                 mmdet/mmseg from a Sequential (``stem.0``, ``stem.1``, ``stem.3``, ...): remapped.
``authors``      the WS/BCN authors' releases: torchvision ResNet names with a ``module.`` prefix
                 (DataParallel). BCN norms keep the channel-stage affine as ``bnK.weight``/``bnK.bias`` of
                 shape (1, G, 1) and the batch stage as an inner BatchNorm ``bnK.pbn.*`` (ImageNet code) or
                 ``bnK.bn.*`` (the README's ``BCNorm``; with ``estbn_moving_speed`` it is the micro-batch
                 estimate variant). GN+WS releases have plain GroupNorm ``bnK.weight`` of shape (C,).
                 Every conv is weight-standardized: BCN code ``w / sqrt(var_unbiased + 1e-5)``
                 (``'var_unbiased'``, the default for BCN checkpoints), first WS release
                 ``w / (std_unbiased + 1e-5)`` (``'std_unbiased'``, the default for GN checkpoints).
``torchvision``  a torchvision-layout BatchNorm ResNet (``conv1``, ``bn1``, ``layerX.Y.bnK``, ``fc``),
                 turned into a BCN (or BN) + WS *starting point*, see :func:`convert_torchvision`.

Output: the bare backbone keys of the target ResNet (no ``backbone.`` prefix) plus a ``meta`` block
(source, WS formula, norm cfg, the backbone cfg the weights fill, what was dropped and why). The
conversion is checked against the target backbone built from that cfg: keys the source cannot fill
(they would stay at their initialization), keys with no place in the target and shape mismatches are
listed, and :func:`save_backbone_checkpoint` refuses to write such a partial checkpoint unless told to.
"""
import contextlib
import copy
import datetime
import hashlib
import os
import os.path as osp
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from ..layers.bcn import BatchChannelNorm2d
from ..layers.ws import WS_FORMULAS, standardize_weight

SOURCES = ('mmpretrain', 'authors', 'torchvision')
TARGETS = ('mmdet', 'mmseg')
# --norm choices -> norm_cfg type
NORM_TYPES = {'bn': 'BN', 'gn': 'GN', 'bcn': 'BCN', 'gnpn': 'GNPN', 'iternorm': 'IterNorm',
              'unitization': 'Unitization'}
WS_CHOICES = WS_FORMULAS + ('none', )
# What the authors' code used (REFERENCE_NOTES.md Sec. 1): their BCN ImageNet/DeepLab code and their first
# WS release (GN+WS models, mmcv's ConvWS).
AUTHORS_DEFAULT_WS = {'BCN': 'var_unbiased', 'GN': 'std_unbiased'}
ARCH_DEPTHS = {('BasicBlock', (2, 2, 2, 2)): 18, ('BasicBlock', (3, 4, 6, 3)): 34,
               ('Bottleneck', (3, 4, 6, 3)): 50, ('Bottleneck', (3, 4, 23, 3)): 101,
               ('Bottleneck', (3, 8, 36, 3)): 152}
CONVERSION_VERSION = 1

_NOT_BACKBONE = 'classifier neck/head/preprocessor, not part of the backbone'
_CLASSIFIER = 'classifier (fc), not part of the backbone'


class ConversionError(ValueError):
    """The source cannot be converted as asked (unknown layout, contradicting options, ...)."""


@dataclass
class BackboneSpec:
    """What the converted weights fill: a ResNet with this depth, stem, conv and norm cfg."""
    depth: int
    norm_cfg: dict
    conv_cfg: Optional[dict] = None
    deep_stem: bool = False
    avg_down: bool = False
    proxy_norm: bool = False  # PNResNet wiring (GN+PN)
    plain_norm_cfg: Optional[dict] = None  # PNResNet's norm before the residual add / downsample
    stem_channels: int = 64  # output channels of the stem (a narrower ResNet, e.g. a demo's, has fewer)
    base_channels: int = 64  # channels of the first stage (doubled per stage)

    def to_cfg(self, target: str) -> dict:
        """The backbone cfg for an mmdet or mmseg config (without out_indices, strides, init_cfg...)."""
        if target not in TARGETS:
            raise ConversionError(f'target must be one of {TARGETS}, got {target!r}')
        extra = {}
        if self.proxy_norm:
            if self.avg_down:
                raise ConversionError('PNResNet has no avg_down variant')
            arch = 'PNResNetV1c' if self.deep_stem else 'PNResNet'
            if self.plain_norm_cfg is not None:
                extra['plain_norm_cfg'] = copy.deepcopy(self.plain_norm_cfg)
        elif target == 'mmseg' and self.deep_stem:
            arch = 'ResNetV1d' if self.avg_down else 'ResNetV1c'
        elif target == 'mmdet' and self.deep_stem and self.avg_down:
            arch = 'ResNetV1d'
        else:
            arch = 'ResNet'
            if self.deep_stem:
                extra['deep_stem'] = True
            if self.avg_down:
                extra['avg_down'] = True
        cfg = dict(type=arch, depth=self.depth, **extra)
        if (self.stem_channels, self.base_channels) != (64, 64):
            cfg.update(stem_channels=self.stem_channels, base_channels=self.base_channels)
        cfg['conv_cfg'] = copy.deepcopy(self.conv_cfg)
        cfg['norm_cfg'] = copy.deepcopy(self.norm_cfg)
        return cfg


@dataclass
class Conversion:
    """A converted backbone state dict and everything known about how it was made."""
    state_dict: 'OrderedDict[str, torch.Tensor]'
    spec: BackboneSpec
    target: str
    source_format: str
    choices: dict  # ws formula, norm, bcn mode... (recorded in the output meta)
    dropped: List[Tuple[str, str]] = field(default_factory=list)  # source keys not carried over, why
    missing: List[str] = field(default_factory=list)  # target keys the source could not fill
    unexpected: List[str] = field(default_factory=list)  # converted keys with no place in the target
    mismatched: List[Tuple[str, tuple, tuple]] = field(default_factory=list)  # key, source, target shape
    created: List[Tuple[str, str]] = field(default_factory=list)  # target keys set by the conversion, why
    notes: List[str] = field(default_factory=list)
    source_meta: dict = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        """True when every target key is filled from the source with the right shape and nothing is left
        over: the checkpoint loads with strict=True and leaves nothing at its initialization."""
        return not (self.missing or self.unexpected or self.mismatched)

    @property
    def backbone_cfg(self) -> dict:
        return self.spec.to_cfg(self.target)

    def report(self) -> str:
        lines = [f'source layout: {self.source_format}; target: {self.target} {self.backbone_cfg}']
        for k, v in self.choices.items():
            lines.append(f'  {k}: {v}')
        lines.append(f'converted {len(self.state_dict)} backbone tensors')
        lines += _grouped('source keys not carried over', self.dropped)
        lines += _grouped('target keys set by the conversion (not from the source)', self.created)
        if self.missing:
            lines.append(f'NOT MAPPED: {len(self.missing)} target keys the source does not fill (they would stay '
                         f'at their initialization):')
            lines += [f'    {k}' for k in self.missing]
        if self.unexpected:
            lines.append(f'NOT MAPPED: {len(self.unexpected)} source tensors with no place in the target backbone:')
            lines += [f'    {k}' for k in self.unexpected]
        if self.mismatched:
            lines.append(f'NOT MAPPED: {len(self.mismatched)} shape mismatches (source vs target):')
            lines += [f'    {k}: {tuple(a)} vs {tuple(b)}' for k, a, b in self.mismatched]
        lines += [f'note: {n}' for n in self.notes]
        lines.append('complete: every target key mapped' if self.complete else 'PARTIAL conversion')
        return '\n'.join(lines)


def _grouped(title, pairs):
    if not pairs:
        return []
    by_reason: Dict[str, List[str]] = OrderedDict()
    for key, reason in pairs:
        by_reason.setdefault(reason, []).append(key)
    lines = [f'{title}:']
    for reason, keys in by_reason.items():
        shown = ', '.join(keys[:4]) + (f', ... ({len(keys)} in all)' if len(keys) > 4 else '')
        lines.append(f'  {reason}: {shown}')
    return lines


# --------------------------------------------------------------------------------------------------
# reading sources
# --------------------------------------------------------------------------------------------------
def load_source(path: str) -> dict:
    """Read a source checkpoint (local path, ``https://``, ``open-mmlab://``, ``torchvision://``) through
    mmengine's loaders, weights-only (:func:`normdense.checkpoint.read_checkpoint`): never unpickles
    arbitrary objects; a damaged file is a one-line ``cannot read checkpoint PATH: <reason>``."""
    from ..checkpoint import CheckpointReadError, read_checkpoint
    try:
        return read_checkpoint(path, map_location='cpu')
    except FileNotFoundError:
        raise FileNotFoundError(f'source checkpoint not found: {path}') from None
    except CheckpointReadError as e:  # UnsafeCheckpointError included
        raise ConversionError(str(e)) from None


def split_checkpoint(ckpt) -> Tuple['OrderedDict[str, torch.Tensor]', dict]:
    """(state_dict, meta) of a loaded checkpoint: mmengine (``state_dict`` + ``meta``), pytorch-classification
    (``state_dict`` + ``epoch``...), ``model``-wrapped, or a bare state dict."""
    if not isinstance(ckpt, dict):
        raise ConversionError(f'expected a checkpoint dict, got {type(ckpt).__name__}')
    meta = ckpt.get('meta') if isinstance(ckpt.get('meta'), dict) else {}
    for key in ('state_dict', 'model'):
        if isinstance(ckpt.get(key), dict):
            sd = ckpt[key]
            break
    else:
        sd = ckpt
    tensors = OrderedDict((k, v) for k, v in sd.items() if torch.is_tensor(v))
    if not tensors:
        raise ConversionError('the checkpoint holds no tensors')
    extra = {k: v for k, v in ckpt.items() if k not in ('state_dict', 'model', 'meta', 'optimizer', 'message_hub',
                                                         'param_schedulers') and not torch.is_tensor(v)
             and isinstance(v, (int, float, str))}
    return tensors, dict(meta, **{f'checkpoint_{k}': v for k, v in extra.items()})


def _strip(sd, prefix):
    if sd and all(k.startswith(prefix) for k in sd):
        return OrderedDict((k[len(prefix):], v) for k, v in sd.items()), True
    return sd, False


def detect_source(sd) -> str:
    """Guess the layout of a state dict (``--from`` when not given)."""
    keys = list(sd)
    if any(k.startswith('backbone.') for k in keys):
        return 'mmpretrain'
    bare, _ = _strip(sd, 'module.')
    if any(re.search(r'(^|\.)bn\d+\.(pbn|bn)\.', k) for k in bare):
        return 'authors'
    if 'conv1.weight' in bare and any(k.endswith('.running_var') for k in bare):
        return 'torchvision'  # BatchNorm ResNet (with or without a DataParallel prefix)
    if 'conv1.weight' in bare and 'bn1.weight' in bare:
        return 'authors'  # GN+WS release (GroupNorm under BN names, no statistics)
    raise ConversionError('cannot tell the checkpoint layout from its keys (first keys: '
                          f'{keys[:5]}); pass --from {{{",".join(SOURCES)}}}')


# --------------------------------------------------------------------------------------------------
# key structure of ResNets
# --------------------------------------------------------------------------------------------------
def _norm_split(key: str, abbrs=('bn', )):
    """Split ``key`` at a norm module of a torchvision-style/mmdet ResNet: returns (module path, rest) with
    the module being ``{abbr}N`` (stem or block norm) or ``downsample.1``; None for other keys."""
    parts = key.split('.')
    pattern = re.compile(r'(%s)\d+$' % '|'.join(map(re.escape, abbrs)))
    for i, p in enumerate(parts[:-1]):
        if pattern.fullmatch(p) or (p == '1' and i > 0 and parts[i - 1] == 'downsample'):
            return '.'.join(parts[:i + 1]), '.'.join(parts[i + 1:])
    return None


def _conv_key(key: str) -> bool:
    return re.fullmatch(r'(layer\d+\.\d+\.)?(conv\d+|downsample\.0)\.(weight|bias)', key) is not None


def _rename_norm(path: str, abbr: str) -> str:
    """``layer1.0.bn2`` -> ``layer1.0.{abbr}2``; ``downsample.1`` keeps its index."""
    head, _, last = path.rpartition('.')
    m = re.fullmatch(r'[a-z]+(\d+)', last)
    if m is None:
        return path
    new = f'{abbr}{m.group(1)}'
    return f'{head}.{new}' if head else new


def infer_layout(sd) -> Tuple[int, bool, bool]:
    """(depth, deep_stem, avg_down) from backbone keys in mmdet/mmseg naming."""
    blocks = {}
    for k in sd:
        m = re.match(r'layer(\d+)\.(\d+)\.', k)
        if m:
            stage, idx = int(m.group(1)), int(m.group(2))
            blocks[stage] = max(blocks.get(stage, 0), idx + 1)
    if sorted(blocks) != [1, 2, 3, 4]:
        raise ConversionError(f'expected 4 ResNet stages layer1..layer4, found {sorted(blocks)}')
    block = 'Bottleneck' if any(re.match(r'layer\d+\.\d+\.conv3\.', k) for k in sd) else 'BasicBlock'
    counts = tuple(blocks[s] for s in (1, 2, 3, 4))
    depth = ARCH_DEPTHS.get((block, counts))
    if depth is None:
        raise ConversionError(f'unknown ResNet: {block} with {counts} blocks per stage')
    deep_stem = any(k.startswith('stem.') for k in sd)
    avg_down = any(re.match(r'layer\d+\.\d+\.downsample\.2\.', k) for k in sd)
    return depth, deep_stem, avg_down


def infer_widths(sd) -> Tuple[int, int]:
    """(stem_channels, base_channels) from backbone weights in mmdet/mmseg naming: the stem's last conv
    (``stem.6`` of the three-conv deep stem, else ``conv1``) and the first block's ``conv1`` give them. A
    source missing those keys gets the standard (64, 64); the target check then lists what is missing."""
    stem_key = 'stem.6.weight' if 'stem.6.weight' in sd else 'conv1.weight'
    if stem_key not in sd or 'layer1.0.conv1.weight' not in sd:
        return 64, 64
    return int(sd[stem_key].shape[0]), int(sd['layer1.0.conv1.weight'].shape[0])


def sequential_stem(sd) -> Tuple['OrderedDict[str, torch.Tensor]', bool]:
    """mmpretrain's ConvModule deep stem (``stem.i.conv.*``, ``stem.i.<norm>.*``) -> the Sequential stem of
    mmdet/mmseg (``stem.{3i}.*`` conv, ``stem.{3i+1}.*`` norm; ReLUs at 3i+2 have no parameters)."""
    if not any(re.match(r'stem\.\d+\.conv\.', k) for k in sd):
        return sd, False
    out = OrderedDict()
    for k, v in sd.items():
        m = re.match(r'stem\.(\d+)\.([A-Za-z_]+)\.(.+)$', k)
        if m:
            i, name, rest = int(m.group(1)), m.group(2), m.group(3)
            k = f'stem.{3 * i}.{rest}' if name == 'conv' else f'stem.{3 * i + 1}.{rest}'
        out[k] = v
    return out, True


def _norm_abbr(norm_type: str) -> str:
    """The attribute name mmcv's build_norm_layer gives a norm (from the class's ``_abbr_``)."""
    from mmcv.cnn.bricks.norm import infer_abbr
    from mmengine.registry import MODELS
    with MODELS.switch_scope_and_registry(None) as registry:
        cls = registry.get(norm_type)
    if cls is None:
        raise ConversionError(f'unknown norm type {norm_type!r}')
    return infer_abbr(cls)


# --------------------------------------------------------------------------------------------------
# norm / conv cfg inference
# --------------------------------------------------------------------------------------------------
def _backbone_cfg_from_meta(meta: dict) -> Optional[dict]:
    """The ``model.backbone`` cfg of the config stored in an mmengine checkpoint's meta, if readable."""
    text = meta.get('cfg') if isinstance(meta, dict) else None
    if not isinstance(text, str):
        return None
    from mmengine.config import Config
    try:
        cfg = Config.fromstring(text, file_format='.py')
        backbone = cfg.model.backbone
        return backbone.to_dict() if hasattr(backbone, 'to_dict') else dict(backbone)
    except Exception:
        return None


def _norm_cfg_from_keys(sd, num_groups=None) -> Tuple[dict, bool, List[str]]:
    """Infer (norm_cfg, proxy_norm, notes) from backbone keys in mmdet naming."""
    notes = []
    names = set()
    for k in sd:
        for part in k.split('.'):
            m = re.fullmatch(r'([a-z]+)\d+', part)
            if m and m.group(1) not in ('layer', 'conv', 'stem'):
                names.add(m.group(1))
    if len(names) != 1:
        raise ConversionError(f'cannot tell the norm layer from the keys (norm names {sorted(names)}); '
                              'convert a checkpoint that carries its config, or pass --norm')
    abbr = names.pop()
    suffixes = {k.rsplit('.', 1)[-1] for k in sd}
    if abbr == 'bcn':
        pairs = [(sd[k], sd[k[:-len('weight')] + 'batch_weight']) for k in sd
                 if k.endswith('.weight') and k[:-len('weight')] + 'batch_weight' in sd]
        grouped = [w.numel() for w, b in pairs if w.numel() != b.numel()]
        if grouped:
            groups = sorted(set(grouped))
            if len(groups) != 1:
                raise ConversionError(f'BCN layers with different group counts {groups}')
            return dict(type='BCN', num_groups=groups[0]), False, notes
        notes.append('BCN channel-stage affine is per channel (group_affine=False); num_groups is not '
                     'stored in the weights, assumed %d' % (num_groups or 32))
        return dict(type='BCN', num_groups=num_groups or 32, group_affine=False), False, notes
    if abbr == 'gn':
        g = num_groups or 32
        if num_groups is None:
            notes.append('GroupNorm num_groups is not stored in the weights: assumed 32 (the configs use 32)')
        if 'proxy_beta' in suffixes or 'proxy_gamma' in suffixes:
            return dict(type='GNPN', num_groups=g), True, notes
        return dict(type='GN', num_groups=g, requires_grad=True), False, notes
    if abbr == 'bn':
        if 'running_wm' in suffixes:
            size = max(v.shape[-1] for k, v in sd.items() if k.endswith('running_wm'))
            notes.append('IterNorm T (Newton iterations) is not stored in the weights: the config sets it')
            return dict(type='IterNorm', group_size=int(size)), False, notes
        return dict(type='BN', requires_grad=True), False, notes
    if abbr == 'un':
        return dict(type='Unitization'), False, notes
    raise ConversionError(f'unknown norm attribute name {abbr!r}')


def _ws_choice(conv_cfg: Optional[dict]) -> Optional[str]:
    if not conv_cfg:
        return None
    if conv_cfg.get('type') != 'WSConv2d':
        raise ConversionError(f'unsupported conv_cfg {conv_cfg}: normdense converts plain and WSConv2d convs')
    return conv_cfg.get('formula', 'paper')


# --------------------------------------------------------------------------------------------------
# the three sources
# --------------------------------------------------------------------------------------------------
def convert_mmpretrain(sd, meta, norm=None, ws_formula=None, num_groups=None):
    """mmpretrain classifier -> (backbone state dict, spec, dropped, created, choices, notes)."""
    out, dropped, notes = OrderedDict(), [], []
    for k, v in sd.items():
        if k.startswith('backbone.'):
            out[k[len('backbone.'):]] = v
        else:
            dropped.append((k, _NOT_BACKBONE))
    if not out:
        raise ConversionError('no backbone.* keys: not an mmpretrain classifier checkpoint')
    out, remapped = sequential_stem(out)
    if remapped:
        notes.append("mmpretrain ConvModule deep stem (stem.i.conv / stem.i.<norm>) renamed to the Sequential "
                     "stem of mmdet/mmseg (stem.3i / stem.3i+1)")
    depth, deep_stem, avg_down = infer_layout(out)
    cfg = _backbone_cfg_from_meta(meta)
    if cfg is not None:
        if cfg.get('depth', depth) != depth:
            raise ConversionError(f'config depth {cfg.get("depth")} but the weights are a ResNet-{depth}')
        norm_cfg = copy.deepcopy(cfg.get('norm_cfg') or dict(type='BN', requires_grad=True))
        proxy = str(cfg.get('type', '')).startswith('PNResNet')
        plain = copy.deepcopy(cfg.get('plain_norm_cfg')) if proxy else None
        conv_cfg = copy.deepcopy(cfg.get('conv_cfg'))
        recorded_ws = _ws_choice(conv_cfg)
        if ws_formula is not None and (ws_formula if ws_formula != 'none' else None) != recorded_ws:
            raise ConversionError(f'--ws-formula {ws_formula} contradicts the checkpoint\'s config (conv_cfg='
                                  f'{conv_cfg}): the weights were trained with '
                                  f'{recorded_ws or "plain convs"}')
        source_of_cfg = 'the training config stored in the checkpoint (meta.cfg)'
    else:
        norm_cfg, proxy, more = _norm_cfg_from_keys(out, num_groups)
        notes += more
        plain = None
        if ws_formula is None:
            raise ConversionError('the checkpoint carries no training config (meta.cfg), so whether its convs '
                                  'were weight-standardized is unknown: pass --ws-formula {%s}'
                                  % ','.join(WS_CHOICES))
        conv_cfg = None if ws_formula == 'none' else dict(type='WSConv2d', formula=ws_formula)
        source_of_cfg = 'the checkpoint keys and command-line options (no config in the checkpoint)'
    if norm is not None and NORM_TYPES[norm] != norm_cfg.get('type'):
        raise ConversionError(f'--norm {norm} contradicts the checkpoint, which has {norm_cfg.get("type")} layers')
    if num_groups is not None and 'num_groups' in norm_cfg and norm_cfg['num_groups'] != num_groups:
        raise ConversionError(f'--num-groups {num_groups} contradicts the checkpoint ({norm_cfg["num_groups"]})')
    spec = BackboneSpec(depth=depth, norm_cfg=norm_cfg, conv_cfg=conv_cfg, deep_stem=deep_stem,
                        avg_down=avg_down, proxy_norm=proxy, plain_norm_cfg=plain)
    choices = dict(ws_formula=_ws_choice(conv_cfg), norm=norm_cfg.get('type'), norm_cfg=norm_cfg,
                   conv_cfg=conv_cfg, cfg_from=source_of_cfg)
    if norm_cfg.get('type') == 'BCN':
        choices['bcn_mode_trained'] = norm_cfg.get('mode', 'estimate')
    return out, spec, dropped, [], choices, notes


def convert_authors(sd, meta=None, norm=None, ws_formula=None, num_groups=None):
    """The WS/BCN authors' layout -> (backbone state dict, spec, dropped, created, choices, notes)."""
    sd, had_module = _strip(sd, 'module.')
    notes = ['stripped the DataParallel "module." prefix'] if had_module else []
    dropped, out = [], OrderedDict()
    modules: Dict[str, Dict[str, torch.Tensor]] = OrderedDict()
    for k, v in sd.items():
        split = _norm_split(k)
        if split is not None:
            modules.setdefault(split[0], OrderedDict())[split[1]] = v
        elif _conv_key(k):
            out[k] = v
        elif k.startswith('fc.'):
            dropped.append((k, _CLASSIFIER))
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
    abbr = _norm_abbr(kind)
    groups, modes = set(), set()
    for path, params in modules.items():
        new = _rename_norm(path, abbr)
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
                dropped.append((f'{path}.{inner}.num_batches_tracked', 'BatchNorm step counter (BCN keeps none)'))
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
    return out, spec, dropped, [], choices, notes


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
    sd, had_module = _strip(sd, 'module.')
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
        split = _norm_split(k)
        if split is not None:
            bns.setdefault(split[0], OrderedDict())[split[1]] = v
        elif k.startswith('fc.'):
            dropped.append((k, _CLASSIFIER))
        else:
            out[k] = v
    if ws_formula != 'none':
        for k in [k for k in out if _conv_key(k) and k.endswith('.weight')]:
            bn = bns.get(_norm_after_conv(k))
            if bn is None or 'running_mean' not in bn or 'running_var' not in bn:
                continue  # surfaces as missing keys
            sigma = ws_scale(out[k], ws_formula)
            bn['running_mean'] = (bn['running_mean'].double() / sigma).to(bn['running_mean'].dtype)
            bn['running_var'] = (bn['running_var'].double() / sigma ** 2).to(bn['running_var'].dtype)
    abbr = _norm_abbr(NORM_TYPES[norm])
    for path, params in bns.items():
        new = _rename_norm(path, abbr)
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
            dropped.append((f'{path}.num_batches_tracked', 'BatchNorm step counter (BCN keeps none)'))
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
    return out, spec, dropped, created, choices, notes


_CONVERTERS = dict(mmpretrain=convert_mmpretrain, authors=convert_authors, torchvision=convert_torchvision)


# --------------------------------------------------------------------------------------------------
# target check, conversion entry point, writing
# --------------------------------------------------------------------------------------------------
def build_target_backbone(spec: BackboneSpec, target: str):
    """Build the mmdet or mmseg backbone the converted weights are meant for (random init)."""
    import normdense  # noqa: F401  (registers WSConv2d, BCN, PNResNet, ...)
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


def check_against_target(sd, spec: BackboneSpec, target: str):
    """(missing, unexpected, mismatched) of ``sd`` against the target backbone's own state dict."""
    ref = build_target_backbone(spec, target).state_dict()
    missing = [k for k in ref if k not in sd]
    unexpected = [k for k in sd if k not in ref]
    mismatched = [(k, tuple(sd[k].shape), tuple(ref[k].shape)) for k in sd
                  if k in ref and tuple(sd[k].shape) != tuple(ref[k].shape)]
    return missing, unexpected, mismatched


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
    out, spec, dropped, created, choices, notes = _CONVERTERS[source](sd, meta, **kwargs)
    spec.stem_channels, spec.base_channels = infer_widths(out)
    missing, unexpected, mismatched = check_against_target(out, spec, to)
    if to == 'mmseg' and not spec.deep_stem and not spec.proxy_norm:
        notes.append("plain 7x7 stem: load it with type='ResNet' (deep_stem=False); mmseg's DeepLabV3 configs use "
                     "ResNetV1c, which needs a deep-stem (-v1c) pretraining")
    src_meta = {k: meta[k] for k in ('epoch', 'iter', 'experiment_name', 'time', 'mmengine_version', 'seed',
                                      'checkpoint_epoch', 'checkpoint_best_acc', 'checkpoint_arch')
                if k in meta and isinstance(meta[k], (int, float, str))}
    return Conversion(state_dict=out, spec=spec, target=to, source_format=source, choices=choices,
                      dropped=dropped, missing=missing, unexpected=unexpected, mismatched=mismatched,
                      created=created, notes=notes, source_meta=src_meta)


def _plain(obj):
    """Meta values restricted to what torch.load(weights_only=True) reads (dict/list/str/number/None)."""
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return str(obj)


def conversion_meta(conv: Conversion, source_path: str = '') -> dict:
    from ..version import __version__
    meta = dict(
        normdense_conversion=CONVERSION_VERSION,
        normdense_version=__version__,
        converted_at=datetime.datetime.now().isoformat(timespec='seconds'),
        source=dict(path=source_path, format=conv.source_format, **conv.source_meta),
        target=conv.target,
        backbone=conv.backbone_cfg,
        conv='WSConv2d' if conv.spec.conv_cfg else 'Conv2d',
        ws_formula=conv.choices.get('ws_formula'),
        norm=conv.choices.get('norm'),
        norm_cfg=conv.spec.norm_cfg,
        choices={k: v for k, v in conv.choices.items() if k not in ('norm_cfg', 'conv_cfg')},
        not_mapped=dict(missing=conv.missing, unexpected=conv.unexpected,
                        mismatched=[[k, list(a), list(b)] for k, a, b in conv.mismatched]),
        dropped=[[k, r] for k, r in conv.dropped],
        created=[[k, r] for k, r in conv.created],
        notes=conv.notes,
        partial=not conv.complete,
    )
    return _plain(meta)


def _sha256(path, chunk=1 << 20):
    h = hashlib.sha256()
    with open(path, 'rb') as f:
        for block in iter(lambda: f.read(chunk), b''):
            h.update(block)
    return h.hexdigest()


class PartialConversionError(ConversionError):
    """Writing would leave part of the target backbone at its initialization."""


def save_backbone_checkpoint(conv: Conversion, dst: str, allow_partial: bool = False,
                             source_path: str = '') -> str:
    """Write ``<dir>/<stem>-<sha256[:8]>.pth`` (state_dict + meta, like mmdet's publish tool) and point the
    stable name ``dst`` at it with a relative symlink. Returns the suffixed file's path.

    A partial conversion (:attr:`Conversion.complete` False) is refused unless ``allow_partial``; then only
    the keys that fit the target are written and ``meta['partial']`` is True (load with strict=False).
    """
    if not dst.endswith('.pth'):
        raise ConversionError(f'DST must end with .pth, got {dst}')
    if not conv.complete and not allow_partial:
        raise PartialConversionError(
            'refusing to write a partial backbone (it would leave part of the target at its initialization):\n'
            + conv.report() + '\nPass --allow-partial to write the keys that do map.')
    if osp.lexists(dst) and not osp.islink(dst):
        raise ConversionError(f'{dst} exists and is not a symlink: move it away (DST becomes a symlink to the '
                              'hash-suffixed file)')
    bad = set(conv.unexpected) | {k for k, _, _ in conv.mismatched}
    state_dict = OrderedDict((k, v.detach().clone().contiguous()) for k, v in conv.state_dict.items() if k not in bad)
    folder = osp.dirname(osp.abspath(dst))
    os.makedirs(folder, exist_ok=True)
    stem = osp.basename(dst)[:-len('.pth')]
    tmp = osp.join(folder, f'.{stem}.tmp-{os.getpid()}.pth')
    torch.save(dict(state_dict=state_dict, meta=conversion_meta(conv, source_path)), tmp)
    final = osp.join(folder, f'{stem}-{_sha256(tmp)[:8]}.pth')
    os.replace(tmp, final)
    link_tmp = osp.join(folder, f'.{stem}.link-{os.getpid()}')
    if osp.lexists(link_tmp):
        os.remove(link_tmp)
    os.symlink(osp.basename(final), link_tmp)
    os.replace(link_tmp, osp.join(folder, osp.basename(dst)))
    return final
