"""Reading source checkpoints and writing converted backbone checkpoints (state_dict + meta, hash-suffixed
file behind a stable symlink)."""
import datetime
import hashlib
import os
import os.path as osp
from collections import OrderedDict
from typing import Tuple

import torch

from .spec import Conversion, ConversionError, PartialConversionError

CONVERSION_VERSION = 1


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
