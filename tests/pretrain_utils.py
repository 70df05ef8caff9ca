"""Helpers for the ImageNet-pretraining / conversion tests: a toy ImageNet in tmp_path, the configs of
``configs/imagenet`` shrunk to a 2-iteration ResNet-18 run, and target backbones built from a conversion."""
import copy
import glob
import logging
import os.path as osp

import pytest
import torch
from mmengine.config import Config

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
IMAGENET_DIR = osp.join(ROOT, 'configs', 'imagenet')
IMAGENET_CONFIGS = sorted(osp.basename(p)[:-3] for p in glob.glob(osp.join(IMAGENET_DIR, '*.py')))
TOY_CONFIG = osp.join(ROOT, 'configs', 'demo', 'resnet18-w32_bcn-ws_toy-imagenet.py')
CLASSES = ('circle', 'rectangle', 'ring', 'star', 'triangle')


@pytest.fixture(scope='module')
def single_thread():
    """Run a test module's models on one intra-op thread. These tests run many tiny models; on a shared
    2-core machine two OpenMP threads per process oversubscribe the cores and a ResNet-18 step at 64x64
    slows down 10-20x (measured: 0.5 s vs 7-10 s at load 6); one thread costs at most 2x when idle."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def make_toy_imagenet(root, num_train=6, num_val=3, size=48):
    from normdense.data.writers import write_imagenet
    write_imagenet(str(root), num_train=num_train, num_val=num_val, size=size, seed=0)
    return str(root)


def quiet():
    from mmengine.logging import MMLogger
    MMLogger.get_current_instance().setLevel(logging.WARNING)


def config_path(name):
    return osp.join(IMAGENET_DIR, f'{name}.py')


def reduced_cfg(name_or_path, data_root, work_dir, depth=18, crop=64, max_iters=2, batch_size=2):
    """An imagenet config with a ResNet-18 (same norm/conv/stem), toy data, ``max_iters`` iterations and a
    checkpoint at the end; accumulation (micro configs) is cut to 2 so the optimizer steps."""
    path = name_or_path if name_or_path.endswith('.py') else config_path(name_or_path)
    cfg = Config.fromfile(path)
    cfg.model.backbone.depth = depth
    width = cfg.model.backbone.get('base_channels', 64)  # the toy demo's ResNet-18 is half width
    cfg.model.head.in_channels = width * (8 if depth in (18, 34) else 32)
    cfg.model.head.num_classes = len(CLASSES)
    cfg.model.head.topk = (1, )
    cfg.data_preprocessor = dict(cfg.get('data_preprocessor', {}), num_classes=len(CLASSES))
    pipeline = [dict(type='LoadImageFromFile'), dict(type='RandomResizedCrop', scale=crop),
                dict(type='RandomFlip', prob=0.5, direction='horizontal'), dict(type='PackInputs')]
    micro = cfg.train_dataloader.batch_size == 1
    cfg.train_dataloader = dict(
        batch_size=1 if micro else batch_size, num_workers=0, persistent_workers=False,
        sampler=dict(type='InfiniteSampler', shuffle=True),
        dataset=dict(type='ImageNet', data_root=data_root, metainfo=dict(classes=CLASSES), split='train',
                     pipeline=pipeline))
    if cfg.optim_wrapper.get('accumulative_counts', 1) > 1:
        cfg.optim_wrapper.accumulative_counts = 2
    cfg.train_cfg = dict(type='IterBasedTrainLoop', max_iters=max_iters)
    cfg.param_scheduler = []
    for key in ('val_dataloader', 'val_cfg', 'val_evaluator', 'test_dataloader', 'test_cfg', 'test_evaluator'):
        cfg[key] = None
    cfg.default_hooks.checkpoint = dict(type='CheckpointHook', by_epoch=False, interval=max_iters)
    cfg.default_hooks.logger = dict(type='LoggerHook', interval=1)
    cfg.log_processor = dict(by_epoch=False)
    cfg.randomness = dict(seed=0)
    cfg.work_dir = str(work_dir)
    cfg.launcher = 'none'
    return cfg


def pretrain(cfg):
    """Run the Runner; returns the path of the last checkpoint."""
    from mmengine.runner import Runner
    runner = Runner.from_cfg(cfg)
    quiet()
    runner.train()
    return osp.join(cfg.work_dir, f'iter_{cfg.train_cfg.max_iters}.pth')


def build_classifier(cfg, checkpoint=None):
    import mmpretrain.models  # noqa: F401
    from mmengine.registry import init_default_scope
    from mmpretrain.registry import MODELS
    init_default_scope('mmpretrain')
    model = MODELS.build(copy.deepcopy(cfg.model))
    if checkpoint is not None:
        sd = torch.load(checkpoint, map_location='cpu')['state_dict']
        model.load_state_dict(sd, strict=True)
    model.eval()  # (some OpenMMLab train() overrides return None)
    return model


def build_backbone(target, backbone_cfg, checkpoint=None, dtype=torch.float32, **overrides):
    """An mmdet/mmseg backbone from a conversion's backbone cfg, loading ``checkpoint`` through
    PretrainedBackbone (strict) when given, after casting the model to ``dtype``."""
    from mmengine.registry import init_default_scope
    cfg = copy.deepcopy(backbone_cfg)
    cfg.update(out_indices=(0, 1, 2, 3), **overrides)
    if checkpoint is not None:
        cfg['init_cfg'] = dict(type='PretrainedBackbone', checkpoint=checkpoint)
    if target == 'mmdet':
        import mmdet.models  # noqa: F401
        from mmdet.registry import MODELS
    else:
        import mmseg.models  # noqa: F401
        from mmseg.registry import MODELS
    init_default_scope(target)
    quiet()
    model = MODELS.build(cfg).to(dtype)
    model.init_weights()
    model.eval()  # mmdet/mmseg ResNet.train() returns None
    return model
