"""Key structure of torchvision-style and mmdet/mmseg ResNets: where the norms and convs are, depth and
widths from the keys, the deep-stem renaming and the attribute name mmcv gives a norm."""
import re
from collections import OrderedDict
from typing import Tuple

import torch

from .spec import ConversionError

ARCH_DEPTHS = {('BasicBlock', (2, 2, 2, 2)): 18, ('BasicBlock', (3, 4, 6, 3)): 34,
               ('Bottleneck', (3, 4, 6, 3)): 50, ('Bottleneck', (3, 4, 23, 3)): 101,
               ('Bottleneck', (3, 8, 36, 3)): 152}
CLASSIFIER = 'classifier (fc), not part of the backbone'


def strip_prefix(sd, prefix):
    """``sd`` without ``prefix`` (e.g. DataParallel's ``module.``) when every key has it; (sd, stripped)."""
    if sd and all(k.startswith(prefix) for k in sd):
        return OrderedDict((k[len(prefix):], v) for k, v in sd.items()), True
    return sd, False


def split_at_norm(key: str, abbrs=('bn', )):
    """Split ``key`` at a norm module of a torchvision-style/mmdet ResNet: returns (module path, rest) with
    the module being ``{abbr}N`` (stem or block norm) or ``downsample.1``; None for other keys."""
    parts = key.split('.')
    pattern = re.compile(r'(%s)\d+$' % '|'.join(map(re.escape, abbrs)))
    for i, p in enumerate(parts[:-1]):
        if pattern.fullmatch(p) or (p == '1' and i > 0 and parts[i - 1] == 'downsample'):
            return '.'.join(parts[:i + 1]), '.'.join(parts[i + 1:])
    return None


def is_conv_key(key: str) -> bool:
    return re.fullmatch(r'(layer\d+\.\d+\.)?(conv\d+|downsample\.0)\.(weight|bias)', key) is not None


def rename_norm(path: str, abbr: str) -> str:
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


def norm_abbr(norm_type: str) -> str:
    """The attribute name mmcv's build_norm_layer gives a norm (from the class's ``_abbr_``)."""
    from mmcv.cnn.bricks.norm import infer_abbr
    from mmengine.registry import MODELS
    with MODELS.switch_scope_and_registry(None) as registry:
        cls = registry.get(norm_type)
    if cls is None:
        raise ConversionError(f'unknown norm type {norm_type!r}')
    return infer_abbr(cls)

