"""configs/imagenet: every pretraining config reads, carries the paper's recipe and the right layers, runs
its own data pipeline on a toy ImageNet, and builds + takes a training step (reduced to ResNet-18 here;
the full R-50/R-101 models in the slow test). Also: every checkpoint name that another config loads via
PretrainedBackbone has an ImageNet config producing it."""
import glob
import os.path as osp
import re

import pytest
import torch
from mmengine.config import Config

from normdense.layers import set_update_rate
from tests.pretrain_utils import (IMAGENET_CONFIGS, ROOT, TOY_CONFIG, config_path, make_toy_imagenet, quiet,
                                  reduced_cfg)
from tests.pretrain_utils import single_thread  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures('single_thread')

NAME = re.compile(r'resnet(?P<depth>50|101)(?P<v1c>-v1c)?_(?P<norm>gn|gn-ws|bn-ws|bcn-ws|bcn-ws-micro|gn-pn|'
                  r'iternorm)_in1k$')
REQUIRED = ([f'resnet{d}_{n}_in1k' for d in (50, 101) for n in ('gn-ws', 'bcn-ws', 'bcn-ws-micro', 'gn-pn', 'iternorm')]
            + [f'resnet101-v1c_{n}_in1k' for n in ('gn', 'gn-ws', 'bcn-ws', 'gn-pn', 'iternorm')])
NORM_TYPE = {'gn': 'GN', 'gn-ws': 'GN', 'bn-ws': 'BN', 'bcn-ws': 'BCN', 'bcn-ws-micro': 'BCN', 'gn-pn': 'GNPN',
             'iternorm': 'IterNorm'}


@pytest.fixture(scope='module')
def toy_imagenet(tmp_path_factory):
    return make_toy_imagenet(tmp_path_factory.mktemp('toy_imagenet'), num_train=5, num_val=2, size=64)


def test_required_configs_exist():
    missing = [n for n in REQUIRED if n not in IMAGENET_CONFIGS]
    assert not missing
    assert all(NAME.match(n) for n in IMAGENET_CONFIGS), IMAGENET_CONFIGS


def test_every_referenced_backbone_checkpoint_has_a_pretraining_config():
    """Detection/segmentation configs load checkpoints/<name>_in1k.pth: each must come from
    configs/imagenet/<name>_in1k.py (and the produced_by hint must name that config)."""
    referenced = {}
    for path in glob.glob(osp.join(ROOT, 'configs', '**', '*.py'), recursive=True):
        if osp.join('configs', 'imagenet') in path:
            continue
        for name in re.findall(r"checkpoints/([\w.-]+?_in1k)\.pth", open(path).read()):
            referenced.setdefault(name, []).append(osp.relpath(path, ROOT))
        for name in re.findall(r'configs/imagenet/([\w.-]+?)\.py', open(path).read()):
            referenced.setdefault(name, []).append(osp.relpath(path, ROOT))
    unknown = {name: paths for name, paths in referenced.items() if name not in IMAGENET_CONFIGS}
    assert not unknown, f'checkpoints without a configs/imagenet config: {unknown}'


@pytest.mark.parametrize('name', IMAGENET_CONFIGS)
def test_config_recipe_and_layers(name):
    cfg = Config.fromfile(config_path(name))
    parts = NAME.match(name).groupdict()
    assert 'normdense' in cfg.custom_imports['imports'] and cfg.default_scope == 'mmpretrain'
    assert cfg.model.type == 'ImageClassifier'
    backbone = cfg.model.backbone
    assert backbone.depth == int(parts['depth'])
    expected_type = ('PNResNet' if parts['norm'] == 'gn-pn' else 'ResNet') + ('V1c' if parts['v1c'] else '')
    assert backbone.type == expected_type
    norm_cfg = backbone.get('norm_cfg', dict(type='BN'))  # mmpretrain ResNet's default is BN
    assert norm_cfg['type'] == NORM_TYPE[parts['norm']]
    assert norm_cfg.get('num_groups', 32) == 32 and norm_cfg.get('group_size', 64) == 64
    conv_cfg = backbone.get('conv_cfg')
    assert (conv_cfg is not None and conv_cfg['type'] == 'WSConv2d') == parts['norm'].endswith(('-ws', '-ws-micro'))
    hooks = [h['type'] for h in cfg.get('custom_hooks', [])]
    estimate = norm_cfg['type'] == 'BCN' and norm_cfg.get('mode', 'estimate') == 'estimate'
    assert estimate == (parts['norm'] == 'bcn-ws-micro')
    assert ('BCNRateHook' in hooks) == estimate  # required with estimate-mode BCN, useless otherwise
    if parts['norm'] == 'gn-pn':
        assert 'ProxyNormCheckHook' in hooks
    # the WS/BCN paper's recipe: SGD lr 0.1, momentum 0.9, wd 1e-4, 90 epochs, x0.1 every 30, batch 256
    opt = cfg.optim_wrapper.optimizer
    assert (opt.type, opt.lr, opt.momentum, opt.weight_decay) == ('SGD', 0.1, 0.9, 1e-4)
    assert cfg.train_cfg.max_epochs == 90 and cfg.train_cfg.by_epoch
    sched = cfg.param_scheduler
    assert (sched.type, list(sched.milestones), sched.gamma) == ('MultiStepLR', [30, 60], 0.1)
    per_gpu = cfg.train_dataloader.batch_size
    accumulate = cfg.optim_wrapper.get('accumulative_counts', 1)
    assert per_gpu * accumulate * 4 == 256  # 4 GPUs, as the paper
    if parts['norm'] == 'bcn-ws-micro':
        assert (per_gpu, accumulate) == (1, 64)
        assert cfg.auto_scale_lr.base_batch_size == 4  # mmengine counts GPUs x images, not accumulation
    else:
        assert (per_gpu, accumulate) == (64, 1) and cfg.auto_scale_lr.base_batch_size == 256
    assert cfg.model.head.num_classes == 1000 and cfg.model.head.in_channels == 2048


@pytest.mark.parametrize('name', IMAGENET_CONFIGS)
def test_config_data_pipelines(name, toy_imagenet):
    """The config's own train/val pipelines on a toy ImageNet (data_root swapped, 5 classes)."""
    import mmpretrain.datasets  # noqa: F401
    from mmengine.registry import init_default_scope
    from mmpretrain.registry import DATASETS
    init_default_scope('mmpretrain')
    cfg = Config.fromfile(config_path(name))
    for loader, size in ((cfg.train_dataloader, 224), (cfg.val_dataloader, 224)):
        dataset_cfg = dict(loader.dataset, data_root=toy_imagenet,
                           metainfo=dict(classes=('circle', 'rectangle', 'ring', 'star', 'triangle')))
        item = DATASETS.build(dataset_cfg)[0]
        assert tuple(item['inputs'].shape) == (3, size, size)


def reduced_train_step(cfg, image_size=64, batch=2):
    """Build the config's classifier and run one train_step through the config's optim_wrapper and
    data_preprocessor. Estimate-mode BCN gets its rate only if the config has BCNRateHook."""
    import mmpretrain.models  # noqa: F401
    from mmengine.optim import build_optim_wrapper
    from mmengine.registry import init_default_scope
    from mmpretrain.registry import MODELS
    from mmpretrain.structures import DataSample
    init_default_scope('mmpretrain')
    quiet()
    model_cfg = dict(cfg.model)
    model_cfg.setdefault('data_preprocessor', cfg.get('data_preprocessor'))
    model = MODELS.build(model_cfg)
    model.init_weights()
    optim = build_optim_wrapper(model, cfg.optim_wrapper)
    if any(h['type'] == 'BCNRateHook' for h in cfg.get('custom_hooks', [])):
        set_update_rate(model, optim.get_lr()['lr'][0])  # what the hook does before each iteration
    g = torch.Generator().manual_seed(0)
    data = dict(inputs=[torch.randint(0, 256, (3, image_size, image_size), dtype=torch.uint8, generator=g)
                        for _ in range(batch)],
                data_samples=[DataSample().set_gt_label(i % model.head.num_classes) for i in range(batch)])
    model.train()
    before = [p.detach().clone() for p in model.parameters()]
    losses = model.train_step(data, optim)
    assert torch.isfinite(losses['loss']), losses
    return model, before, optim


@pytest.mark.parametrize('name', IMAGENET_CONFIGS)
def test_config_builds_and_steps_reduced(name, tmp_path):
    """The config with its backbone shrunk to ResNet-18 (same norm/conv/stem/optimizer/hooks)."""
    cfg = reduced_cfg(name, str(tmp_path), tmp_path / 'work')
    model, before, optim = reduced_train_step(cfg)
    moved = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    # micro configs accumulate (2 after reduction): the first step only accumulates gradients
    assert moved == (cfg.optim_wrapper.get('accumulative_counts', 1) == 1)


@pytest.mark.slow
@pytest.mark.parametrize('name', IMAGENET_CONFIGS)
def test_config_builds_and_steps_full_depth(name):
    cfg = Config.fromfile(config_path(name))
    model, _, _ = reduced_train_step(cfg, image_size=64, batch=2)
    n_blocks = sum(len(getattr(model.backbone, f'layer{i}')) for i in range(1, 5))
    assert n_blocks == {50: 16, 101: 33}[cfg.model.backbone.depth]


def test_missing_rate_hook_is_caught(tmp_path):
    cfg = reduced_cfg('resnet50_bcn-ws-micro_in1k', str(tmp_path), tmp_path / 'work')
    cfg.custom_hooks = []
    with pytest.raises(RuntimeError, match='BCNRateHook'):
        reduced_train_step(cfg)


def test_toy_demo_config():
    cfg = Config.fromfile(TOY_CONFIG)
    assert 'normdense' in cfg.custom_imports['imports']
    assert cfg.model.backbone.depth == 18 and cfg.model.head.num_classes == 5
    assert cfg.model.backbone.norm_cfg == dict(type='BCN', num_groups=16, mode='estimate')
    assert cfg.model.backbone.conv_cfg == dict(type='WSConv2d')
    # half width: the same channels per BCN group as the paper's full-width ResNet with 32 groups
    assert cfg.model.backbone.base_channels == cfg.model.backbone.stem_channels == 32
    assert cfg.model.head.in_channels == 8 * cfg.model.backbone.base_channels
    assert [h['type'] for h in cfg.custom_hooks] == ['BCNRateHook']
    assert cfg.train_cfg.type == 'IterBasedTrainLoop'
    assert cfg.default_hooks.checkpoint.interval == cfg.train_cfg.max_iters  # iter_<max_iters>.pth
    demo_det = osp.join(ROOT, 'configs', 'demo', 'mask-rcnn_r18_fpn_bcn-ws_toy-coco.py')
    if osp.isfile(demo_det):  # the detection demo that fine-tunes from it uses the same layers
        det = Config.fromfile(demo_det)
        assert det.model.backbone.depth == 18
        assert det.model.backbone.base_channels == cfg.model.backbone.base_channels
        assert det.model.backbone.get('stem_channels') in (None, cfg.model.backbone.stem_channels)
        assert det.model.neck.in_channels == [cfg.model.backbone.base_channels * 2**i for i in range(4)]
        det_norm = {k: det.model.backbone.norm_cfg[k] for k in ('type', 'num_groups', 'mode')}
        assert det_norm == cfg.model.backbone.norm_cfg  # (mmdet's base adds requires_grad=True)
        assert det.model.backbone.conv_cfg['type'] == 'WSConv2d'


def _referencing_configs():
    """{imagenet config name: [downstream config paths that load checkpoints/<name>.pth]}"""
    refs = {}
    for path in sorted(glob.glob(osp.join(ROOT, 'configs', '**', '*.py'), recursive=True)):
        if osp.join('configs', 'imagenet') in path:
            continue
        for name in set(re.findall(r"checkpoints/([\w.-]+?_in1k)\.pth", open(path).read())):
            refs.setdefault(name, []).append(path)
    return refs


REFERENCED = _referencing_configs()


@pytest.mark.slow
@pytest.mark.parametrize('name', sorted(REFERENCED))
def test_downstream_configs_load_the_converted_backbone(name, tmp_path):
    """Full depth, initial weights: the classifier of configs/imagenet/<name>.py, saved as a Runner checkpoint
    (with its config in meta), converted, loads strictly into the backbone of every detection/segmentation
    config that names checkpoints/<name>.pth (same norm groups, IterNorm group size, WS, PN wiring)."""
    import mmpretrain.models  # noqa: F401
    from mmengine.registry import DefaultScope
    from mmpretrain.registry import MODELS as CLS_MODELS

    from normdense.convert.backbone import convert_backbone, save_backbone_checkpoint
    cfg = Config.fromfile(config_path(name))
    with DefaultScope.overwrite_default_scope('mmpretrain'):
        classifier = CLS_MODELS.build(cfg.model)
    ckpt = dict(state_dict=classifier.state_dict(), meta=dict(cfg=cfg.pretty_text, epoch=90))
    seen, converted = set(), {}
    for path in REFERENCED[name]:
        downstream = Config.fromfile(path)
        scope = downstream.default_scope
        backbone_cfg = downstream.model.backbone.to_dict()
        init_cfg = backbone_cfg.pop('init_cfg', None) or {}
        assert init_cfg.get('type') == 'PretrainedBackbone', (path, init_cfg)
        assert init_cfg['checkpoint'] == f'checkpoints/{name}.pth'
        assert f'configs/imagenet/{name}.py' in init_cfg.get('produced_by', ''), path
        target = {'mmdet': 'mmdet', 'mmseg': 'mmseg'}[scope]
        assert f'--to {target}' in init_cfg['produced_by'], path
        key = (target, repr(sorted(backbone_cfg.items(), key=lambda kv: kv[0])))
        if key in seen:
            continue
        seen.add(key)
        if target not in converted:
            conv = convert_backbone(ckpt, target)
            assert conv.complete, conv.report()
            converted[target] = str(tmp_path / target / f'{name}.pth')
            save_backbone_checkpoint(conv, converted[target])
        backbone_cfg['init_cfg'] = dict(type='PretrainedBackbone', checkpoint=converted[target])
        if target == 'mmdet':
            import mmdet.models  # noqa: F401
            from mmdet.registry import MODELS
        else:
            import mmseg.models  # noqa: F401
            from mmseg.registry import MODELS
        with DefaultScope.overwrite_default_scope(target):
            quiet()
            backbone = MODELS.build(backbone_cfg)
            backbone.init_weights()  # strict: raises on any missing/unexpected/mis-shaped key
        loaded = backbone.state_dict()
        for k, v in torch.load(converted[target])['state_dict'].items():
            assert torch.equal(loaded[k], v), (path, k)
