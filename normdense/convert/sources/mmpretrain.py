"""``--from mmpretrain``: an mmengine Runner checkpoint of an mmpretrain ``ImageClassifier`` (the
``configs/imagenet`` pretraining configs): keys ``backbone.*``, ``head.*``; the config that trained it is in
``meta['cfg']`` (conv/norm cfgs, WS formula). mmpretrain's ``ResNetV1c`` builds its deep stem from
ConvModules (``stem.0.conv``, ``stem.0.bn``), mmdet/mmseg from a Sequential (``stem.0``, ``stem.1``,
``stem.3``, ...): remapped."""
import copy
import re
from collections import OrderedDict
from typing import List, Optional, Tuple

from ..resnet_keys import infer_layout, sequential_stem
from ..spec import NORM_TYPES, WS_CHOICES, BackboneSpec, Conversion, ConversionError

_NOT_BACKBONE = 'classifier neck/head/preprocessor, not part of the backbone'


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



def _saved_ws(sd) -> Optional[Tuple[str, float]]:
    """The (formula, eps) the convs saved with their weights (``<conv>._extra_state``), if any."""
    from ...layers.ws import EXTRA_STATE_KEY, decode_ws_state
    found = {}
    for k, v in sd.items():
        if k.rsplit('.', 1)[-1] == EXTRA_STATE_KEY:
            try:
                found.setdefault(decode_ws_state(v), k)
            except ValueError as e:
                raise ConversionError(f'{k}: {e}') from None
    if len(found) > 1:
        raise ConversionError('the convs were trained with different WS formulas/eps ('
                              + ', '.join(f'{f!r} eps={e:g} at {k}' for (f, e), k in found.items())
                              + '): a ResNet backbone cfg has one conv_cfg')
    return next(iter(found), None)


def _follow_saved_ws(conv_cfg: dict, saved, ws_formula) -> Tuple[dict, List[str]]:
    """conv_cfg made to match the formula/eps saved with the weights (they are what was trained: a run that
    loaded weights of another formula switched to it, whatever its config said)."""
    formula, eps = saved
    configured = (conv_cfg.get('formula', 'paper'), conv_cfg.get('eps', 1e-5))
    if (formula, eps) == configured:
        return conv_cfg, []
    if ws_formula is not None and ws_formula != formula:
        raise ConversionError(f'--ws-formula {ws_formula} contradicts the weights, which were trained with WS '
                              f'formula {formula!r} (saved with them)')
    conv_cfg = dict(conv_cfg, formula=formula)
    if eps != 1e-5 or 'eps' in conv_cfg:
        conv_cfg['eps'] = eps
    return conv_cfg, [f'the weights were trained with WS formula {formula!r} (eps={eps:g}, saved with them), not '
                      f'the {configured[0]!r} (eps={configured[1]:g}) of the stored config: converted with theirs']


def convert_mmpretrain(sd, meta, norm=None, ws_formula=None, num_groups=None):
    """An mmpretrain classifier checkpoint (split into state dict and meta) -> its backbone."""
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
    saved_ws = _saved_ws(out)
    cfg = _backbone_cfg_from_meta(meta)
    if cfg is not None:
        if cfg.get('depth', depth) != depth:
            raise ConversionError(f'config depth {cfg.get("depth")} but the weights are a ResNet-{depth}')
        norm_cfg = copy.deepcopy(cfg.get('norm_cfg') or dict(type='BN', requires_grad=True))
        proxy = str(cfg.get('type', '')).startswith('PNResNet')
        plain = copy.deepcopy(cfg.get('plain_norm_cfg')) if proxy else None
        conv_cfg = copy.deepcopy(cfg.get('conv_cfg'))
        recorded_ws = _ws_choice(conv_cfg)
        if recorded_ws is not None and saved_ws is not None:
            recorded_ws = saved_ws[0]  # what the convs computed, saved with the weights
        if ws_formula is not None and (ws_formula if ws_formula != 'none' else None) != recorded_ws:
            raise ConversionError(f'--ws-formula {ws_formula} contradicts the checkpoint\'s config (conv_cfg='
                                  f'{conv_cfg}): the weights were trained with '
                                  f'{recorded_ws or "plain convs"}')
        source_of_cfg = 'the training config stored in the checkpoint (meta.cfg)'
    else:
        norm_cfg, proxy, more = _norm_cfg_from_keys(out, num_groups)
        notes += more
        plain = None
        if ws_formula is None and saved_ws is not None:
            ws_formula = saved_ws[0]  # the convs saved their formula with the weights
        if ws_formula is None:
            raise ConversionError('the checkpoint carries no training config (meta.cfg), so whether its convs '
                                  'were weight-standardized is unknown: pass --ws-formula {%s}'
                                  % ','.join(WS_CHOICES))
        conv_cfg = None if ws_formula == 'none' else dict(type='WSConv2d', formula=ws_formula)
        source_of_cfg = 'the checkpoint keys and command-line options (no config in the checkpoint)'
    if saved_ws is not None and conv_cfg:
        conv_cfg, note = _follow_saved_ws(conv_cfg, saved_ws, ws_formula)
        notes += note
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
    return Conversion(out, spec, 'mmpretrain', choices, dropped=dropped, notes=notes)

