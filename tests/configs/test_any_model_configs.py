"""The configs beyond the seeds' models (RetinaNet, FCOS, Cascade Mask R-CNN, UPerNet, PSPNet; GN+WS and BCN+WS):
each builds through mmengine's Runner with its hooks, has the norm in every slot (the same layer counts as the
norm switch on mmdet's / mmseg's own config gives), and takes a training step at ResNet-18 depth on small
random images."""
import glob
import os.path as osp
import tempfile

import pytest
import torch
from mmengine.config import Config
from mmengine.runner import Runner

import normdense  # noqa: F401
from normdense.model_convert import model_census
from normdense.norm_switch import switch_norm
from tests.mm_models import det_train_step, seg_train_step

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
CONFIGS = sorted(p for d in ('retinanet', 'fcos', 'cascade_rcnn', 'upernet', 'pspnet')
                 for p in glob.glob(osp.join(ROOT, 'configs', d, '*.py')))
NORM_TYPE = {'bcn-ws': 'BatchChannelNorm2d', 'gn-ws': 'GroupNorm'}


def norm_of(path):
    return 'bcn-ws' if 'bcn-ws' in path else 'gn-ws'


def test_every_folder_has_both_norms_and_a_readme():
    assert len(CONFIGS) == 10
    for d in ('retinanet', 'fcos', 'cascade_rcnn', 'upernet', 'pspnet'):
        assert osp.isfile(osp.join(ROOT, 'configs', d, 'README.md'))


@pytest.mark.parametrize('path', CONFIGS, ids=lambda p: osp.basename(p))
def test_builds_with_the_norm_in_every_slot(path):
    cfg = Config.fromfile(path)
    cfg.work_dir = tempfile.mkdtemp()
    runner = Runner.from_cfg(cfg)
    census = model_census(runner.model)
    norm = NORM_TYPE[norm_of(path)]
    # every conv feeding a norm is WS, every norm is the chosen one; only predictors stay plain convs
    assert census[norm] == census['WSConv2d'] and set(census) == {norm, 'WSConv2d', 'Conv2d'}
    assert census['Conv2d'] <= 6
    hooks = [type(h).__name__ for h in runner.hooks]
    assert ('BCNRateHook' in hooks or 'EstimateRateHook' in hooks) == (norm_of(path) == 'bcn-ws')
    # the explicit config is the norm switch applied to the codebase's own config
    base = [b for b in Config._get_base_files(path) if '::' in b][0]
    scope, rel = base.split('::')
    own = Config.fromfile(osp.join(osp.dirname(__import__(scope).__file__), '.mim', 'configs', rel))
    switch_norm(own, norm_of(path))
    from mmengine.registry import init_default_scope
    init_default_scope(scope)
    registry = __import__(f'{scope}.registry', fromlist=['MODELS']).MODELS
    own.model.pop('pretrained', None)
    if 'fcos' in path:
        own.model.backbone.style = 'pytorch'  # the config's one difference besides the layers
    own.model.backbone.type = cfg.model.backbone.type  # GN+WS seg: the 7x7-stem ResNet of the jhu weights
    assert model_census(registry.build(own.model)) == census


def reduced(path):
    """The config's model at ResNet-18 depth and small widths: the layer choices are the config's."""
    model = Config.fromfile(path).model
    model.pop('pretrained', None)
    model.backbone.depth = 18
    model.backbone.init_cfg = None
    if 'neck' in model:
        model.neck.in_channels = [64, 128, 256, 512]
        model.neck.out_channels = 64
        head = model.get('bbox_head') or model.get('rpn_head')
        head.update(in_channels=64, feat_channels=64)
    if 'roi_head' in model:
        model.rpn_head.update(in_channels=64, feat_channels=64)
        for key in ('bbox_roi_extractor', 'mask_roi_extractor'):
            model.roi_head[key].out_channels = 64
        for head in model.roi_head.bbox_head:
            head.update(in_channels=64, fc_out_channels=128)
        model.roi_head.mask_head.update(in_channels=64, conv_out_channels=64)
        for stage in model.train_cfg.rcnn:
            stage.sampler.num = 32
        model.train_cfg.rpn_proposal.update(nms_pre=200, max_per_img=64)
    if 'decode_head' in model:
        upernet = model.decode_head.type == 'UPerHead'
        model.decode_head.update(in_channels=[64, 128, 256, 512] if upernet else 512, channels=64)
        model.auxiliary_head.update(in_channels=256, channels=64)
        model.data_preprocessor.size = None
        model.data_preprocessor.size_divisor = 32
    return model


@pytest.mark.parametrize('path', CONFIGS, ids=lambda p: osp.basename(p))
def test_training_step(path):
    model_cfg = reduced(path)
    if 'decode_head' in model_cfg:
        model, losses = seg_train_step(model_cfg, image_size=(64, 64), batch_size=1, num_classes=4)
    else:
        model, losses = det_train_step(model_cfg, image_size=(96, 128), batch_size=1)
    assert losses and all(torch.isfinite(torch.tensor(v)) for v in losses.values())
    if norm_of(path) == 'bcn-ws':  # estimates moved at r = lr, every layer, shared heads included
        from normdense.layers import BatchChannelNorm2d
        # frozen stages (mmdet's frozen_stages=1) are in eval mode: their estimates stay
        still = [n for n, m in model.named_modules() if isinstance(m, BatchChannelNorm2d) and m.training
                 and torch.equal(m.running_mean, torch.zeros_like(m.running_mean))]
        # random boxes may give a cascade stage no positive RoI for its mask head: nothing to normalize there
        assert not [n for n in still if not n.startswith('roi_head.mask_head')], still
