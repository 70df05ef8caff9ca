"""Every detection config builds (model, dataloaders, hooks); a reduced training step runs for each layer
variant on toy COCO; tools/test.py reports COCO bbox and segm AP for a briefly trained checkpoint."""
import copy
import glob
import os.path as osp
import re
import subprocess
import sys

import pytest
import torch
from mmengine.config import Config
from mmengine.registry import init_default_scope
from mmengine.runner import Runner

import normdense  # noqa: F401
from normdense.data.writers import write_coco
from normdense.layers.bcn import BatchChannelNorm2d
from normdense.layers.ws import WSConv2d

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
DET_CONFIGS = sorted(glob.glob(osp.join(ROOT, 'configs', 'mask_rcnn', '*.py')) +
                     glob.glob(osp.join(ROOT, 'configs', 'faster_rcnn', '*.py')) +
                     glob.glob(osp.join(ROOT, 'configs', 'demo', '*coco.py')) +
                     [osp.join(ROOT, 'configs', 'mask_rcnn_r50_fpn_bcn_ws.py')])
# one config per detector x layer variant gets a real (reduced) training step
STEP_CONFIGS = [c for c in DET_CONFIGS if re.search(r'_r50_fpn_.*_(2x|1x)_coco\.py$', c)]
DEMO_CONFIG = osp.join(ROOT, 'configs', 'demo', 'mask-rcnn_r18_fpn_bcn-ws_toy-coco.py')
CLASSES = ('circle', 'rectangle', 'ring', 'star', 'triangle')


@pytest.fixture(scope='module')
def toy_coco(tmp_path_factory):
    root = tmp_path_factory.mktemp('toy_coco')
    write_coco(str(root), num_train=6, num_val=3, size=96)
    return str(root) + '/'


def point_at_toy_data(cfg, data_root, work_dir):
    """Swap the COCO paths for the toy set and shrink the images; everything else is the config's."""
    cfg.work_dir = work_dir
    for split in ('train', 'val', 'test'):
        loader = cfg[f'{split}_dataloader']
        loader.num_workers = 0
        loader.persistent_workers = False
        loader.batch_size = 1
        ds = loader.dataset
        ds.update(data_root=data_root, metainfo=dict(classes=CLASSES), data_prefix=dict(img=f'{"train" if split == "train" else "val"}/'),
                  ann_file=f'annotations/instances_{"train" if split == "train" else "val"}.json')
        for t in ds.pipeline:
            if t['type'] == 'Resize':
                t['scale'] = (96, 96)
    for split in ('val', 'test'):
        cfg[f'{split}_evaluator'].ann_file = data_root + 'annotations/instances_val.json'
    cfg.model.backbone.init_cfg = None
    return cfg


@pytest.mark.parametrize('path', DET_CONFIGS, ids=lambda p: osp.relpath(p, ROOT))
def test_config_builds(path, toy_coco, tmp_path):
    cfg = point_at_toy_data(Config.fromfile(path), toy_coco, str(tmp_path))
    assert cfg.custom_imports.imports == ['normdense']
    assert cfg.train_dataloader.dataset.type == 'CocoDataset'
    assert cfg.auto_scale_lr.base_batch_size == 16 or '/demo/' in path
    runner = Runner.from_cfg(cfg)
    model = runner.model
    if 'bcn-ws' in path or path.endswith('bcn_ws.py'):
        assert any(isinstance(h, normdense.registry.BCNRateHook) for h in runner.hooks)
        assert isinstance(model.backbone.conv1, WSConv2d) and isinstance(model.backbone.bcn1, BatchChannelNorm2d)
        for head in (model.neck, model.roi_head.bbox_head):
            assert any(isinstance(m, BatchChannelNorm2d) for m in head.modules())
    if 'gn-pn' in path:
        assert type(model.backbone).__name__ == 'PNResNet'
    if 'iternorm' in path:
        assert any(type(m).__name__ == 'IterNorm' for m in model.modules())
    runner.build_dataloader(cfg.train_dataloader)
    assert len(runner.build_dataloader(cfg.val_dataloader).dataset) == 3


def test_missing_pretrained_backbone_says_which_file_and_command(tmp_path):
    cfg = Config.fromfile(osp.join(ROOT, 'configs', 'mask_rcnn_r50_fpn_bcn_ws.py'))
    init_default_scope('mmdet')
    from mmdet.registry import MODELS
    backbone_cfg = copy.deepcopy(cfg.model.backbone)
    backbone_cfg.init_cfg.checkpoint = str(tmp_path / 'resnet50_bcn-ws_in1k.pth')
    backbone = MODELS.build(backbone_cfg)
    with pytest.raises(FileNotFoundError) as err:
        backbone.init_weights()
    assert 'resnet50_bcn-ws_in1k.pth' in str(err.value)
    assert 'tools/convert_checkpoint.py' in str(err.value) and 'configs/imagenet/resnet50_bcn-ws_in1k.py' in str(err.value)


def test_pretrained_backbone_loads_strictly(tmp_path):
    init_default_scope('mmdet')
    from mmdet.registry import MODELS
    cfg = dict(type='ResNet', depth=18, conv_cfg=dict(type='WSConv2d'), norm_cfg=dict(type='BCN', num_groups=32))
    source = MODELS.build(cfg)
    torch.save({'state_dict': source.state_dict(), 'meta': {}}, tmp_path / 'full.pth')
    target = MODELS.build(dict(cfg, init_cfg=dict(type='PretrainedBackbone', checkpoint=str(tmp_path / 'full.pth'))))
    target.init_weights()
    assert all(torch.equal(a, b) for a, b in zip(source.state_dict().values(), target.state_dict().values()))
    partial = {k: v for k, v in source.state_dict().items() if not k.startswith('layer4')}
    torch.save({'state_dict': partial}, tmp_path / 'partial.pth')
    target = MODELS.build(dict(cfg, init_cfg=dict(type='PretrainedBackbone', checkpoint=str(tmp_path / 'partial.pth'))))
    with pytest.raises(RuntimeError, match='layer4'):
        target.init_weights()


@pytest.mark.slow
@pytest.mark.parametrize('path', STEP_CONFIGS, ids=lambda p: osp.basename(p))
def test_reduced_training_step(path, toy_coco, tmp_path):
    """Two iterations through the config's own Runner, hooks and pipeline; reduced to ResNet-18 (depth
    only: the layer choices, FPN and heads are the config's) on 96x96 toy images."""
    cfg = point_at_toy_data(Config.fromfile(path), toy_coco, str(tmp_path))
    cfg.model.backbone.depth = 18
    cfg.model.neck.in_channels = [64, 128, 256, 512]
    cfg.train_cfg = dict(type='IterBasedTrainLoop', max_iters=2, val_interval=100)
    cfg.param_scheduler = []
    cfg.default_hooks.checkpoint = dict(type='CheckpointHook', interval=100)
    cfg.pop('val_dataloader'), cfg.pop('val_evaluator'), cfg.pop('val_cfg')
    cfg.train_dataloader.sampler = dict(type='InfiniteSampler', shuffle=True)
    runner = Runner.from_cfg(cfg)
    before = {k: v.clone() for k, v in runner.model.state_dict().items()}
    runner.train()
    after = runner.model.state_dict()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert any(k.startswith('backbone.') for k in changed) and any(k.startswith('roi_head.') for k in changed)
    if 'bcn-ws' in path:
        assert any(k.endswith('running_mean') for k in changed)  # estimates moved with r = lr


@pytest.mark.slow
def test_tools_test_reports_coco_bbox_and_segm_ap(toy_coco, tmp_path):
    """Train the demo config for a few iterations with tools/train.py, then evaluate with tools/test.py."""
    opts = [f'train_dataloader.dataset.data_root={toy_coco}', f'val_dataloader.dataset.data_root={toy_coco}',
            f'test_dataloader.dataset.data_root={toy_coco}',
            f'val_evaluator.ann_file={toy_coco}annotations/instances_val.json',
            f'test_evaluator.ann_file={toy_coco}annotations/instances_val.json',
            'train_cfg.max_iters=3', 'train_cfg.val_interval=3', 'default_hooks.checkpoint.interval=3',
            'model.backbone.init_cfg=None']  # from scratch: the demo's pretrained backbone is not needed here
    work = tmp_path / 'work'
    run = lambda *a: subprocess.run([sys.executable, *a], cwd=ROOT, capture_output=True, text=True, timeout=600)
    trained = run('tools/train.py', DEMO_CONFIG, '--work-dir', str(work), '--cfg-options', *opts)
    assert trained.returncode == 0, trained.stderr[-3000:]
    tested = run('tools/test.py', DEMO_CONFIG, str(work / 'iter_3.pth'), '--work-dir', str(work),
                 '--out', str(tmp_path / 'preds.pkl'), '--cfg-options', *opts)
    assert tested.returncode == 0, tested.stderr[-3000:]
    log = tested.stdout + tested.stderr
    for metric in ('coco/bbox_mAP', 'coco/segm_mAP', 'coco/bbox_mAP_50'):
        assert metric in log
    assert (tmp_path / 'preds.pkl').is_file()
