"""Train and test jobs: what ``tools/train.py`` and ``tools/test.py`` do, as library functions (kernel launches are
``kernels/launch.py``'s).

They behave like mmdet's, mmseg's and mmpretrain's own ``tools/train.py`` / ``tools/test.py``: the
codebase is picked from the config's ``default_scope`` and its few differences (how ``--out`` and
``--show-dir`` are wired) are handled here, so one launcher serves all three.
"""
import os
import os.path as osp

import normdense  # noqa: F401  (registers layers/hooks, allow-lists checkpoint types)
from normdense import codebases
from normdense.checkpoint import check_checkpoint_path
from normdense.config_check import (ConfigError, check_data_paths, check_data_paths_of, check_model_types,  # noqa: F401
                                    loaders_used)

SUPPORTED_SCOPES = ('mmdet', 'mmseg', 'mmpretrain', 'mmengine')


def load_config(config, cfg_options=None, launcher='none', work_dir=None):
    """Read a config, apply ``--cfg-options`` and ``--launcher``, pick the work dir (the argument, else
    the config's, else ``./work_dirs/<config name>``), and import the config's codebase."""
    cfg = codebases.read_config(config)  # a path or an mmdet::/mmseg::/mmpretrain:: name; one-line errors
    cfg.launcher = launcher
    if cfg_options:
        cfg.merge_from_dict(cfg_options)
    if work_dir is not None:
        cfg.work_dir = work_dir
    elif cfg.get('work_dir') is None:
        cfg.work_dir = osp.join('./work_dirs', osp.splitext(osp.basename(config.split('::')[-1]))[0])
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
    if scope != 'mmengine':  # its models register now; a failing mmcv op library is one line here
        codebases.require(f'{scope}.models', f'a config with default_scope={scope!r}')
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
    if out is not None:
        apply_out(cfg, out, scope)
    return cfg


def apply_out(cfg, out, scope):
    """``--out`` as each codebase's test.py means it: mmseg, a directory where IoUMetric writes one
    prediction PNG per image (``output_dir`` + ``keep_results``); mmdet, mmpretrain and plain mmengine
    configs, a pickle of the raw predictions (added by ``add_result_dump`` once the runner exists). For
    mmseg a ``.pkl``/``.pickle`` name (which mmseg's own tool would make a directory of) dumps the raw
    predictions as for the others: the segmentation demo reads them."""
    if scope == 'mmseg' and not _is_pickle(out):
        for metric in _metrics(cfg.test_evaluator):
            metric['output_dir'] = out
            metric['keep_results'] = True
    elif scope != 'mmseg' and not _is_pickle(out):
        raise ValueError(f'--out must be a .pkl/.pickle file for {scope} configs, got {out}')
    return cfg


def _is_pickle(path):
    return path.endswith(('.pkl', '.pickle'))


def _metrics(evaluator):
    return evaluator if isinstance(evaluator, (list, tuple)) else [evaluator]


def apply_tta(cfg, scope):
    """``--tta`` as each codebase's test.py: wrap ``cfg.model`` in ``cfg.tta_model`` and test with
    ``cfg.tta_pipeline``. mmdet and mmpretrain fall back to their own flip TTA when the config has
    neither (said in a warning, as they do); mmseg has no fallback, so a config without them is an error
    here rather than an AttributeError there."""
    import copy
    import warnings
    from mmengine.config import ConfigDict
    if scope == 'mmseg' or scope == 'mmengine':
        missing = [k for k in ('tta_model', 'tta_pipeline') if k not in cfg]
        if missing:
            raise ValueError(f'--tta needs {" and ".join(missing)} in the config (mmseg\'s default_runtime.py has '
                             "tta_model = dict(type='SegTTAModel'); its dataset configs define tta_pipeline)")
    if scope == 'mmdet' and (cfg.get('tta_model') or {}).get('type', 'DetTTAModel') in \
            ('DetTTAModel', 'mmdet.DetTTAModel') and _has_mask_head(cfg.model):
        raise ValueError('--tta: mmdet\'s DetTTAModel merges boxes only ("TTA of instance segmentation does not '
                         'support now") and this model predicts masks; test without --tta')
    if 'tta_model' not in cfg:
        default = (dict(type='DetTTAModel', tta_cfg=dict(nms=dict(type='nms', iou_threshold=0.5), max_per_img=100))
                   if scope == 'mmdet' else dict(type='mmpretrain.AverageClsScoreTTA'))
        warnings.warn(f'--tta: no tta_model in the config, using {scope}\'s default {default}')
        cfg.tta_model = default
    if 'tta_pipeline' not in cfg:
        test_data = cfg.test_dataloader.dataset
        while 'dataset' in test_data:
            test_data = test_data['dataset']
        cfg.tta_pipeline = copy.deepcopy(test_data.pipeline)
        last = (dict(type='PackDetInputs', meta_keys=('img_id', 'img_path', 'ori_shape', 'img_shape', 'scale_factor',
                                                      'flip', 'flip_direction'))
                if scope == 'mmdet' else test_data.pipeline[-1])
        cfg.tta_pipeline[-1] = dict(type='TestTimeAug', transforms=[
            [dict(type='RandomFlip', prob=1.), dict(type='RandomFlip', prob=0.)], [last]])
        warnings.warn(f'--tta: no tta_pipeline in the config, using the test pipeline with {scope}\'s '
                      'horizontal-flip TestTimeAug')
    cfg.model = ConfigDict(**cfg.tta_model, module=cfg.model)
    cfg.test_dataloader.dataset.pipeline = cfg.tta_pipeline
    return cfg


def _has_mask_head(model_cfg):
    roi_head = model_cfg.get('roi_head') or {}
    return roi_head.get('mask_head') is not None or model_cfg.get('mask_head') is not None


def apply_loader_args(cfg, no_validate=False, no_pin_memory=False, no_persistent_workers=False):
    """mmpretrain's ``--no-validate``, ``--no-pin-memory`` and ``--no-persistent-workers`` (any codebase)."""
    if no_validate:
        cfg.val_cfg = cfg.val_dataloader = cfg.val_evaluator = None
    for loader in ('train_dataloader', 'val_dataloader', 'test_dataloader'):
        if cfg.get(loader) is None:
            continue
        if no_pin_memory:
            cfg[loader]['pin_memory'] = False
        if no_persistent_workers:
            cfg[loader]['persistent_workers'] = False
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
    if scope == 'mmseg' and not _is_pickle(out):
        return  # IoUMetric writes the PNGs (apply_out)
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


def apply_norm_arg(cfg, norm):
    """``--norm NAME``: the norm switch (normdense/norm_switch.py), applied by NormSwitchRunner. A config's own
    ``normdense_norm`` is checked here too, so a wrong name is one line before anything is built."""
    from normdense.norm_switch import parse_spec, request_switch
    if norm:
        request_switch(cfg, norm)
    elif cfg.get('normdense_norm'):
        parse_spec(cfg.normdense_norm)
    return cfg


def build_runner(cfg):
    from mmengine.registry import RUNNERS
    from mmengine.runner import Runner
    prepare_cpu_distributed(cfg)
    return Runner.from_cfg(cfg) if 'runner_type' not in cfg else RUNNERS.build(cfg)


# --- the command lines: every argument of mmdet 3.x's, mmseg 1.x's and mmpretrain 1.x's tools ---------

def _common_args(parser):
    from mmengine.config import DictAction
    parser.add_argument('--allow-partial-load', action='store_true',
                        help='(normdense) load a checkpoint that does not cover the model (missing, unexpected or '
                             'shape-mismatched keys) and log what stays at initialization (default: refuse)')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction,
                        help='override config settings, e.g. train_cfg.max_iters=10 (xxx=yyy, lists as [a,b])')
    from normdense.norm_switch import CHOICES
    parser.add_argument('--norm', choices=CHOICES,
                        help='(normdense) switch every norm/conv slot of the config to this norm and add what it needs '
                             '(docs/any_model.md); prints what was switched and what was left')
    parser.add_argument('--launcher', choices=['none', 'pytorch', 'slurm', 'mpi'], default='none',
                        help='job launcher')
    parser.add_argument('--debug', action='store_true',
                        help='(normdense) show the traceback of a known error instead of one line '
                             '(or NORMDENSE_DEBUG=1)')
    # torch.distributed.launch passes --local-rank from torch 2.0 on, --local_rank before
    parser.add_argument('--local_rank', '--local-rank', type=int, default=0)


def train_arg_parser():
    import argparse
    p = argparse.ArgumentParser(description='Train a model (mmdet / mmseg / mmpretrain config, picked from its '
                                            'default_scope) with normdense layers')
    p.add_argument('config', help='train config: a file, or a packaged name such as '
                                   'mmdet::retinanet/retinanet_r50_fpn_1x_coco.py')
    p.add_argument('--work-dir', help='the dir to save logs and models')
    p.add_argument('--amp', action='store_true', default=False, help='enable automatic-mixed-precision training')
    p.add_argument('--auto-scale-lr', action='store_true',
                   help='scale the learning rate by (GPUs x images per GPU) / auto_scale_lr.base_batch_size')
    p.add_argument('--resume', nargs='?', type=str, const='auto',
                   help='resume from this checkpoint; without a path, from the latest one in the work dir')
    p.add_argument('--no-validate', action='store_true', help='do not validate during training (mmpretrain)')
    p.add_argument('--no-pin-memory', action='store_true', help='pin_memory=False in the dataloaders (mmpretrain)')
    p.add_argument('--no-persistent-workers', action='store_true',
                   help='persistent_workers=False in the dataloaders (mmpretrain)')
    p.add_argument('--check-data', action='store_true',
                   help='(normdense) run tools/check_dataset.py\'s checks on the train/val data first and stop on '
                        'any problem (reads every annotation and image header: minutes on COCO)')
    _common_args(p)
    return p


def test_arg_parser():
    import argparse
    p = argparse.ArgumentParser(description='Test (and evaluate) a model: COCO AP for mmdet configs, mIoU for '
                                            'mmseg, accuracy for mmpretrain')
    p.add_argument('config', help='test config: a file, or a packaged name (mmdet::..., mmseg::..., mmpretrain::...)')
    p.add_argument('checkpoint', help='checkpoint: a local file, https://..., open-mmlab://... or torchvision://...')
    p.add_argument('--work-dir', help='the dir to save logs and the evaluation metrics')
    p.add_argument('--out', help='mmdet / mmpretrain: dump the raw predictions to this .pkl file; mmseg: save '
                                 'one prediction PNG per image into this directory')
    p.add_argument('--out-item', choices=['metrics', 'pred'],
                   help='(mmpretrain) what --out holds: the predictions (default) or the metrics')
    p.add_argument('--show', action='store_true', help='show prediction results in a window')
    p.add_argument('--show-dir', help='save images with drawn predictions into this directory '
                                      '(mmdet/mmseg: inside the work dir\'s timestamped folder)')
    p.add_argument('--wait-time', type=float, default=2, help='the interval of show (s)')
    p.add_argument('--interval', type=int, default=1, help='(mmpretrain) visualize every n-th sample')
    p.add_argument('--amp', action='store_true', help='test with automatic mixed precision (test_cfg.fp16)')
    p.add_argument('--no-pin-memory', action='store_true', help='pin_memory=False in the test dataloader')
    p.add_argument('--tta', action='store_true',
                   help='test-time augmentation: wrap the model in cfg.tta_model and test with cfg.tta_pipeline '
                        '(mmdet / mmpretrain: their flip TTA when the config has none)')
    _common_args(p)
    return p


def parse_args(parser, argv=None):
    args = parser.parse_args(argv)
    if 'LOCAL_RANK' not in os.environ:
        os.environ['LOCAL_RANK'] = str(args.local_rank)
    return args


USER_ERRORS = (ConfigError, FileNotFoundError, ValueError, RuntimeError)


def prepare_train(args):
    """The config ``tools/train.py`` builds its runner from, after every check that needs no model."""
    cfg = load_config(args.config, args.cfg_options, args.launcher, args.work_dir)
    apply_norm_arg(cfg, getattr(args, 'norm', None))
    apply_train_args(cfg, amp=args.amp, auto_scale_lr=args.auto_scale_lr, resume=args.resume)
    apply_loader_args(cfg, args.no_validate, args.no_pin_memory, args.no_persistent_workers)
    apply_load_args(cfg, allow_partial_load=args.allow_partial_load)
    scope = codebase_of(cfg)
    check_model_types(cfg, scope)
    check_data_paths(cfg, 'train')
    if args.check_data:
        from normdense.data.check import check_config_datasets
        report = check_config_datasets(cfg, splits=loaders_used(cfg, 'train'))
        print(report.text())
        if not report.ok:
            raise ConfigError(report.summary())
    # the Runner initializes weights before it resumes or loads, so a missing backbone fails any training
    from normdense.convert.pretrained_init import missing_pretrained_backbones
    missing = missing_pretrained_backbones(cfg.model.to_dict() if hasattr(cfg.model, 'to_dict') else cfg.model)
    if missing:
        raise ConfigError(missing[0])
    return cfg


def prepare_test(args):
    """The config ``tools/test.py`` builds its runner from, after every check that needs no model."""
    if args.out is None and args.out_item is not None:
        raise ValueError('--out-item needs --out')
    cfg = load_config(args.config, args.cfg_options, args.launcher, args.work_dir)
    apply_norm_arg(cfg, getattr(args, 'norm', None))
    out = None if args.out_item == 'metrics' else args.out  # metrics: any format mmengine.dump writes
    apply_test_args(cfg, args.checkpoint, out=out, show=args.show, show_dir=args.show_dir, wait_time=args.wait_time)
    scope = codebase_of(cfg)
    if scope == 'mmpretrain' and (args.show or args.show_dir):
        cfg.default_hooks.visualization.interval = args.interval
    if args.amp:
        cfg.test_cfg = dict(cfg.get('test_cfg') or dict(type='TestLoop'), fp16=True)
    apply_loader_args(cfg, no_pin_memory=args.no_pin_memory)
    apply_load_args(cfg, allow_partial_load=args.allow_partial_load)
    check_model_types(cfg, scope)
    if args.tta:
        apply_tta(cfg, scope)
    check_data_paths(cfg, 'test')
    return cfg


def run_test(cfg, args):
    """Build the runner, add the ``--out`` pickle where the codebase dumps one, test, return the metrics."""
    scope = codebase_of(cfg)
    runner = build_runner(cfg)
    if args.out and args.out_item in ('pred', None):
        add_result_dump(runner, args.out, scope)
    metrics = runner.test()
    if args.out and args.out_item == 'metrics':
        import mmengine
        mmengine.dump(metrics, args.out)
    return metrics
