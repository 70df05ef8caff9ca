"""Convert a built model's norm layers and convs to normdense's, and back, in the style of
``nn.SyncBatchNorm.convert_sync_batchnorm``: for what configs cannot reach (modules that hard-code
``nn.BatchNorm2d`` or ``nn.Conv2d``).

``convert_model(model, norm='BCN', conv='WSConv2d')`` swaps

* every ``BatchNorm2d`` / ``SyncBatchNorm`` and plain ``nn.GroupNorm`` for the norm built from ``norm`` (a
  registry type name or a config dict, built with mmcv's ``build_norm_layer`` as a config would), and
* every plain ``nn.Conv2d`` that feeds a norm layer (the next module in registration order is a norm
  over its output channels: ResNet's ``conv1``/``bn1``, ``ConvModule``'s ``conv``/``norm``,
  ``Sequential(conv, bn, relu)``) for the conv built from ``conv``; convs feeding no norm (predictors,
  the RPN head) stay plain, as in the WS/BCN paper,

and returns the model (a new object only when ``model`` itself is a converted layer). ``include`` /
``exclude`` restrict it by qualified module name (glob patterns, a name matches its own pattern and
those of its parents: ``'backbone'`` covers ``backbone.layer1.0.bn1``) or a ``callable(name, module)``.

What carries over, where it keeps the function:

* BN -> BCN: BN's running statistics and affine become the batch stage's estimates (or running
  statistics) and gamma^b/beta^b: BCN's first stage in eval *is* the eval BN; the channel stage starts
  at identity affine (a GN on top).
* BN -> Unitization: statistics and affine; alpha starts at 0, so the eval layer equals the eval BN.
* BN -> IterNorm: running mean, and a diagonal running whitening matrix diag(1/sqrt(var + eps)), so the
  eval layer equals the eval BN; affine copied.
* BN -> GN: the affine only (GN has no statistics to carry).
* GN -> BCN: the channel stage gets GN's affine (per group, or ``group_affine=False``), the batch stage
  starts as identity (the function is GN's up to eps). GN -> other norms: the affine.
* Conv2d -> WSConv2d: the raw weights (the effective kernel becomes their standardization).

``revert_model(model)`` undoes it: each layer made here goes back to the class and arguments it was
made from (statistics and affine back where they fit: BCN's batch stage into BN, Unitization/IterNorm
statistics into BN), every ``WSConv2d`` becomes an ``nn.Conv2d`` holding its *standardized* weight (the
same function, so a WS-trained model deploys as plain convs), and a BCN not made here becomes a
``BatchNorm2d`` of its batch stage (its channel stage is dropped: said in the summary).

Both return the model and leave a :class:`ConversionReport` on it as ``model.normdense_conversion``
(printed by default): each converted layer, and each norm or conv left as it was with the reason.
"""
import fnmatch
import logging
from typing import Callable, List, Optional, Sequence, Union

import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm

from .layers._convert import copy_norm_into_bcn
from .layers.bcn import BatchChannelNorm2d
from .layers.groups import GroupNorm
from .layers.iternorm import IterNorm
from .layers.proxy_norm import GroupProxyNorm
from .layers.unitization import Unitization2d
from .layers.ws import WSConv2d

SOURCE_KEY = '_normdense_source'  # on a converted layer: (class, constructor kwargs) it was made from
Pattern = Union[None, str, Sequence[str], Callable[[str, nn.Module], bool]]


class ConversionReport:
    """Rows ``(name, from, to, note)``; ``to`` is None for a layer left as it was (``note`` says why)."""

    def __init__(self, title: str = 'normdense.convert_model', verb: str = 'converted'):
        self.title, self.verb = title, verb
        self.rows: List[tuple] = []

    def add(self, name, source, target=None, note=''):
        self.rows.append((name or '(model)', source, target, note))

    @property
    def converted(self):
        return [r for r in self.rows if r[2] is not None]

    @property
    def left(self):
        return [r for r in self.rows if r[2] is None]

    def counts(self):
        """{(from, to): number} of converted layers."""
        out = {}
        for _, s, t, _ in self.converted:
            out[(s, t)] = out.get((s, t), 0) + 1
        return out

    def table(self) -> str:
        lines = [f'{self.title}: {len(self.converted)} layers {self.verb}, {len(self.left)} left as they were']
        for (s, t), n in sorted(self.counts().items()):
            lines.append(f'  {self.verb:<9s}  {n:4d} x {s} -> {t}')
        notes = sorted({(r[1], r[3]) for r in self.converted if r[3]})
        lines += [f'             note: {s}: {note}' for s, note in notes]
        for name, s, _, note in self.left:
            lines.append(f'  left       {name} ({s}): {note}')
        return '\n'.join(lines)

    def __str__(self):
        return self.table()


def _layers_only() -> bool:
    from .compat import LAYERS_ONLY
    return LAYERS_ONLY


# NORMDENSE_LAYERS_ONLY=1 (a torch-only machine, no mmengine/mmcv): the types resolve here, not through MODELS
_LOCAL_TYPES = {'BCN': BatchChannelNorm2d, 'GN': nn.GroupNorm, 'GNAuto': GroupNorm, 'IterNorm': IterNorm,
                'Unitization': Unitization2d, 'BN': nn.BatchNorm2d, 'SyncBN': nn.SyncBatchNorm,
                'GNPN': GroupProxyNorm, 'WSConv2d': WSConv2d, 'Conv2d': nn.Conv2d}


def _registered(name):
    if _layers_only():
        return _LOCAL_TYPES.get(name)
    from mmengine.registry import MODELS
    return MODELS.get(name)


def _log(text):
    if _layers_only():
        logging.getLogger('normdense').info(text)
        return
    from mmengine.logging import print_log
    print_log(text, logger='current', level=logging.INFO)


def _matcher(pattern: Pattern, default: bool):
    if pattern is None:
        return lambda name, module: default
    if callable(pattern):
        return pattern
    patterns = [pattern] if isinstance(pattern, str) else list(pattern)

    def match(name, module):
        parts = name.split('.')
        prefixes = ['.'.join(parts[:i]) for i in range(1, len(parts) + 1)]
        return any(fnmatch.fnmatchcase(p, pat) for p in prefixes for pat in patterns)
    return match


def _is_norm(m) -> bool:
    return isinstance(m, (_BatchNorm, nn.GroupNorm, IterNorm, Unitization2d, nn.LayerNorm))


def _channels(m):
    return getattr(m, 'num_features', None) or getattr(m, 'num_channels', None)


def _norm_cfg(norm):
    cfg = dict(type=norm) if isinstance(norm, str) else dict(norm)
    if 'type' not in cfg:
        raise ValueError(f'norm={norm!r} has no type; e.g. norm=\'BCN\' or dict(type=\'BCN\', mode=\'estimate\')')
    if cfg['type'] in ('GNPN', GroupProxyNorm):
        raise ValueError("norm='GNPN' contains the activation that follows it and cannot replace a layer in place; "
                         "use the norm switch's gn-pn (PNResNet backbone): normdense.switch_norm(cfg, 'gn-pn')")
    if isinstance(cfg['type'], str) and _registered(cfg['type']) is None and cfg['type'] not in ('BN', 'GN', 'SyncBN'):
        raise ValueError(f"unknown norm type {cfg['type']!r}; choose one of "
                         "'BCN', 'GN', 'IterNorm', 'Unitization', 'BN', 'SyncBN' (or a registered norm)")
    if cfg['type'] == 'GN':
        cfg.setdefault('num_groups', 32)
    return cfg


def _conv_cfg(conv):
    cfg = dict(type=conv) if isinstance(conv, str) else dict(conv)
    if isinstance(cfg.get('type'), str) and _registered(cfg['type']) is None and cfg['type'] != 'Conv2d':
        raise ValueError(f"unknown conv type {cfg['type']!r}; choose 'WSConv2d' (or a registered conv)")
    return cfg


def _already(m, cfg) -> bool:
    cls = _registered(cfg['type']) if isinstance(cfg['type'], str) else cfg['type']
    return isinstance(cls, type) and isinstance(m, cls)


def _build_layer(cfg, *args, **kwargs):
    """mmcv's builders' construction without mmcv: ``cls(*args, **cfg, **kwargs)`` (GN takes num_channels)."""
    cfg = dict(cfg)
    kind, requires_grad = cfg.pop('type'), cfg.pop('requires_grad', True)
    cls = _registered(kind) if isinstance(kind, str) else kind
    layer = cls(num_channels=args[0], **cfg) if cls is nn.GroupNorm else cls(*args, **cfg, **kwargs)
    for p in layer.parameters():
        p.requires_grad = requires_grad
    return layer


def _build_norm(cfg, source):
    cfg = dict(cfg)
    cfg.setdefault('eps', source.eps)
    if _layers_only():
        layer = _build_layer(cfg, _channels(source))
    else:
        from mmcv.cnn import build_norm_layer
        layer = build_norm_layer(cfg, _channels(source))[1]
    ref = next(iter(list(source.parameters()) + list(source.buffers())), None)
    if ref is not None:
        layer = layer.to(device=ref.device, dtype=ref.dtype if ref.is_floating_point() else None)
    return layer


def _copy(dst, src):
    if dst is not None and src is not None:
        with torch.no_grad():
            dst.copy_(src.to(dst.dtype))


def _transfer(new, old):
    """Statistics and affine from ``old`` (BN or GN) into ``new``; returns a note when the function changes."""
    bn = isinstance(old, _BatchNorm)
    stats = bn and old.track_running_stats and old.running_mean is not None
    affine = getattr(old, 'affine', False)
    if isinstance(new, BatchChannelNorm2d):
        if bn:
            copy_norm_into_bcn(new, old)
            return 'BN statistics and affine into the batch stage; channel stage added (identity affine)'
        if affine:
            if new.group_affine and new.num_groups != old.num_groups:
                return 'GN affine not carried (groups differ)'
            try:
                copy_norm_into_bcn(new, old)
            except ValueError:
                return 'GN affine varies within groups: not carried (use group_affine=False to keep it)'
        return 'GN affine into the channel stage; batch stage added (identity until trained)'
    if isinstance(new, Unitization2d) and bn:
        if stats:
            _copy(new.running_mean, old.running_mean), _copy(new.running_var, old.running_var)
        if affine and new.affine:
            _copy(new.weight, old.weight), _copy(new.bias, old.bias)
        return 'BN statistics and affine carried; alpha = 0: the eval layer is the eval BN'
    if isinstance(new, IterNorm) and bn:
        if stats:
            _copy(new.running_mean, old.running_mean)
            with torch.no_grad():
                inv = torch.rsqrt(old.running_var.double() + old.eps)
                new.running_wm.zero_()
                start = 0
                for i, size in enumerate(new.group_sizes):
                    new.running_wm[i, :size, :size] = torch.diag(inv[start:start + size]).to(new.running_wm.dtype)
                    start += size
        if affine and getattr(new, 'weight', None) is not None:
            _copy(new.weight, old.weight), _copy(new.bias, old.bias)
        return 'BN statistics as a diagonal whitening matrix, affine carried: the eval layer is the eval BN'
    if affine and getattr(new, 'weight', None) is not None and new.weight.shape == old.weight.shape:
        _copy(new.weight, old.weight), _copy(new.bias, old.bias)
        return 'affine carried' + ('' if isinstance(new, type(old)) else '; statistics not carried')
    return 'nothing carried'


def _source_kwargs(old):
    if isinstance(old, _BatchNorm):
        return dict(num_features=old.num_features, eps=old.eps, momentum=old.momentum, affine=old.affine,
                    track_running_stats=old.track_running_stats)
    return dict(num_groups=old.num_groups, num_channels=old.num_channels, eps=old.eps, affine=old.affine)


def _set(model, name, new):
    if not name:
        return new
    parent_name, _, attr = name.rpartition('.')
    setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)
    return model


def _ws_from_conv(cfg, conv):
    if _layers_only():
        build_conv_layer = _build_layer
    else:
        from mmcv.cnn import build_conv_layer
    new = build_conv_layer(cfg, conv.in_channels, conv.out_channels, conv.kernel_size, stride=conv.stride,
                           padding=conv.padding, dilation=conv.dilation, groups=conv.groups,
                           bias=conv.bias is not None, padding_mode=conv.padding_mode)
    new = new.to(device=conv.weight.device, dtype=conv.weight.dtype)
    _copy(new.weight, conv.weight)
    if conv.bias is not None:
        _copy(new.bias, conv.bias)
    return new


def convert_model(model: nn.Module, norm=None, conv=None, include: Pattern = None, exclude: Pattern = None,
                  verbose: bool = True, dry_run: bool = False) -> nn.Module:
    """Swap BN / SyncBN / GN for ``norm`` and the convs feeding a norm for ``conv``; see the module docstring.

    Args:
        norm: a registry type name (``'BCN'``, ``'GN'``, ``'IterNorm'``, ``'Unitization'``) or a config dict
            (``dict(type='BCN', mode='estimate')``); ``None`` leaves the norms.
        conv: ``'WSConv2d'`` or a config dict (``dict(type='WSConv2d', formula='var_unbiased')``); ``None``
            leaves the convs.
        include / exclude: which modules, by qualified name (glob patterns) or ``callable(name, module)``.
        verbose: print the summary (it is also left on the returned model as ``normdense_conversion``).
        dry_run: change nothing; the summary lists what would be converted as left.
    """
    if norm is None and conv is None:
        raise ValueError("convert_model needs norm= and/or conv=, e.g. norm='BCN', conv='WSConv2d'")
    norm_cfg = _norm_cfg(norm) if norm is not None else None
    conv_cfg = _conv_cfg(conv) if conv is not None else None
    included, excluded = _matcher(include, True), _matcher(exclude, False)
    report = ConversionReport()
    leaves = [(n, m) for n, m in model.named_modules() if not list(m.children())]
    targets = []
    for i, (name, m) in enumerate(leaves):
        kind = type(m).__name__
        is_norm, is_conv = _is_norm(m), isinstance(m, nn.Conv2d)
        if not ((is_norm and norm_cfg is not None) or (is_conv and conv_cfg is not None)):
            continue
        if is_norm and norm_cfg is not None and _already(m, norm_cfg):
            continue
        if not included(name, m):
            report.add(name, kind, note='not included')
        elif excluded(name, m):
            report.add(name, kind, note='excluded')
        elif is_norm and (isinstance(m, (nn.BatchNorm2d, nn.SyncBatchNorm)) or type(m) in (nn.GroupNorm, GroupNorm)):
            targets.append((name, m, 'norm'))
        elif type(m) is nn.Conv2d:
            nxt = leaves[i + 1][1] if i + 1 < len(leaves) else None
            if nxt is not None and _is_norm(nxt) and _channels(nxt) == m.out_channels:
                targets.append((name, m, 'conv'))
            else:
                report.add(name, kind, note='feeds no norm layer (a predictor or plain conv): kept plain')
        elif not _already(m, norm_cfg if is_norm else conv_cfg):
            report.add(name, kind, note='not a type the converter replaces (BatchNorm2d, SyncBatchNorm, GroupNorm; '
                                        'Conv2d feeding a norm)')
    for name, m, what in targets:
        if dry_run:
            wanted = (norm_cfg if what == 'norm' else conv_cfg)['type']
            report.add(name, type(m).__name__, note=f'hard-coded, not converted to {wanted} (convert=True, or '
                                                    'normdense.convert_model, converts it)')
            continue
        if what == 'norm':
            new = _build_norm(norm_cfg, m)
            note = _transfer(new, m)
            setattr(new, SOURCE_KEY, (type(m), _source_kwargs(m)))
        else:
            new = _ws_from_conv(conv_cfg, m)
            note = 'raw weights carried (the effective kernel is their standardization)'
            setattr(new, SOURCE_KEY, (nn.Conv2d, None))
        new.train(m.training)
        model = _set(model, name, new)
        report.add(name, type(m).__name__, type(new).__name__, note)
    model.normdense_conversion = report
    if verbose:
        _log(report.table())
    return model


def _revert_norm(new, source_cls, kwargs):
    old = source_cls(**kwargs) if kwargs else nn.BatchNorm2d(new.num_features if hasattr(new, 'num_features')
                                                              else new.num_channels, eps=new.eps)
    ref = next(t for t in list(new.parameters()) + list(new.buffers()) if t.is_floating_point())
    old = old.to(device=ref.device, dtype=ref.dtype)
    bn = isinstance(old, _BatchNorm)
    note = ''
    if isinstance(new, BatchChannelNorm2d):
        if bn:
            if old.track_running_stats:
                _copy(old.running_mean, new.running_mean), _copy(old.running_var, new.running_var)
            if old.affine:
                _copy(old.weight, new.batch_weight), _copy(old.bias, new.batch_bias)
            untrained = all(torch.all(t == v) for t, v in ((new.weight, 1), (new.bias, 0)))
            dropped = '; the trained channel stage is dropped (function changes)'
            note = 'batch stage kept' + ('' if untrained else dropped)
        elif old.affine:
            per = new.num_channels // new.num_groups if new.group_affine else 1
            _copy(old.weight, new.weight.detach().repeat_interleave(per))
            _copy(old.bias, new.bias.detach().repeat_interleave(per))
            note = 'channel-stage affine kept; the batch stage is dropped'
    elif isinstance(new, (Unitization2d, IterNorm)) and bn:
        if old.track_running_stats:
            _copy(old.running_mean, new.running_mean)
            if isinstance(new, Unitization2d):
                _copy(old.running_var, new.running_var)
            else:  # the diagonal of the whitening matrix as 1/sqrt(var + eps)
                diag = torch.cat([new.running_wm[i, :s, :s].diagonal() for i, s in enumerate(new.group_sizes)])
                _copy(old.running_var, diag.double().pow(-2) - old.eps)
        if old.affine and getattr(new, 'weight', None) is not None:
            _copy(old.weight, new.weight), _copy(old.bias, new.bias)
        note = 'statistics and affine kept'
    elif getattr(old, 'affine', False) and getattr(new, 'weight', None) is not None \
            and new.weight.shape == old.weight.shape:
        _copy(old.weight, new.weight), _copy(old.bias, new.bias)
        note = 'affine kept'
    return old, note


def revert_model(model: nn.Module, verbose: bool = True) -> nn.Module:
    """Undo :func:`convert_model` (and turn every ``WSConv2d`` into an ``nn.Conv2d`` with its standardized
    weight, every BCN not made here into its batch stage's ``BatchNorm2d``); see the module docstring."""
    report = ConversionReport('normdense.revert_model', 'reverted')
    for name, m in list(model.named_modules()):
        source = getattr(m, SOURCE_KEY, None)
        if isinstance(m, WSConv2d):
            new = nn.Conv2d(m.in_channels, m.out_channels, m.kernel_size, stride=m.stride, padding=m.padding,
                            dilation=m.dilation, groups=m.groups, bias=m.bias is not None,
                            padding_mode=m.padding_mode, device=m.weight.device, dtype=m.weight.dtype)
            _copy(new.weight, m.standardized_weight().detach())
            if m.bias is not None:
                _copy(new.bias, m.bias)
            note = 'standardized weights (same function)'
        elif source is not None:
            new, note = _revert_norm(m, *source)
        elif isinstance(m, BatchChannelNorm2d):
            new, note = _revert_norm(m, nn.BatchNorm2d, None)
        else:
            if _is_norm(m) and type(m).__module__.startswith('normdense'):
                report.add(name, type(m).__name__, note='not made by convert_model: no layer to revert to')
            continue
        new.train(m.training)
        model = _set(model, name, new)
        report.add(name, type(m).__name__, type(new).__name__, note)
    model.normdense_conversion = report
    if verbose:
        _log(report.table())
    return model


def model_census(model: nn.Module) -> dict:
    """{layer type name: count} of the norm layers and convs in ``model`` (what a switch changed)."""
    out = {}
    for m in model.modules():
        if _is_norm(m) or isinstance(m, (nn.Conv2d, GroupProxyNorm)):
            out[type(m).__name__] = out.get(type(m).__name__, 0) + 1
    return out
