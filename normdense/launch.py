"""What ``tools/train.py`` and ``tools/test.py`` do, as library functions.

They behave like mmdet's, mmseg's and mmpretrain's own ``tools/train.py`` / ``tools/test.py``: the
codebase is picked from the config's ``default_scope`` and its few differences (how ``--out`` and
``--show-dir`` are wired) are handled here, so one launcher serves all three.
"""
import os
import os.path as osp

import normdense  # noqa: F401  (registers layers/hooks, allow-lists checkpoint types)
from normdense import codebases
from normdense.checkpoint import check_checkpoint_path

SUPPORTED_SCOPES = ('mmdet', 'mmseg', 'mmpretrain', 'mmengine')


def load_config(config, cfg_options=None, launcher='none', work_dir=None):
    """Read a config, apply ``--cfg-options`` and ``--launcher``, pick the work dir (the argument, else
    the config's, else ``./work_dirs/<config name>``), and import the config's codebase."""
    if not osp.isfile(config):
        raise FileNotFoundError(f'config file not found: {config}')
    cfg = codebases.read_config(config)  # a missing codebase: one line naming the extra
    cfg.launcher = launcher
    if cfg_options:
        cfg.merge_from_dict(cfg_options)
    if work_dir is not None:
        cfg.work_dir = work_dir
    elif cfg.get('work_dir') is None:
        cfg.work_dir = osp.join('./work_dirs', osp.splitext(osp.basename(config))[0])
    scope = codebase_of(cfg)
    if scope == 'mmdet':
        from mmdet.utils import setup_cache_size_limit_of_dynamo
        setup_cache_size_limit_of_dynamo()  # as mmdet's tools/train.py: avoids recompile stalls
    return cfg


def codebase_of(cfg):
    """The codebase a config belongs to (its ``default_scope``), imported so its registries fill."""
    scope = cfg.get('default_scope') or 'mmengine'
    if scope not in SUPPORTED_SCOPES:
        raise ValueError(f"config default_scope={scope!r} is not one of {SUPPORTED_SCOPES}")
    codebases.require(scope, f'a config with default_scope={scope!r}')
    return scope


def apply_train_args(cfg, amp=False, auto_scale_lr=False, resume=None):
    """The training switches of mmdet's tools/train.py."""
    if amp:
        wrapper = cfg.optim_wrapper.get('type', 'OptimWrapper')
        if wrapper == 'AmpOptimWrapper':
            print('AMP training is already enabled in the config.')
        elif wrapper != 'OptimWrapper':
            raise ValueError(f'--amp needs optim_wrapper type OptimWrapper or AmpOptimWrapper, got {wrapper}')
        else:
            cfg.optim_wrapper.type = 'AmpOptimWrapper'
            cfg.optim_wrapper.loss_scale = 'dynamic'
    if auto_scale_lr:
        if 'auto_scale_lr' in cfg and 'base_batch_size' in cfg.auto_scale_lr:
            cfg.auto_scale_lr.enable = True
        else:
            raise RuntimeError('--auto-scale-lr needs `auto_scale_lr = dict(base_batch_size=...)` in the config '
                               '(the total batch size the config\'s learning rate was set for)')
    if resume == 'auto':
        cfg.resume = True
        cfg.load_from = None
    elif resume is not None:
        check_checkpoint_path(resume, '--resume checkpoint')
        cfg.resume = True
        cfg.load_from = resume
    return cfg


def apply_test_args(cfg, checkpoint, out=None, show=False, show_dir=None, wait_time=2.0):
    """The testing switches of the codebases' tools/test.py (checkpoint, --out, --show, --show-dir)."""
    check_checkpoint_path(checkpoint)
    cfg.load_from = checkpoint
    scope = codebase_of(cfg)
    if show or show_dir:
        hooks = cfg.get('default_hooks', {})
        if 'visualization' not in hooks:
            raise RuntimeError('--show/--show-dir need a `visualization` entry in default_hooks')
        vis = hooks['visualization']
        if scope == 'mmpretrain':
            vis['enable'] = True
            if show_dir:
                vis['out_dir'] = show_dir
        else:
            vis['draw'] = True
            if show_dir and scope == 'mmdet':
                vis['test_out_dir'] = show_dir
            elif show_dir:
                cfg.visualizer['save_dir'] = show_dir
        if show:
            vis['show'] = True
            vis['wait_time'] = wait_time
    if out is not None and not out.endswith(('.pkl', '.pickle')):
        raise ValueError(f'--out must be a .pkl/.pickle file, got {out}')
    return cfg


def apply_load_args(cfg, allow_partial_load=False):
    """Strict checkpoint loads for ``load_from``, ``--resume`` and test's CHECKPOINT (local paths,
    ``https://``, ``open-mmlab://``, ``torchvision://``): adds :class:`~normdense.hooks.strict_load.
    StrictLoadHook`, which refuses a checkpoint with missing, unexpected or shape-mismatched keys.
    ``--allow-partial-load`` (or ``allow_partial_load = True`` in the config) loads anyway and logs, at
    warning level, what stayed at initialization. A missing local ``load_from`` fails here, in one line."""
    if allow_partial_load:
        cfg.allow_partial_load = True
    check_checkpoint_path(cfg.get('load_from'), 'load_from checkpoint')
    hooks = [h for h in (cfg.get('custom_hooks') or []) if h.get('type') != 'StrictLoadHook']
    cfg.custom_hooks = hooks + [dict(type='StrictLoadHook', allow_partial=bool(cfg.get('allow_partial_load')))]
    return cfg


def add_result_dump(runner, out, scope):
    """Append a metric that pickles the raw predictions to ``out`` (mmdet's DumpDetResults for mmdet,
    which encodes masks compactly; mmengine's DumpResults otherwise)."""
    if scope == 'mmdet':
        from mmdet.evaluation import DumpDetResults as Dump
    else:
        from mmengine.evaluator import DumpResults as Dump
    os.makedirs(osp.dirname(osp.abspath(out)), exist_ok=True)
    runner.test_evaluator.metrics.append(Dump(out_file_path=out))


def prepare_cpu_distributed(cfg):
    """Let ``--launcher pytorch`` run on CPU-only machines (gloo), which mmengine 0.10.7 does not: its
    launcher calls ``torch.cuda.set_device`` and wraps the model with ``device_ids=[LOCAL_RANK]``.
    We start the gloo process group ourselves (mmengine then skips its own init) and wrap with
    ``device_ids=None``. Nothing changes where CUDA is available."""
    import torch
    import torch.distributed as dist
    if cfg.get('launcher', 'none') != 'pytorch' or torch.cuda.is_available():
        return cfg
    if not dist.is_initialized():
        dist.init_process_group(backend='gloo')
    wrapper = cfg.get('model_wrapper_cfg') or dict(type='MMDistributedDataParallel', broadcast_buffers=False,
                                                   find_unused_parameters=cfg.get('find_unused_parameters', False))
    wrapper.setdefault('device_ids', None)
    cfg.model_wrapper_cfg = wrapper
    return cfg


def build_runner(cfg):
    from mmengine.registry import RUNNERS
    from mmengine.runner import Runner
    prepare_cpu_distributed(cfg)
    return Runner.from_cfg(cfg) if 'runner_type' not in cfg else RUNNERS.build(cfg)
