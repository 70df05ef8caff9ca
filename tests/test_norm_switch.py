"""The norm switch (normdense/norm_switch.py) on mmdet's and mmseg's own configs: every norm and conv slot
switched (counted in the built model), excluded slots untouched, the summary printed; the config form
through mmengine's RUNNERS as the codebases' own train.py/test.py build it, and --norm of tools/."""
import os.path as osp

import pytest
import torch.nn as nn
from mmengine.config import Config
from mmengine.registry import RUNNERS

import normdense
from normdense import jobs
from normdense.layers import BatchChannelNorm2d, GroupNorm, GroupProxyNorm, WSConv2d
from normdense.model_convert import _is_norm
from normdense.norm_switch import switch_norm
from tests.mm_models import base_config

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
SWITCH_BASE = osp.join(ROOT, 'configs', '_base_', 'norm_switch.py')


def write_config(tmp_path, base, body=''):
    path = tmp_path / 'switched.py'
    path.write_text(f'_base_ = [{base!r}, {SWITCH_BASE!r}]\n{body}\n')
    return str(path)


def build_like_codebase_tools(path, tmp_path):
    """What mmdet's / mmseg's tools/train.py do: Config.fromfile, then RUNNERS.build when runner_type is set."""
    cfg = Config.fromfile(path)
    cfg.work_dir = str(tmp_path / 'work')
    assert 'runner_type' in cfg
    return RUNNERS.build(cfg)


def layers(model, cls):
    return [n for n, m in model.named_modules() if type(m) is cls]


def test_retinanet_bcn_ws_every_slot_switched(tmp_path, capsys):
    path = write_config(tmp_path, 'mmdet::retinanet/retinanet_r50_fpn_1x_coco.py',
                        "normdense_norm = 'bcn-ws'\nmodel = dict(backbone=dict(init_cfg=None))")
    runner = build_like_codebase_tools(path, tmp_path)
    model = runner.model
    norms = [m for m in model.modules() if _is_norm(m)]
    # backbone 53, FPN 8 (3 lateral, 3 output, 2 extra), RetinaHead 8 (4 cls + 4 reg convs)
    assert len(norms) == 53 + 8 + 8 and all(type(m) is BatchChannelNorm2d for m in norms)
    assert len(layers(model, WSConv2d)) == 69
    assert sorted(layers(model, nn.Conv2d)) == ['bbox_head.retina_cls', 'bbox_head.retina_reg']  # predictors
    assert any(type(h).__name__ == 'EstimateRateHook' for h in runner.hooks)
    table = runner.normdense_switch.table()
    assert 'model.bbox_head' in table and 'RetinaHead' in table and 'BCN/WSConv2d' in table
    assert 'bbox_head.retina_cls (Conv2d): feeds no norm' in table
    assert 'built model: ' in table and 'BatchChannelNorm2d x69' in table


def test_cascade_mask_rcnn_gn_ws_excluded_slot_untouched(tmp_path):
    path = write_config(tmp_path, 'mmdet::cascade_rcnn/cascade-mask-rcnn_r50_fpn_1x_coco.py',
                        "normdense_norm = dict(norm='gn-ws', exclude=['roi_head.mask_head'])\n"
                        "model = dict(backbone=dict(init_cfg=None))")
    runner = build_like_codebase_tools(path, tmp_path)
    model = runner.model
    norms = [(n, m) for n, m in model.named_modules() if _is_norm(m)]
    assert len(norms) == 53 + 8 and all(type(m) is GroupNorm and m.num_groups == 32 for _, m in norms)  # backbone + FPN
    assert not any(n.startswith('roi_head.mask_head') for n, _ in norms)
    mask_convs = [n for n in layers(model, nn.Conv2d) if n.startswith('roi_head.mask_head')]
    assert len([n for n in mask_convs if '.convs.' in n]) == 3 * 4  # 3 stages x 4 convs: untouched, plain
    assert not any(n.startswith(('roi_head.mask_head', 'rpn_head')) for n in layers(model, WSConv2d))
    assert len(layers(model, WSConv2d)) == 53 + 8
    table = runner.normdense_switch.table()
    assert 'model.roi_head.mask_head' in table and 'left: excluded' in table
    assert 'model.rpn_head' in table and 'takes no norm_cfg' in table
    for i in range(3):
        assert f'model.roi_head.bbox_head[{i}]' in table


def test_upernet_gn_pn_and_bcn_ws(tmp_path):
    base = 'mmseg::upernet/upernet_r50_4xb4-40k_voc12aug-512x512.py'
    path = write_config(tmp_path, base, "normdense_norm = 'gn-pn'\nmodel = dict(pretrained=None)")
    runner = build_like_codebase_tools(path, tmp_path)
    model = runner.model
    assert type(model.backbone).__name__ == 'PNResNetV1c'
    assert any(isinstance(m, GroupProxyNorm) for m in model.backbone.modules())
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    assert any(type(h).__name__ == 'ProxyNormCheckHook' for h in runner.hooks)
    assert runner.cfg.optim_wrapper.paramwise_cfg.custom_keys['.proxy_beta'] == dict(decay_mult=1.0)

    cfg = Config.fromfile(base.replace('mmseg::', osp.join(osp.dirname(__import__('mmseg').__file__),
                                                             '.mim', 'configs') + '/'))
    report = switch_norm(cfg, 'bcn-ws')
    assert [r[0] for r in report.switched] == ['model.backbone', 'model.decode_head', 'model.auxiliary_head']
    cfg.model.pretrained = None
    from mmseg.registry import MODELS
    from mmengine.registry import init_default_scope
    init_default_scope('mmseg')
    built = MODELS.build(cfg.model)
    norms = [m for m in built.modules() if _is_norm(m)]
    assert norms and all(type(m) is BatchChannelNorm2d for m in norms)
    assert sorted(layers(built, nn.Conv2d)) == ['auxiliary_head.conv_seg', 'decode_head.conv_seg']
    assert len(layers(built, WSConv2d)) == len(norms)


def test_hard_coded_bn_listed_then_converted_with_convert_true(tmp_path):
    from mmengine.model import BaseModel
    from mmengine.registry import MODELS

    @MODELS.register_module(force=True)
    class HardCodedBNNet(BaseModel):
        def __init__(self, norm_cfg=None):
            super().__init__()
            self.body = nn.Sequential(nn.Conv2d(3, 32, 3), nn.BatchNorm2d(32), nn.ReLU())

        def forward(self, inputs, data_samples=None, mode='tensor'):
            return self.body(inputs)

    cfg = Config(dict(model=dict(type='HardCodedBNNet'), work_dir=str(tmp_path), runner_type='NormSwitchRunner',
                      normdense_norm='bcn-ws'))
    runner = RUNNERS.build(cfg)
    assert type(runner.model.body[1]) is nn.BatchNorm2d
    assert 'body.1 (BatchNorm2d): hard-coded, not converted to BCN' in runner.normdense_switch.table()
    cfg.normdense_norm = dict(norm='bcn-ws', convert=True)
    runner = RUNNERS.build(cfg)
    assert type(runner.model.body[1]) is BatchChannelNorm2d and type(runner.model.body[0]) is WSConv2d
    assert 'converted' in runner.normdense_switch.table()


def test_tools_norm_argument_and_errors(tmp_path):
    config = osp.join(ROOT, 'configs', 'demo', 'deeplabv3_r18-d8_bcn-ws_toy-voc.py')
    args = jobs.parse_args(jobs.train_arg_parser(), [config, '--norm', 'gn-ws', '--work-dir', str(tmp_path)])
    cfg = jobs.load_config(args.config, None, 'none', args.work_dir)
    jobs.apply_norm_arg(cfg, args.norm)
    assert cfg.runner_type == 'NormSwitchRunner' and cfg.normdense_norm == 'gn-ws'
    args = jobs.parse_args(jobs.test_arg_parser(), [config, 'x.pth', '--norm', 'iternorm'])
    assert args.norm == 'iternorm'
    with pytest.raises(SystemExit):
        jobs.parse_args(jobs.train_arg_parser(), [config, '--norm', 'batchchannel'])
    with pytest.raises(ValueError, match='choose one of bn, gn, gn-ws, bcn-ws, gn-pn, iternorm, unitization'):
        switch_norm(cfg, 'bcn')
    cfg.normdense_norm = 'bcn'  # a config's own name is checked before the runner is built
    args = jobs.parse_args(jobs.train_arg_parser(), [config, '--work-dir', str(tmp_path)])
    with pytest.raises(ValueError, match='unknown norm .bcn.; choose one of'):
        jobs.apply_norm_arg(cfg, args.norm)
    cfg.normdense_norm = None
    cfg.runner_type = 'FlexibleRunner'
    with pytest.raises(ValueError, match='normdense.switch_norm'):
        jobs.apply_norm_arg(cfg, 'gn')
    assert normdense.NORM_CHOICES[0] == 'bn'


def test_switch_is_idempotent_and_keeps_existing_rate_hook():
    cfg = Config(dict(default_scope='mmdet', custom_hooks=[dict(type='BCNRateHook')],
                      model=dict(type='RetinaNet', backbone=dict(type='ResNet', depth=18),
                                 neck=dict(type='FPN', in_channels=[64], out_channels=8, num_outs=1))))
    first = switch_norm(cfg, 'bcn-ws').table()
    again = switch_norm(cfg, 'bcn-ws')
    assert [h['type'] for h in cfg.custom_hooks] == ['BCNRateHook']
    assert cfg.custom_imports.imports == ['normdense'] and len(again.switched) == 2 and first


EXPECTED = {'bn': ('BatchNorm2d', ), 'gn': ('GroupNorm', ), 'gn-ws': ('GroupNorm', ),
            'bcn-ws': ('BatchChannelNorm2d', ),
            'gn-pn': ('GroupProxyNorm', 'GroupNorm'), 'iternorm': ('IterNorm', ), 'unitization': ('Unitization2d', )}


@pytest.mark.parametrize('norm', list(EXPECTED))
def test_every_choice_on_a_small_retinanet(norm):
    """Each name of the switch, counted in a built RetinaNet R-18 (backbone, FPN, shared head)."""
    from mmdet.registry import MODELS
    from mmengine.registry import init_default_scope
    cfg = Config(dict(default_scope='mmdet', optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.01)), model=dict(
        type='RetinaNet', data_preprocessor=dict(type='DetDataPreprocessor'),
        backbone=dict(type='ResNet', depth=18, out_indices=(1, 2, 3), norm_eval=True),
        neck=dict(type='FPN', in_channels=[128, 256, 512], out_channels=64, num_outs=3),
        bbox_head=dict(type='RetinaHead', num_classes=3, in_channels=64, feat_channels=64,
                       anchor_generator=dict(type='AnchorGenerator', octave_base_scale=4, scales_per_octave=3,
                                             ratios=[0.5, 1.0, 2.0], strides=[8, 16, 32]),
                       bbox_coder=dict(type='DeltaXYWHBBoxCoder'), loss_cls=dict(type='FocalLoss'),
                       loss_bbox=dict(type='L1Loss')))))
    report = switch_norm(cfg, dict(norm=norm, num_groups=16))
    assert len(report.switched) == 3
    assert cfg.model.backbone.norm_eval is (norm == 'bn')  # BN keeps the config's frozen statistics
    init_default_scope('mmdet')
    model = MODELS.build(cfg.model)
    norms = {type(m).__name__ for m in model.modules() if _is_norm(m)}
    assert norms == set(EXPECTED[norm])
    ws = [n for n, m in model.named_modules() if isinstance(m, WSConv2d)]
    assert bool(ws) == norm.endswith('-ws')
    if norm == 'gn-pn':
        assert type(model.backbone).__name__ == 'PNResNet' and 'paramwise_cfg' in cfg.optim_wrapper


@pytest.mark.slow  # ~1 min: two subprocesses, each importing mmseg and running a Runner
def test_mmseg_own_train_and_test_scripts_take_the_config_form(tmp_path):
    """mmseg's own tools/train.py and tools/test.py (shipped in its wheel) on a config that only sets
    normdense_norm: the runner switches the model in both, so the trained checkpoint loads strictly."""
    import subprocess
    import sys
    from normdense.data.writers import write_voc
    write_voc(str(tmp_path / 'data' / 'toy_voc'), num_train=4, num_val=2, num_aug=4)
    demo = osp.join(ROOT, 'configs', 'demo', 'deeplabv3_r18-d8_bcn-ws_toy-voc.py')
    path = tmp_path / 'cfg.py'
    # the demo sets custom_imports already: the two lines of norm_switch.py go into the config itself
    path.write_text(f'_base_ = [{demo!r}]\nrunner_type = "NormSwitchRunner"\n'
                    'normdense_norm = dict(norm="gn-ws", num_groups=16)\n'
                    'custom_hooks = []\ntrain_cfg = dict(max_iters=2, val_interval=2)\n'
                    'default_hooks = dict(checkpoint=dict(interval=2))\n')
    tools = osp.join(osp.dirname(__import__('mmseg').__file__), '.mim', 'tools')
    env = dict(__import__('os').environ, PYTHONPATH=ROOT)
    run = lambda *a: subprocess.run([sys.executable, *a], cwd=str(tmp_path), env=env, capture_output=True,
                                    text=True, timeout=600)
    trained = run(osp.join(tools, 'train.py'), str(path), '--work-dir', str(tmp_path / 'work'))
    log = trained.stdout + trained.stderr
    assert trained.returncode == 0, log[-3000:]
    assert 'normdense norm switch: gn-ws (2 slots switched' in log and 'GroupNorm x' in log and 'mIoU' in log
    # mmseg 1.2.2's own tools/test.py builds Runner.from_cfg and ignores runner_type: the model-type form
    model_type = tmp_path / 'model_type.py'
    model_type.write_text(f'_base_ = [{demo!r}]\nmodel = dict(_delete_=True, type="NormSwitched", norm="gn-ws", '
                          'num_groups=16, model={{_base_.model}})\ncustom_hooks = []\n')
    tested = run(osp.join(tools, 'test.py'), str(model_type), str(tmp_path / 'work' / 'iter_2.pth'), '--work-dir',
                 str(tmp_path / 'test'))
    log = tested.stdout + tested.stderr
    assert tested.returncode == 0, log[-3000:]
    assert 'normdense norm switch: gn-ws' in log and 'mIoU' in log
    assert 'do not match exactly' not in log  # the runner form's checkpoint loads into the model-type form


def test_model_type_form_with_a_plain_runner(tmp_path):
    cfg_path = tmp_path / 'cfg.py'
    cfg_path.write_text("_base_ = ['mmdet::retinanet/retinanet_r50_fpn_1x_coco.py']\n"
                        "custom_imports = dict(imports=['normdense'], allow_failed_imports=False)\n"
                        "model = dict(_delete_=True, type='NormSwitched', norm='bcn-ws', model={{_base_.model}})\n"
                        "custom_hooks = [dict(type='EstimateRateHook')]\n")
    cfg = Config.fromfile(str(cfg_path))
    cfg.model.model.backbone.init_cfg = None
    cfg.work_dir = str(tmp_path / 'work')
    from mmengine.runner import Runner
    plain = Runner.from_cfg(cfg).model  # what mmseg's test.py and init_detector do
    runner_form = write_config(tmp_path, 'mmdet::retinanet/retinanet_r50_fpn_1x_coco.py',
                               "normdense_norm = 'bcn-ws'\nmodel = dict(backbone=dict(init_cfg=None))")
    switched = build_like_codebase_tools(runner_form, tmp_path).model
    assert type(plain) is type(switched) and list(plain.state_dict()) == list(switched.state_dict())
    assert sum(isinstance(m, BatchChannelNorm2d) for m in plain.modules()) == 69


def test_partial_configs_get_no_norm_cfg_from_the_switch():
    """UNet builds upsample_cfg=dict(type='InterpConv') passing its own norm_cfg: the switch adds none there
    (InterpConv() got multiple values for keyword argument 'norm_cfg' before), while a *_cfg dict that
    writes its own norm_cfg (BiSeNetV1's backbone_cfg) is switched."""
    cfg = base_config('mmseg', 'unet/unet-s5-d16_fcn_4xb4-160k_cityscapes-512x1024.py')
    report = switch_norm(cfg, 'gn-ws')
    upsample = cfg.model.backbone.upsample_cfg
    assert 'norm_cfg' not in upsample and 'conv_cfg' not in upsample and upsample.type == 'InterpConv'
    assert cfg.model.backbone.norm_cfg.type == 'GNAuto' and cfg.model.backbone.conv_cfg.type == 'WSConv2d'
    assert not any('upsample_cfg' in row[0] for row in report.switched)
    cfg = base_config('mmseg', 'bisenetv1/bisenetv1_r18-d32_4xb4-160k_cityscapes-1024x1024.py')
    switch_norm(cfg, 'bcn-ws')
    assert cfg.model.backbone.backbone_cfg.norm_cfg.type == 'BCN'


def test_gn_pn_keeps_an_mmdet_resnet_stem_width():
    """mmdet's ResNet makes its stem base_channels wide, PNResNet (on mmseg's ResNet) 64 unless told: the switch
    to gn-pn keeps the width of the architecture it replaces (the demo's half-width R-18 had a 64-channel stem)."""
    from mmdet.registry import MODELS
    from mmengine.registry import init_default_scope
    cfg = base_config('mmdet', 'retinanet/retinanet_r18_fpn_1x_coco.py')
    cfg.model.backbone.base_channels = 32
    cfg.model.backbone.init_cfg = None
    switch_norm(cfg, 'gn-pn')
    assert cfg.model.backbone.type == 'PNResNet' and cfg.model.backbone.stem_channels == 32
    init_default_scope('mmdet')
    backbone = MODELS.build(cfg.model.backbone)
    assert backbone.conv1.weight.shape[0] == 32


def test_a_bare_cfg_dict_is_left_as_written():
    """A ResNet plugin is ``plugins=[dict(cfg=dict(type=...), ...)]``: the ResNet completes that ``cfg`` with its
    own arguments, so the switch leaves it as written (NonLocal2d accepts a conv_cfg, which the switch would add
    if a bare ``cfg`` key counted as a module of its own), while the ResNet itself is switched."""
    cfg = base_config('mmdet', 'retinanet/retinanet_r50_fpn_1x_coco.py')
    plugin = dict(type='NonLocal2d', sub_sample=True)
    cfg.model.backbone.plugins = [dict(cfg=dict(plugin), stages=(False, False, True, True), position='after_conv2')]
    report = switch_norm(cfg, 'bcn-ws')
    assert cfg.model.backbone.plugins[0].cfg == plugin
    assert cfg.model.backbone.norm_cfg.type == 'BCN' and cfg.model.backbone.conv_cfg.type == 'WSConv2d'
    assert not any('plugins' in row[0] for row in report.switched)


def test_summary_lists_the_group_choices_and_the_exact_count_error(tmp_path):
    from mmseg.registry import MODELS
    from mmengine.registry import init_default_scope

    from normdense.norm_switch import finish_model
    cfg = base_config('mmseg', 'hrnet/fcn_hr18s_4xb2-40k_cityscapes-512x1024.py')
    cfg.model.backbone.norm_cfg = cfg.model.decode_head.norm_cfg = dict(type='BN')
    report = switch_norm(cfg, 'bcn-ws')
    init_default_scope('mmseg')
    model = finish_model(MODELS.build(cfg.model), 'bcn-ws', report)
    table = report.table()
    line = next(x for x in table.splitlines() if x.strip().startswith('groups ('))
    assert "num_groups='auto' (the divisor nearest 32 with >= 2 channels per group)" in line
    assert '18->9 x' in line and '36->18 x' in line and '72->36 x' in line and '64->32 x' in line
    assert all(m.num_groups == 9 for m in model.modules() if getattr(m, 'num_channels', 0) == 18)
    cfg = base_config('mmseg', 'hrnet/fcn_hr18s_4xb2-40k_cityscapes-512x1024.py')
    switch_norm(cfg, dict(norm='gn', num_groups=32))  # a user's exact count stays exact: one line at build
    with pytest.raises(ValueError, match="GNAuto: num_groups=32 does not divide this layer's 18 channels; write "
                                         "num_groups='auto'"):
        MODELS.build(cfg.model)
    cfg = base_config('mmseg', 'hrnet/fcn_hr18s_4xb2-40k_cityscapes-512x1024.py')
    report = switch_norm(cfg, dict(norm='gn', channels_per_group=9))
    report.groups = normdense.norm_switch.group_choices(MODELS.build(cfg.model))
    assert '18->2 x' in report.table() and 'channels_per_group=9' in report.table()
    with pytest.raises(ValueError, match='channels_per_group must be a positive int'):
        switch_norm(cfg, dict(norm='gn', num_groups=8, channels_per_group=9))


def test_configs_by_package_name(tmp_path):
    cfg = jobs.load_config('mmdet::retinanet/retinanet_r50_fpn_1x_coco.py')
    assert cfg.model.type == 'RetinaNet' and cfg.work_dir.endswith('retinanet_r50_fpn_1x_coco')
    with pytest.raises(FileNotFoundError, match=r"config mmdet::retinanet/nope.py: .*\.mim/configs"):
        jobs.load_config('mmdet::retinanet/nope.py')
    with pytest.raises(FileNotFoundError, match='config file not found: nope.py'):
        jobs.load_config('nope.py')
    from normdense.tools import resolve_config
    assert resolve_config('mmseg::unet/unet-s5-d16_fcn_4xb4-160k_cityscapes-512x1024.py').startswith('mmseg::')
    # mmseg's package is 'mmseg', its distribution 'mmsegmentation': a name resolves to the installed file
    cfg = jobs.load_config('mmseg::deeplabv3/deeplabv3_r50-d8_4xb2-40k_cityscapes-512x1024.py')
    assert cfg.model.decode_head.type == 'ASPPHead' and cfg.default_scope == 'mmseg'
    assert cfg.work_dir.endswith('deeplabv3_r50-d8_4xb2-40k_cityscapes-512x1024')


@pytest.mark.slow  # ~40 s: tools/train.py in a subprocess, through the data check
def test_train_tool_takes_a_package_name_with_norm(tmp_path):
    """tools/train.py mmdet::retinanet/... --norm bcn-ws: the config resolves, the switch applies, and the run
    stops at the data check (no COCO here) with one line naming the missing data, not 'config file not found'."""
    import subprocess
    import sys
    cmd = [sys.executable, osp.join(ROOT, 'tools', 'train.py'), 'mmdet::retinanet/retinanet_r50_fpn_1x_coco.py',
           '--norm', 'bcn-ws', '--work-dir', str(tmp_path / 'work')]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and 'config file not found' not in proc.stderr
    assert err and err[-1].startswith('train.py: error:') and 'data/coco' in err[-1], proc.stderr[-2000:]
    # python -m normdense.tools passes the name through to the tool unchanged
    cmd = [sys.executable, '-m', 'normdense.tools', 'train', 'mmdet::retinanet/retinanet_r50_fpn_1x_coco.py',
           '--norm', 'bcn-ws', '--work-dir', str(tmp_path / 'work')]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert 'config file not found' not in proc.stderr and 'data/coco' in proc.stderr.strip().splitlines()[-1]


def test_pretrained_note_names_the_matching_weights():
    cfg = base_config('mmdet', 'retinanet/retinanet_r50_fpn_1x_coco.py')
    notes = ' '.join(switch_norm(cfg, 'bcn-ws').notes)
    assert 'torchvision://resnet50, a BN-trained checkpoint' in notes
    assert 'configs/imagenet/resnet50_bcn-ws_in1k.py' in notes and 'checkpoints/resnet50_bcn-ws_in1k.pth' in notes
    assert '--from torchvision --norm bcn' in notes
    assert osp.isfile(osp.join(ROOT, 'configs', 'imagenet', 'resnet50_bcn-ws_in1k.py'))
    cfg = base_config('mmseg', 'pspnet/pspnet_r50-d8_4xb2-40k_cityscapes-512x1024.py')
    notes = ' '.join(switch_norm(cfg, 'gn-pn').notes)
    assert 'configs/imagenet/resnet50-v1c_gn-pn_in1k.py' in notes and '--from torchvision' not in notes
    assert osp.isfile(osp.join(ROOT, 'configs', 'imagenet', 'resnet50-v1c_gn-pn_in1k.py'))
    cfg = base_config('mmseg', 'hrnet/fcn_hr18_4xb2-40k_cityscapes-512x1024.py')
    notes = ' '.join(switch_norm(cfg, 'gn').notes)
    assert 'no ImageNet config for a HRNet with gn' in notes
    assert 'tools/train.py mmpretrain::<its config> --norm gn' in notes and "prefix='backbone.'" in notes


def test_gn_pn_keeps_an_explicit_mmdet_stem_width():
    """An mmdet ResNet whose config gives ``stem_channels`` (here 16, base_channels 32) keeps that stem: the switch
    fills in base_channels only where the config left the stem to mmdet's default."""
    from mmdet.registry import MODELS
    from mmengine.registry import init_default_scope
    cfg = base_config('mmdet', 'retinanet/retinanet_r18_fpn_1x_coco.py')
    cfg.model.backbone.update(base_channels=32, stem_channels=16, init_cfg=None)
    switch_norm(cfg, 'gn-pn')
    assert cfg.model.backbone.type == 'PNResNet' and cfg.model.backbone.stem_channels == 16
    init_default_scope('mmdet')
    backbone = MODELS.build(cfg.model.backbone)
    assert backbone.conv1.weight.shape[0] == 16 and backbone.layer1[0].conv1.weight.shape[0] == 32
