"""Checks the tools run on a config before building anything: layer types and data paths.

Both turn what would be a long log ending in a registry ``KeyError`` (mmcv formats the failed lookup,
not the name: ``Cannot find None in registry``) or a pycocotools ``FileNotFoundError`` into one line
that names the problem, where it is, and the fix.
"""
import difflib
import importlib
import os.path as osp

from .errors import UserFixable

DATA_GUIDE = 'docs/data.md'

# Keys whose ``type`` is built by the codebase's TASK_UTILS (mmdet: assigners, samplers, coders,
# anchor generators, match costs; mmseg: pixel samplers), not by MODELS.
_TASK_UTIL_KEYS = ('assigner', 'sampler', 'bbox_coder', 'anchor_generator', 'prior_generator',
                   'point_generator', 'iou_calculator', 'match_costs', 'match_cost')
# Keys whose ``type`` names an mmcv.ops attribute, looked up with getattr (mmdet's RoI extractors
# and mmcv's batched_nms), not through any registry.
_OPS_KEYS = ('roi_layer', 'nms')
# Keys always built through MODELS by mmcv's bricks: a name found only in another registry is a typo.
_MODELS_ONLY_KEYS = ('norm_cfg', 'conv_cfg', 'act_cfg')


class ConfigError(UserFixable, ValueError):
    """A problem in the user's config or data that the tools report as one line (no traceback)."""


def _registries(scope):
    """The registries of a codebase (they fall back to mmengine's root ones)."""
    names = ('MODELS', 'TASK_UTILS', 'WEIGHT_INITIALIZERS')
    module = 'mmengine.registry' if scope == 'mmengine' else f'{scope}.registry'
    reg = importlib.import_module(module)
    out = {n: getattr(reg, n) for n in names}
    if hasattr(reg, 'BATCH_AUGMENTS'):  # mmpretrain's Mixup/CutMix in data_preprocessor
        out['BATCH_AUGMENTS'] = reg.BATCH_AUGMENTS
    return out


def _known(registry, name):
    try:
        return registry.get(name) is not None
    except (KeyError, ImportError):  # 'otherscope.Name' for a scope that is not installed
        return False


def _names(registry):
    names = set()
    while registry is not None:
        names.update(registry.module_dict)
        registry = registry.parent
    return names


def _is_op(name):
    try:
        import mmcv.ops
    except ImportError:
        return False
    return hasattr(mmcv.ops, name)


def _expected(path):
    """Which registry a ``type`` at this key path is built by (for the message and strictness)."""
    keys = [p for p in path if isinstance(p, str)]
    if 'init_cfg' in keys:
        return 'WEIGHT_INITIALIZERS'
    if any(k in _TASK_UTIL_KEYS for k in keys):
        return 'TASK_UTILS'
    if keys and keys[-1] in _OPS_KEYS:
        return 'ops'
    return 'MODELS'


def _dotted(path):
    out = ''
    for p in path:
        out += f'[{p}]' if isinstance(p, int) else (f'.{p}' if out else p)
    return out


def _walk(node, path):
    if isinstance(node, dict):
        t = node.get('type')
        if isinstance(t, str):
            yield path, t
        for k, v in node.items():
            if k != 'type':
                yield from _walk(v, path + (k,))
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            yield from _walk(v, path + (i,))


def unknown_types(model_cfg, scope, root='model'):
    """``[(dotted_path, type, expected_registry, close_names)]`` for every ``type`` in the model config
    that no registry of ``scope`` (nor mmcv.ops where the codebase uses getattr) resolves."""
    regs = _registries(scope)
    problems = []
    for path, name in _walk(model_cfg, (root,)):
        expected = _expected(path)
        if expected == 'ops':
            if _is_op(name) or _known(regs['MODELS'], name):
                continue
        elif _known(regs[expected], name):
            continue
        elif path[-1] not in _MODELS_ONLY_KEYS and any(_known(r, name) for r in regs.values()):
            continue  # built through another registry (e.g. mmpretrain's batch augments)
        pool = sorted(_names(regs['MODELS' if expected == 'ops' else expected]))
        lowered = {n.lower(): n for n in pool}
        close = [lowered[n] for n in difflib.get_close_matches(name.lower(), list(lowered), n=3, cutoff=0.6)]
        problems.append((_dotted(path + ('type',)), name, expected, close))
    return problems


def check_model_types(cfg, scope):
    """Raise ConfigError (one line) for the first unknown ``type`` in ``cfg.model``."""
    if cfg.get('model') is None:
        return
    problems = unknown_types(cfg.model, scope)
    if problems:
        where, name, expected, close = problems[0]
        hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ''
        more = f' ({len(problems) - 1} more unknown type(s) after this one)' if len(problems) > 1 else ''
        registry = 'mmcv.ops' if expected == 'ops' else f"{scope}'s {expected} registry"
        raise ConfigError(f"unknown type {name!r} at {where}: not in {registry}{hint}{more}")


# --- data paths -------------------------------------------------------------------------------------

def _leaf_datasets(ds_cfg, path):
    """The dataset configs that read files, through ConcatDataset / RepeatDataset-style wrappers."""
    if not isinstance(ds_cfg, dict):
        return
    if isinstance(ds_cfg.get('datasets'), (list, tuple)):
        for i, sub in enumerate(ds_cfg['datasets']):
            yield from _leaf_datasets(sub, f'{path}.datasets[{i}]')
    elif isinstance(ds_cfg.get('dataset'), dict):
        yield from _leaf_datasets(ds_cfg['dataset'], f'{path}.dataset')
    else:
        yield path, ds_cfg


def _local(path, cfg):
    if not isinstance(path, str) or not path or '://' in path:
        return False
    return ((cfg or {}).get('backend_args') or {}).get('backend', 'local') == 'local'


def _join(root, p):
    return osp.join(root, p) if root and not osp.isabs(p) else p


def dataset_paths(ds_cfg):
    """``[(key, path, kind)]`` a dataset config reads, joined as mmengine's BaseDataset joins them."""
    root = ds_cfg.get('data_root')
    out = []
    if _local(root, ds_cfg):
        out.append(('data_root', root, 'dir'))
    ann = ds_cfg.get('ann_file')
    if _local(ann, ds_cfg):
        out.append(('ann_file', _join(root, ann), 'file'))
    prefix = ds_cfg.get('data_prefix')
    items = prefix.items() if isinstance(prefix, dict) else [('', prefix)]  # mmpretrain: a string
    for k, p in items:
        if _local(p, ds_cfg):
            out.append((f'data_prefix.{k}' if k else 'data_prefix', _join(root, p), 'dir'))
    return out


def missing_data_path(cfg, loaders, evaluators=True):
    """The first path the given dataloaders (and their evaluators' ``ann_file``, e.g. CocoMetric's) would
    read that does not exist: ``(where, path)`` or None."""
    for loader in loaders:
        loader_cfg = cfg.get(loader)
        if not isinstance(loader_cfg, dict):
            continue
        for where, ds_cfg in _leaf_datasets(loader_cfg.get('dataset'), f'{loader}.dataset'):
            for key, path, kind in dataset_paths(ds_cfg):
                exists = osp.isdir(path) if kind == 'dir' else osp.isfile(path)
                if not exists:
                    return f'{where}.{key}', path
    for loader in loaders if evaluators else ():
        evaluator = loader.replace('_dataloader', '_evaluator')  # train_evaluator: None
        metrics = cfg.get(evaluator)
        for i, metric in enumerate(metrics if isinstance(metrics, (list, tuple)) else [metrics]):
            ann = metric.get('ann_file') if isinstance(metric, dict) else None
            if _local(ann, metric) and not osp.isfile(ann):
                return f'{evaluator}{f"[{i}]" if isinstance(metrics, (list, tuple)) else ""}.ann_file', ann
    return None


def loaders_used(cfg, mode):
    """The dataloaders ``Runner.train()`` / ``Runner.test()`` will build from this config."""
    if mode == 'test':
        return ['test_dataloader']
    loaders = ['train_dataloader']
    if all(cfg.get(k) is not None for k in ('val_dataloader', 'val_cfg', 'val_evaluator')):
        loaders.append('val_dataloader')
    return loaders


def check_data_paths(cfg, mode):
    """Raise ConfigError (one line) naming the first missing data path, before the runner is built."""
    check_data_paths_of(cfg, loaders_used(cfg, mode))


def check_data_paths_of(cfg, loaders, evaluators=True):
    found = missing_data_path(cfg, loaders, evaluators)
    if found is not None:
        where, path = found
        raise ConfigError(f'data not found: {path} (from {where}); prepare the dataset as {DATA_GUIDE} '
                          'describes, or point the config\'s data_root at it')
