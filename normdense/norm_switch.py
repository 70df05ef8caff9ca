"""The norm switch: one name (``'bcn-ws'``, ``'gn-ws'``, ...) puts a normalization into every ``norm_cfg`` /
``conv_cfg`` slot of any mmdet / mmseg / mmpretrain config's model, and adds what that norm needs.

Four ways in, one implementation (:func:`switch_norm`):

* ``tools/train.py ANY_CONFIG --norm bcn-ws`` (and ``tools/test.py``);
* in a config, for the codebases' own ``train.py`` / ``test.py`` and ``mim train``::

      _base_ = ['mmdet::retinanet/retinanet_r50_fpn_1x_coco.py']
      custom_imports = dict(imports=['normdense'], allow_failed_imports=False)
      runner_type = 'NormSwitchRunner'  # the two lines of configs/_base_/norm_switch.py
      normdense_norm = 'bcn-ws'         # or dict(norm='bcn-ws', num_groups=16, exclude=[...], convert=True)

* the model-type form, for code that builds ``cfg.model`` without honouring ``runner_type`` (mmseg 1.2.2's
  ``tools/test.py``, ``init_detector``): ``model = dict(_delete_=True, type='NormSwitched', norm='bcn-ws',
  model={{_base_.model}})`` (:func:`build_norm_switched`; hooks are then the config's to add);
* from Python: ``switch_norm(cfg, 'bcn-ws')`` on a loaded ``Config``.

Why a runner type first: a text config cannot call a function after its ``_base_`` inheritance, and the
switch must change more than the model (``custom_hooks``: ``EstimateRateHook``; the optimizer's
``paramwise_cfg`` for GN+PN) and must reach the *built* model before the optimizer exists (modules that
hard-code their layers). mmdet's and mmpretrain's ``train.py`` / ``test.py`` and mmseg's ``train.py`` build
``cfg.runner_type`` through mmengine's ``RUNNERS`` when it is set, and a runner sees the whole config and
builds the model; a registered model type sees only the model dict and cannot add the hook.

What is switched: every module dict in ``cfg.model`` whose class takes ``norm_cfg`` (backbone, neck,
heads, their sub-heads) gets the norm, and its ``conv_cfg`` the conv (``WSConv2d`` for ``*-ws``, plain for
the others); ``norm_eval`` becomes False (mmdet's ResNet freezes BN-type layers otherwise). A head with no
``norm_cfg`` argument (mmdet's RPN head, Shared2FC box heads' FCs) and the predictors inside heads stay
plain, as in the WS/BCN paper; such a component is listed as left. ``exclude`` names slots to leave
(``'roi_head.mask_head'``, globs allowed). After the model is built, layers the config could not reach
(hard-coded ``nn.BatchNorm2d``, ...) are listed, and converted with ``convert=True``
(``normdense.convert_model``) before the optimizer is built.
"""
import copy
import fnmatch
import inspect
import logging
import re
from collections import Counter
from typing import List, Optional

from .layers.groups import AUTO, AUTO_RULE, _is_int
from .norms import CHOICES, SWITCHES

_WS = dict(type='WSConv2d')
_PN_BACKBONES = {'ResNet': 'PNResNet', 'ResNetV1c': 'PNResNetV1c', 'mmdet.ResNet': 'PNResNet',
                 'mmseg.ResNet': 'PNResNet', 'mmseg.ResNetV1c': 'PNResNetV1c', 'PNResNet': 'PNResNet',
                 'PNResNetV1c': 'PNResNetV1c'}
_RATE_HOOKS = ('EstimateRateHook', 'BCNRateHook')
_COMPONENT_SUFFIXES = ('backbone', 'neck', 'head')


def norm_layers(name: str, num_groups='auto', channels_per_group=None):
    """(norm_cfg, conv_cfg, hooks) of a switch name (``norms.SWITCHES``: the layers' declarations). The group norms
    take the group policy of ``normdense/layers/groups.py``: ``'auto'`` fits each layer's channel count when it is
    built."""
    groups = _group_args(num_groups, channels_per_group)
    if name == 'bn':
        return dict(type='BN', requires_grad=True), None, []
    if name not in SWITCHES:
        raise ValueError(f'unknown norm {name!r}; choose one of {", ".join(CHOICES)}')
    switch = SWITCHES[name]
    norm = dict(type=switch.norm['type'], **(groups if switch.groups else {}),
                **{k: v for k, v in switch.norm.items() if k != 'type'})
    return copy.deepcopy(norm), None if switch.conv is None else dict(type=switch.conv), list(switch.hooks)


def parse_spec(spec) -> dict:
    """``'bcn-ws'`` or ``dict(norm='bcn-ws', num_groups='auto', channels_per_group=None, exclude=[...],
    convert=False)`` -> a full dict. ``num_groups``: ``'auto'`` (default) or an exact int;
    ``channels_per_group``: the GN paper's other form (layers/groups.py)."""
    if isinstance(spec, str):
        spec = dict(norm=spec)
    spec = dict(spec)
    unknown = set(spec) - {'norm', 'num_groups', 'channels_per_group', 'exclude', 'convert'}
    if unknown or 'norm' not in spec:
        raise ValueError("normdense_norm: expected a name or dict(norm=..., num_groups='auto', "
                         f'channels_per_group=None, exclude=[...], convert=False), got keys {sorted(spec)}')
    spec.setdefault('num_groups', AUTO)
    spec.setdefault('channels_per_group', None)
    groups, per_group = spec['num_groups'], spec['channels_per_group']
    if not (groups == AUTO or (_is_int(groups) and groups > 0)):
        raise ValueError(f"normdense_norm: num_groups must be 'auto' or a positive int, got {groups!r}")
    if per_group is not None and (groups != AUTO or not _is_int(per_group) or per_group <= 0):
        raise ValueError(f'normdense_norm: channels_per_group must be a positive int and comes instead of '
                         f'num_groups, got channels_per_group={per_group!r}, num_groups={groups!r}')
    exclude = spec.get('exclude') or []
    spec['exclude'] = [exclude] if isinstance(exclude, str) else list(exclude)
    spec.setdefault('convert', False)
    norm_layers(spec['norm'])  # the one-line error for an unknown name
    return spec


_POLICY_WORDS = {AUTO: AUTO_RULE}


class SwitchReport:
    """What :func:`switch_norm` did: config rows ``(slot, type, what)``, then, once the model is built,
    the layer counts and the layers the config could not reach (or their conversion)."""

    def __init__(self, norm: str):
        self.norm = norm
        self.switched: List[tuple] = []
        self.left: List[tuple] = []
        self.notes: List[str] = []
        self.census: Optional[dict] = None
        self.groups: dict = {}  # policy -> {(channels, groups): number of layers}, once the model is built
        self.conversion = None

    def table(self) -> str:
        width = max([len(r[0]) for r in self.switched + self.left] + [10])
        lines = [f'normdense norm switch: {self.norm} ({len(self.switched)} slots switched, {len(self.left)} left)',
                 f'  {"slot":<{width}}  {"type":<28}  what']
        lines += [f'  {s:<{width}}  {t:<28}  {w}' for s, t, w in self.switched]
        lines += [f'  {s:<{width}}  {t:<28}  left: {w}' for s, t, w in self.left]
        lines += [f'  note: {n}' for n in self.notes]
        for policy, choices in sorted(self.groups.items()):
            picked = ', '.join(f'{c}->{g} x{n}' for (c, g), n in sorted(choices.items()))
            lines.append(f'  groups ({_POLICY_WORDS.get(policy, policy)}; channels->groups x layers): {picked}')
        if self.census is not None:
            counts = sorted(self.census.items())
            lines.append('  built model: ' + ', '.join(f'{name} x{count}' for name, count in counts))
        if self.conversion is not None:
            lines += ['  ' + line for line in self.conversion.table().splitlines()]
        return '\n'.join(lines)

    __str__ = table


def _registry(scope: str):
    if scope == 'mmdet':
        from mmdet.registry import MODELS
    elif scope == 'mmseg':
        from mmseg.registry import MODELS
    elif scope == 'mmpretrain':
        from mmpretrain.registry import MODELS
    else:
        from mmengine.registry import MODELS
    return MODELS


_SUPER_SKIP = re.compile(r'super\(\s*(\w+)\s*,\s*self\s*\)\.__init__')


def _accepts(cls, arg: str) -> bool:
    """Whether ``cls(...)`` takes ``arg``: in its ``__init__``, or in a base's that ``**kwargs`` reaches. An
    ``__init__`` calling ``super(Base, self).__init__(**kwargs)`` skips ``Base``'s own (mmseg's
    IterativeDecodeHead skips BaseDecodeHead's ``norm_cfg``): the walk goes on after ``Base`` then."""
    mro = cls.__mro__
    names = [k.__name__ for k in mro]
    i = 0
    while i < len(mro):
        init = mro[i].__dict__.get('__init__')
        if init is None:
            i += 1
            continue
        try:
            params = inspect.signature(init).parameters
        except (TypeError, ValueError):
            return False
        if arg in params:
            return True
        if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
            return False
        i += 1
        try:
            skipped = _SUPER_SKIP.search(inspect.getsource(init))
        except (OSError, TypeError):
            skipped = None
        if skipped and skipped.group(1) in names[i:]:
            i = names.index(skipped.group(1), i) + 1
    return False


def _default_arg(cls, arg: str):
    """The default of ``arg`` in the first ``__init__`` of ``cls``'s MRO that names it (None if none does)."""
    for klass in cls.__mro__:
        init = klass.__dict__.get('__init__')
        try:
            params = inspect.signature(init).parameters if init is not None else {}
        except (TypeError, ValueError):
            return None
        if arg in params:
            default = params[arg].default
            return None if default is inspect.Parameter.empty else default
    return None


_LAYER_NORMS = ('LN', 'LN1d', 'LN2d', 'LayerNorm', 'LayerNorm2d', 'GRN')


def _is_layer_norm(norm_cfg) -> bool:
    if not isinstance(norm_cfg, dict):
        return False
    kind = norm_cfg.get('type')
    name = kind.__name__ if isinstance(kind, type) else str(kind).split('.')[-1]
    return name in _LAYER_NORMS


def _module_class(registry, type_name):
    import torch.nn as nn
    if not isinstance(type_name, str):
        return type_name if isinstance(type_name, type) else None
    try:
        cls = registry.get(type_name)
    except Exception:  # a type of another scope that is not installed
        return None
    return cls if isinstance(cls, type) and issubclass(cls, nn.Module) else None


def _excluded(path: str, patterns) -> bool:
    parts = path.split('.')
    prefixes = ['.'.join(parts[:i]) for i in range(1, len(parts) + 1)]
    return any(fnmatch.fnmatchcase(p, pat) for p in prefixes for pat in patterns)


def _walk(node, path, partial=False):
    """Module dicts (with a ``type``) under ``node``: (path, dict, partial), parents first. ``partial``: the
    dict sits under a ``*cfg`` key (``upsample_cfg``, ``backbone_cfg``, ``plugins[i].cfg``), a config its
    parent completes with its own arguments (UNet builds ``upsample_cfg`` passing its ``norm_cfg``)."""
    if isinstance(node, dict):
        if 'type' in node:
            yield path, node, partial
        for key, value in node.items():
            if key in ('init_cfg', 'train_cfg', 'test_cfg', 'data_preprocessor'):
                continue
            yield from _walk(value, f'{path}.{key}' if path else key, str(key).endswith('cfg'))
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            yield from _walk(value, f'{path}[{i}]', partial)


def _group_args(num_groups, channels_per_group) -> dict:
    """The group arguments of a norm_cfg: one form or the other (layers/groups.py)."""
    if channels_per_group is not None:
        return dict(channels_per_group=channels_per_group)
    return dict(num_groups=num_groups)


# the switch names that configs/imagenet/ has a pretraining config for (docs/pretraining.md)
_PRETRAIN_NORMS = ('gn', 'gn-ws', 'bcn-ws', 'gn-pn', 'iternorm')


def matching_weights(norm: str, backbone: dict) -> str:
    """Which normdense pretraining config or conversion gives weights that fit ``backbone`` switched to
    ``norm``, by name (docs/pretraining.md)."""
    kind = str(backbone.get('type', '')).split('.')[-1]
    depth = backbone.get('depth')
    arch = {'ResNet': f'resnet{depth}', 'ResNetV1c': f'resnet{depth}-v1c', 'PNResNet': f'resnet{depth}',
            'PNResNetV1c': f'resnet{depth}-v1c'}.get(kind)
    # the torchvision converter makes BCN+WS (only) from a BN ResNet: a starting point, not an equivalent
    convert = ('; or, as a starting point from BN weights, tools/convert_checkpoint.py SRC.pth DST.pth '
               '--to {mmdet,mmseg} --from torchvision --norm bcn' if norm == 'bcn-ws' and kind == 'ResNet' else '')
    if arch is None or depth not in (50, 101) or norm not in _PRETRAIN_NORMS:
        return (f'normdense has no ImageNet config for a {kind} with {norm}: pretrain that backbone as a classifier '
                f'with the switch (tools/train.py mmpretrain::<its config> --norm {norm}) and load it with '
                "init_cfg=dict(type='Pretrained', checkpoint=<its .pth>, prefix='backbone.')" + convert)
    name = f'{arch}_{norm}_in1k'
    return (f'matching weights: pretrain configs/imagenet/{name}.py, then tools/convert_checkpoint.py '
            f'work_dirs/{name}/epoch_90.pth checkpoints/{name}.pth --to {{mmdet,mmseg}} and load it with '
            f"init_cfg=dict(type='PretrainedBackbone', checkpoint='checkpoints/{name}.pth')" + convert)


def _describe(node, key):
    if key not in node:
        return 'default'
    return 'plain' if not node[key] else str(node[key].get('type'))


def switch_norm(cfg, spec, verbose: bool = False) -> SwitchReport:
    """Switch every norm/conv slot of ``cfg.model`` to ``spec`` (a name in :data:`CHOICES` or a dict, see
    :func:`parse_spec`) and add the hooks, imports and optimizer settings it needs, in place. Idempotent.
    Returns the :class:`SwitchReport` of the config part (printed with ``verbose``)."""
    spec = parse_spec(spec)
    norm_cfg, conv_cfg, hooks = norm_layers(spec['norm'], spec['num_groups'], spec['channels_per_group'])
    report = SwitchReport(spec['norm'])
    registry = _registry(cfg.get('default_scope') or 'mmengine')
    for path, node, partial in list(_walk(cfg.model, '')):
        slot = f'model.{path}' if path else 'model'
        cls = _module_class(registry, node['type'])
        if cls is None:
            continue
        # a partial config takes what its parent passes: switched only where it writes a norm_cfg itself
        has_norm = 'norm_cfg' in node or (not partial and _accepts(cls, 'norm_cfg'))
        component = path.split('.')[-1].split('[')[0].endswith(_COMPONENT_SUFFIXES)
        if not has_norm:
            if component:
                report.left.append((slot, str(node['type']), 'takes no norm_cfg (its convs stay plain)'))
            continue
        if _excluded(path, spec['exclude']):
            report.left.append((slot, str(node['type']), 'excluded'))
            continue
        if _is_layer_norm(node['norm_cfg'] if 'norm_cfg' in node else _default_arg(cls, 'norm_cfg')):
            # transformer / ConvNeXt blocks: token or channels-last layouts (LN2d takes data_format=), not a
            # slot for a batch or group norm over (N, C, H, W)
            report.left.append((slot, str(node['type']), 'its norm_cfg is a LayerNorm (transformer-style block)'))
            continue
        before = f"{_describe(node, 'norm_cfg')}/{_describe(node, 'conv_cfg')}"
        norm, conv = copy.deepcopy(norm_cfg), copy.deepcopy(conv_cfg)
        if spec['norm'] == 'gn-pn' and path == 'backbone':
            if node['type'] in _PN_BACKBONES:
                if cls.__module__.startswith('mmdet.') and node.get('stem_channels') is None:
                    # PNResNet is built on mmseg's ResNet (stem 64 by default); mmdet's makes it base_channels
                    node['stem_channels'] = node.get('base_channels', 64)
                node['type'] = _PN_BACKBONES[node['type']]
                norm = dict(type='GNPN', **_group_args(spec['num_groups'], spec['channels_per_group']))
            else:
                report.notes.append(f"gn-pn: the backbone {node['type']} is not a ResNet/ResNetV1c, which PNResNet "
                                    'replaces: it gets GN without PN')
        node['norm_cfg'] = norm
        if 'conv_cfg' in node or (not partial and _accepts(cls, 'conv_cfg')):
            node['conv_cfg'] = conv
        if spec['norm'] != 'bn' and ('norm_eval' in node or (not partial and _accepts(cls, 'norm_eval'))):
            node['norm_eval'] = False
        after = f"{_describe(node, 'norm_cfg')}/{_describe(node, 'conv_cfg')}"
        report.switched.append((slot, str(node['type']), f'norm/conv {before} -> {after}'))
        init = node.get('init_cfg') or {}
        checkpoint = init.get('checkpoint') if isinstance(init, dict) and init.get('type') == 'Pretrained' else None
        checkpoint = checkpoint or (cfg.model.get('pretrained') if path == 'backbone' else None)
        if path == 'backbone' and checkpoint and spec['norm'] != 'bn' and init.get('type') != 'PretrainedBackbone':
            report.notes.append(f"the backbone loads {checkpoint}, a BN-trained checkpoint: its norm parameters do not "
                                f"fit the new layers; {matching_weights(spec['norm'], node)} (docs/pretraining.md; "
                                'or init_cfg=None and pretrained=None to train from scratch)')
    # a container whose sub-heads were switched (CascadeRoIHead) is not 'left'
    report.left = [r for r in report.left if r[2] == 'excluded' or
                   not any(s[0].startswith(r[0] + '.') for s in report.switched)]
    _add_needs(cfg, spec, hooks)
    if verbose:
        _log(report.table())
    return report


def _add_needs(cfg, spec, hooks):
    imports = dict(cfg.get('custom_imports') or dict(imports=[], allow_failed_imports=False))
    names = list(imports.get('imports') or [])
    if 'normdense' not in names:
        imports['imports'] = names + ['normdense']
        cfg.custom_imports = imports
    custom = list(cfg.get('custom_hooks') or [])
    present = {h.get('type') for h in custom}
    for hook in hooks:
        if hook in present or (hook in _RATE_HOOKS and present & set(_RATE_HOOKS)):
            continue
        custom.append(dict(type=hook))
    cfg.custom_hooks = custom
    if spec['norm'] == 'gn-pn' and cfg.get('optim_wrapper') is not None:
        from .hooks.proxy_norm_check import proxy_norm_paramwise_cfg
        paramwise = cfg.optim_wrapper.get('paramwise_cfg') or {}
        for key, value in proxy_norm_paramwise_cfg().items():
            if key == 'custom_keys':
                paramwise['custom_keys'] = {**value, **(paramwise.get('custom_keys') or {})}
            else:
                paramwise.setdefault(key, value)
        cfg.optim_wrapper['paramwise_cfg'] = paramwise


def finish_model(model, spec, report: SwitchReport):
    """After the build: count the layers, and list (or, with ``convert``, convert) what the config could not
    reach. Returns the model (converted in place)."""
    from .model_convert import convert_model, model_census
    spec = parse_spec(spec)
    norm_cfg, conv_cfg, _ = norm_layers(spec['norm'], spec['num_groups'], spec['channels_per_group'])
    exclude = [p.replace('[', '.').replace(']', '') for p in spec['exclude']]
    converted = convert_model(model, norm=norm_cfg, conv=conv_cfg, exclude=exclude or None, verbose=False,
                              dry_run=not spec['convert'])
    report.conversion = converted.normdense_conversion
    report.conversion.title = ('hard-coded layers converted (convert=True)' if spec['convert'] else
                               'hard-coded layers the config does not reach')
    report.census = model_census(converted)
    report.groups = group_choices(converted)
    return converted


def group_choices(model) -> dict:
    """``{policy: {(channels, groups): layers}}`` of the group norms in ``model`` whose group count a policy
    chose (``layers/groups.py``); exact counts a config wrote are not choices."""
    out = {}
    for m in model.modules():
        policy = getattr(m, 'group_policy', None)
        if policy not in (None, 'exact'):
            out.setdefault(policy, Counter())[(m.num_channels, m.num_groups)] += 1
    return out


def build_norm_switched(model: dict, norm: str, num_groups='auto', exclude=None, convert: bool = False,
                        data_preprocessor=None, channels_per_group=None):
    """The model-type form, ``model = dict(_delete_=True, type='NormSwitched', norm='gn-ws',
    model={{_base_.model}})``: the switch applied to ``model`` when it is built, so every code path that builds
    ``cfg.model`` (a plain ``Runner.from_cfg`` as mmseg 1.2.2's ``tools/test.py``, ``init_detector``,
    ``init_model``) gets the switched model, with the state-dict keys of the runner form. Returns the built
    model itself (its own class). It cannot add hooks: estimate-mode norms (``bcn-ws``, ``unitization``)
    need ``custom_hooks = [dict(type='EstimateRateHook')]`` in the config (without it the first training
    iteration stops with an error naming the hook). ``data_preprocessor``: what mmengine's Runner passes
    from a top-level ``data_preprocessor`` (as it would into any model dict)."""
    from mmengine.config import Config
    from mmengine.registry import DefaultScope
    spec = parse_spec(dict(norm=norm, num_groups=num_groups, channels_per_group=channels_per_group,
                           exclude=exclude or [], convert=convert))
    current = DefaultScope.get_current_instance()
    model = copy.deepcopy(dict(model))
    if data_preprocessor is not None:
        model.setdefault('data_preprocessor', data_preprocessor)
    cfg = Config(dict(model=model, default_scope=current.scope_name if current else 'mmengine'))
    report = switch_norm(cfg, spec)
    if cfg.custom_hooks:
        report.notes.append('the model-type form adds no hooks: the config needs custom_hooks = ' +
                            str([dict(type=h['type']) for h in cfg.custom_hooks]))
    built = _registry(cfg.default_scope).build(cfg.model)
    built = finish_model(built, spec, report)
    _log(report.table())
    return built


def _log(text):
    from mmengine.logging import print_log
    print_log(text, logger='current', level=logging.INFO)


def request_switch(cfg, norm) -> None:
    """``--norm NAME`` of tools/train.py and tools/test.py: ask the runner to switch (config form)."""
    parse_spec(norm)
    runner_type = cfg.get('runner_type')
    if runner_type not in (None, 'Runner', 'NormSwitchRunner'):
        raise ValueError(f"--norm needs runner_type 'Runner' or 'NormSwitchRunner'; this config sets "
                         f'{runner_type!r}: call normdense.switch_norm(cfg, {norm!r}) before building it')
    existing = cfg.get('normdense_norm')
    cfg.normdense_norm = dict(parse_spec(existing), norm=norm) if existing else norm
    cfg.runner_type = 'NormSwitchRunner'
