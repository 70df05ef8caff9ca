"""An ``init_cfg`` that loads a pretrained backbone strictly, from anywhere mmengine loads checkpoints."""
import os.path as osp
import re

from mmengine.logging import print_log
from mmengine.model.weight_init import update_init_info
from mmengine.runner.checkpoint import load_state_dict

from ..checkpoint import check_load, is_local_path, read_checkpoint
from ..layers.ws import EXTRA_STATE_KEY, WSConv2d, decode_ws_state


def missing_backbone_message(checkpoint, produced_by='', owner='backbone'):
    """One line: which file is missing, how to get it, how to do without it."""
    how = f' Get it: {produced_by}.' if produced_by else ''
    return (f'{owner}: pretrained backbone {checkpoint} not found.{how} (checkpoints/README.md; to train from '
            'scratch: --cfg-options model.backbone.init_cfg=None)')


def missing_pretrained_backbones(model_cfg):
    """The one-line messages of every ``PretrainedBackbone`` init_cfg in ``model_cfg`` whose local file is
    missing (checked before a runner is built; URLs are left to the loader)."""
    found = []

    def walk(node, owner):
        if isinstance(node, dict):
            init = node.get('init_cfg')
            for cfg in init if isinstance(init, (list, tuple)) else [init]:
                if isinstance(cfg, dict) and cfg.get('type') == 'PretrainedBackbone':
                    ckpt = cfg.get('checkpoint')
                    if isinstance(ckpt, str) and is_local_path(ckpt) and not osp.isfile(osp.expanduser(ckpt)):
                        found.append(missing_backbone_message(ckpt, cfg.get('produced_by', ''),
                                                              node.get('type', owner)))
            for key, value in node.items():
                if key != 'init_cfg':
                    walk(value, key)
        elif isinstance(node, (list, tuple)):
            for value in node:
                walk(value, owner)

    walk(model_cfg, 'model')
    return found


class PretrainedBackbone:
    """``init_cfg=dict(type='PretrainedBackbone', checkpoint='checkpoints/NAME.pth', produced_by='...')``.

    Unlike mmengine's ``Pretrained`` (which only warns), missing/unexpected/mismatched keys raise
    (``strict=True``): a pretrained backbone must cover the whole backbone, or the config trains from a
    silently partial initialization. A missing local file raises a one-line error naming the command that
    produces it. The checkpoint may be anything mmengine's ``CheckpointLoader`` takes (local path,
    ``https://``, ``open-mmlab://``, ``torchvision://``; downloads are cached under ``$TORCH_HOME``), and
    is read weights-only (:func:`normdense.checkpoint.read_checkpoint`).

    The weights are only meaningful under the WS formula they were trained with. Checkpoints written by
    ``tools/convert_checkpoint.py`` record it twice: per conv in the weights (``<conv>._extra_state``, which
    ``WSConv2d`` applies on every load, this one included, see :mod:`normdense.layers.ws`) and in their
    ``meta`` (``meta['conv']``, ``meta['ws_formula']``; files converted before the weights carried it have
    only this). Every ``WSConv2d`` of the backbone is switched to the recorded formula (one log line when
    this overrides the config's ``formula``); it is then saved with the model's own checkpoints, so
    ``tools/test.py``, ``load_from``, ``--resume`` and ``tools/deploy.py`` keep it. Loading WS-trained
    weights into plain convs (or plain weights into WS convs) raises. ``check_conv=False`` skips the meta
    and the conv-type check and leaves out saved formulas that have no WSConv2d to go to. Checkpoints
    without either record (e.g. published ones) load under the config's ``formula``, which must then be the
    one they were trained with.

    Args:
        checkpoint: path or URL of the backbone weights (relative paths are taken from the current
            directory, i.e. the repository root when launched with ``tools/train.py``).
        produced_by: how to obtain the file (shown when a local file is missing).
        prefix: load only the keys under this prefix (e.g. ``'backbone.'`` of a whole-model checkpoint).
            As mmengine's ``Pretrained``, a leading ``module.`` (DataParallel) is stripped first.
        strict: raise on missing or unexpected keys (default).
        check_conv: apply the checkpoint's recorded WS formula and check the conv type (default).
        drop_prefixes: checkpoint keys to leave out, logged (e.g. ``('fc.',)``: an ImageNet classifier's
            head, which a backbone does not have).
    """

    def __init__(self, checkpoint, produced_by='', prefix=None, strict=True, map_location='cpu',
                 check_conv=True, drop_prefixes=()):
        self.checkpoint = checkpoint
        self.produced_by = produced_by
        self.prefix = prefix
        self.strict = strict
        self.map_location = map_location
        self.check_conv = check_conv
        self.drop_prefixes = tuple(drop_prefixes)

    def __call__(self, module):
        print_log(f'load backbone from {self.checkpoint} (strict={self.strict})', logger='current')
        try:
            ckpt = read_checkpoint(self.checkpoint, self.map_location)
        except FileNotFoundError:
            if not is_local_path(self.checkpoint):
                raise
            raise FileNotFoundError(missing_backbone_message(self.checkpoint, self.produced_by,
                                                             type(module).__name__)) from None
        state_dict = ckpt.get('state_dict', ckpt) if isinstance(ckpt, dict) else ckpt
        meta = ckpt.get('meta') if isinstance(ckpt, dict) and isinstance(ckpt.get('meta'), dict) else {}
        state_dict = {re.sub(r'^module\.', '', k): v for k, v in state_dict.items()}
        if self.prefix:
            n = len(self.prefix)
            state_dict = {k[n:]: v for k, v in state_dict.items() if k.startswith(self.prefix)}
            if not state_dict:
                raise ValueError(f'{self.checkpoint} has no keys under the prefix {self.prefix!r}')
        dropped = [k for k in state_dict if k.startswith(self.drop_prefixes)] if self.drop_prefixes else []
        if dropped:
            state_dict = {k: v for k, v in state_dict.items() if k not in set(dropped)}
            print_log(f'{self.checkpoint}: left out {len(dropped)} keys under {self.drop_prefixes} '
                      f'({", ".join(dropped)})', logger='current')
        if self.check_conv:
            apply_conv_meta(module, meta, self.checkpoint)
            check_saved_ws(module, state_dict, self.checkpoint)
        else:
            state_dict = drop_saved_ws(module, state_dict, self.checkpoint)
        check_load(module, state_dict, self.checkpoint, allow_partial=not self.strict,
                   hint="set the init_cfg's strict=False")
        load_state_dict(module, state_dict, strict=False, logger='current')
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


def _saved_ws_keys(module, state_dict):
    """(keys of saved WS formulas whose module is a WSConv2d, those whose module is not)."""
    modules = dict(module.named_modules())
    fits, strays = [], []
    for k in state_dict:
        path, _, last = k.rpartition('.')
        if last == EXTRA_STATE_KEY and path in modules:
            (fits if isinstance(modules[path], WSConv2d) else strays).append(k)
    return fits, strays


def check_saved_ws(module, state_dict, name='the checkpoint') -> None:
    """Raise when ``state_dict`` holds WS-trained convs (a saved formula) where ``module`` has plain ones."""
    _, strays = _saved_ws_keys(module, state_dict)
    if strays:
        try:
            formula = repr(decode_ws_state(state_dict[strays[0]])[0])
        except ValueError:
            formula = 'unknown'
        raise ValueError(
            f'{name} holds weights of weight-standardized convs (formula {formula}, saved in '
            f'{strays[0]} and {len(strays) - 1} more) but the backbone has plain convs there: set '
            f"conv_cfg=dict(type='WSConv2d', formula={formula}) (or init_cfg check_conv=False to load anyway).")


def drop_saved_ws(module, state_dict, name='the checkpoint'):
    """``state_dict`` without the saved WS formulas that have no WSConv2d to go to (``check_conv=False``
    loads WS-trained weights into plain convs on request), logged."""
    _, strays = _saved_ws_keys(module, state_dict)
    if not strays:
        return state_dict
    print_log(f'{name}: check_conv=False: left out the WS formula saved for {len(strays)} convs that are plain '
              f'in this backbone ({strays[0]}, ...)', logger='current', level=30)
    strays = set(strays)
    return {k: v for k, v in state_dict.items() if k not in strays}
