"""What a backbone conversion produces: the target :class:`BackboneSpec` and the :class:`Conversion` record
(converted tensors, choices made, what was dropped, created or left unmapped) with its text report."""
import copy
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from ..layers import declarations
from ..layers.ws import WS_FORMULAS

SOURCES = ('mmpretrain', 'authors', 'torchvision')
TARGETS = ('mmdet', 'mmseg')
# --norm choices -> norm_cfg type: mmcv's BN and GN, then the layers that declare a conversion name
NORM_TYPES = {'bn': 'BN', 'gn': 'GN', **{d.convert: d.name for d in declarations() if d.convert}}
WS_CHOICES = WS_FORMULAS + ('none', )


class ConversionError(ValueError):
    """The source cannot be converted as asked (unknown layout, contradicting options, ...)."""


class PartialConversionError(ConversionError):
    """Writing would leave part of the target backbone at its initialization."""


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
    source_format: str
    choices: dict  # ws formula, norm, bcn mode... (recorded in the output meta)
    target: str = ''  # set with missing/unexpected/mismatched when checked against the target backbone
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

