"""An ``init_cfg`` that loads a converted backbone from ``checkpoints/`` strictly, with a useful error."""
import os.path as osp

from mmengine.logging import print_log
from mmengine.model.weight_init import update_init_info
from mmengine.runner.checkpoint import _load_checkpoint, load_state_dict

from ..layers.ws import WSConv2d


class PretrainedBackbone:
    """``init_cfg=dict(type='PretrainedBackbone', checkpoint='checkpoints/NAME.pth', produced_by='...')``.

    Unlike mmengine's ``Pretrained`` (which only warns), a missing file raises an error naming the file
    and the command that produces it, and missing/unexpected/mismatched keys raise (``strict=True``):
    a converted backbone must cover the whole backbone, or the config trains from a silently partial
    initialization.

    Checkpoints written by ``tools/convert_checkpoint.py`` record in their ``meta`` whether the convs were
    weight-standardized and with which formula (``meta['conv']``, ``meta['ws_formula']``). The weights are
    only meaningful under that formula, so every ``WSConv2d`` of the backbone is switched to it (logged when
    this overrides the config's ``formula``), and loading WS-trained weights into plain convs (or plain
    weights into WS convs) raises. ``check_conv=False`` skips both.

    Args:
        checkpoint: path of the converted backbone (relative paths are taken from the current directory,
            i.e. the repository root when launched with ``tools/train.py``).
        produced_by: the command that writes the file (shown when it is missing).
        prefix: load only the keys under this prefix (e.g. ``'backbone.'`` of a whole-model checkpoint).
        strict: raise on missing or unexpected keys (default).
        check_conv: apply the checkpoint's recorded WS formula and check the conv type (default).
    """

    def __init__(self, checkpoint, produced_by='', prefix=None, strict=True, map_location='cpu',
                 check_conv=True):
        self.checkpoint = checkpoint
        self.produced_by = produced_by
        self.prefix = prefix
        self.strict = strict
        self.map_location = map_location
        self.check_conv = check_conv

    def __call__(self, module):
        if not osp.isfile(self.checkpoint):
            hint = f'\nProduce it with:\n    {self.produced_by}' if self.produced_by else ''
            raise FileNotFoundError(
                f'{type(module).__name__} expects the converted pretrained backbone {self.checkpoint!r} '
                f'(see checkpoints/README.md), which does not exist.{hint}\nTo train from scratch instead, '
                f'pass --cfg-options model.backbone.init_cfg=None')
        print_log(f'load backbone from {self.checkpoint} (strict={self.strict})', logger='current')
        ckpt = _load_checkpoint(self.checkpoint, self.map_location)
        state_dict = ckpt.get('state_dict', ckpt) if isinstance(ckpt, dict) else ckpt
        meta = ckpt.get('meta') if isinstance(ckpt, dict) and isinstance(ckpt.get('meta'), dict) else {}
        if self.prefix:
            n = len(self.prefix)
            state_dict = {k[n:]: v for k, v in state_dict.items() if k.startswith(self.prefix)}
            if not state_dict:
                raise ValueError(f'{self.checkpoint} has no keys under the prefix {self.prefix!r}')
        if self.check_conv:
            apply_conv_meta(module, meta, self.checkpoint)
        load_state_dict(module, state_dict, strict=self.strict, logger='current')
        if hasattr(module, '_params_init_info'):
            update_init_info(module, init_info=f'{type(self).__name__}: load from {self.checkpoint}')


def apply_conv_meta(module, meta: dict, name: str = 'the checkpoint') -> None:
    """Make ``module``'s convs match the conv type/WS formula recorded in a converted checkpoint's meta.

    Does nothing when the meta records no conv type (checkpoints not written by convert_checkpoint.py).
    """
    conv = meta.get('conv')
    if conv not in ('WSConv2d', 'Conv2d'):
        return
    ws_convs = [m for m in module.modules() if isinstance(m, WSConv2d)]
    if conv == 'Conv2d':
        if ws_convs:
            raise ValueError(
                f'{name} holds weights of plain convs but the backbone has {len(ws_convs)} WSConv2d layers, which '
                'would standardize them (a different function). Use conv_cfg=None, convert the source with '
                '--ws-formula, or pass init_cfg check_conv=False to load anyway.')
        return
    formula = meta.get('ws_formula') or 'paper'
    if not ws_convs:
        raise ValueError(
            f'{name} was trained with weight-standardized convs (formula {formula!r}) but the backbone has no '
            f"WSConv2d: set conv_cfg=dict(type='WSConv2d', formula={formula!r}) (or init_cfg check_conv=False).")
    changed = sorted({m.formula for m in ws_convs if m.formula != formula})
    for m in ws_convs:
        m.formula = formula
    if changed:
        print_log(f'{name} was trained with WS formula {formula!r}: the backbone\'s WSConv2d layers use it '
                  f'instead of the configured {changed}', logger='current', level=30)
