"""DeepLabV3 / PASCAL VOC configs (configs/deeplabv3, configs/demo): every config loads, its model and
dataloaders build and match what its file name promises, every config trains a step at batch size
1 (except the paper-batch BN ones, which are shown to fail there as documented and to train at 2),
and tools/test.py reports mIoU on a briefly trained checkpoint.

Reductions (CPU, 2 shared cores, nothing downloaded):
* data: a toy VOC set (tools/make_toy_voc.py's writer) of 64x64 images in tmp_path replaces
  data/VOCdevkit/VOC2012; dataloaders run with num_workers=0;
* no pretrained file exists: model.backbone.init_cfg=None and model.pretrained=None everywhere;
* test_config_builds builds every model at its real depth (R-101 / R-50) without running it;
* the training steps use a 64x64 crop (RandomResize scale, RandomCrop, Pad and the data
  preprocessor's size) and a ResNet-18 V1c backbone (BasicBlocks, decode_head.in_channels=512)
  instead of ResNet-101/50: every other setting (norm/conv layers in backbone and head, PNResNetV1c,
  hooks, optimizer, schedule, output stride, ASPP rates) is the config's own. The r50 configs are
  then identical to their r101 parents, so their steps are marked slow;
* mmengine formats the whole config with yapf twice per Runner (config dump and message hub), about
  3 s per Runner here; the Runner tests replace that text with a plain repr (pretty_text_fast);
* the train dataloaders of configs whose dataloader settings are identical are built and read once;
* the tools/test.py check trains the toy demo config for 3 iterations at a 64x64 crop.
"""
import copy
import functools
import glob
import importlib.util
import math
import os.path as osp
import re

import pytest
import torch
import torch.nn as nn

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
SEG_CONFIGS = sorted(glob.glob(osp.join(ROOT, 'configs', 'deeplabv3', '*.py')))
DEMO_CONFIG = osp.join(ROOT, 'configs', 'demo', 'deeplabv3_r18-d8_bcn-ws_toy-voc.py')
NAME_RE = re.compile(r'deeplabv3_r(?P<depth>\d+)-d(?P<os>8|16)_(?P<norm>bn|gn|gn-ws|bn-ws|bcn-ws|gn-pn|'
                     r'iternorm)(?P<micro>-micro)?_voc12aug-513x513\.py$')
NORMS = ('bn', 'gn', 'gn-ws', 'bn-ws', 'bcn-ws', 'gn-pn', 'iternorm')
CUSTOM_IMPORTS = dict(imports=['normdense'], allow_failed_imports=False)
CROP = 64


def cfg_id(path):
    return osp.splitext(osp.basename(path))[0]


def parse_name(path):
    m = NAME_RE.match(osp.basename(path))
    assert m, f'{osp.basename(path)} does not follow deeplabv3_r<depth>-d<os>_<norm>[-micro]_voc12aug-513x513'
    return int(m['depth']), int(m['os']), m['norm'], bool(m['micro'])


@pytest.fixture(scope='module', autouse=True)
def one_thread():
    """One intra-op thread for this module (restored afterwards): on 2 cores shared with other jobs,
    torch's 2 OpenMP threads spin-wait for each other and a training step costs several times the
    CPU (see docs/segmentation.md)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope='module')
def voc_root(tmp_path_factory):
    from normdense.data.writers import write_voc
    out = tmp_path_factory.mktemp('toy_voc')
    write_voc(str(out), num_train=4, num_val=2, num_aug=2, size=CROP, seed=0)
    return str(out / 'VOCdevkit' / 'VOC2012')


@functools.lru_cache(maxsize=None)
def _load(path):
    from mmengine.config import Config
    return Config.fromfile(path)  # custom_imports imports normdense (registers layers and hooks)


def load(path):
    return copy.deepcopy(_load(path))


def datasets_of(loader_cfg):
    ds = loader_cfg.dataset
    return list(ds.datasets) if ds.type == 'ConcatDataset' else [ds]


def point_at_toy_voc(cfg, voc_root, work_dir):
    """Datasets -> the toy set, workers off, no pretrained weights, quiet logs."""
    cfg.work_dir = str(work_dir)
    cfg.log_level = 'WARNING'
    cfg.model.pretrained = None
    cfg.model.backbone.init_cfg = None
    for key in ('train_dataloader', 'val_dataloader', 'test_dataloader'):
        loader = cfg[key]
        loader.num_workers = 0
        loader.persistent_workers = False
        for ds in datasets_of(loader):
            ds.data_root = voc_root
    return cfg


def shrink_crop(cfg, crop=CROP):
    """Train at a crop x crop crop on the toy images (their side is `crop`)."""
    for ds in datasets_of(cfg.train_dataloader):
        for t in ds.pipeline:
            if t.type == 'RandomResize':
                t.scale = (crop, crop)
            elif t.type == 'RandomCrop':
                t.crop_size = (crop, crop)
            elif t.type == 'Pad':
                t.size = (crop, crop)
    cfg.model.data_preprocessor.size = (crop, crop)
    return cfg


def norm_kind(m):
    """A short name for a norm layer (None for other modules); exact classes, since BCN and GNPN
    subclass nn.GroupNorm and mmcv's SyncBN is a subclass of torch's."""
    from normdense.layers.bcn import BatchChannelNorm2d
    from normdense.layers.iternorm import IterNorm
    from normdense.layers.proxy_norm import GroupProxyNorm
    for cls, name in ((BatchChannelNorm2d, 'BCN'), (GroupProxyNorm, 'GNPN'), (IterNorm, 'IterNorm'),
                      (nn.SyncBatchNorm, 'SyncBN'), (nn.modules.batchnorm._BatchNorm, 'BN')):
        if isinstance(m, cls):
            return name
    return 'GN' if isinstance(m, nn.GroupNorm) else None


def norm_kinds(module):
    return {k for k in map(norm_kind, module.modules()) if k}


def expected_norm_kinds(norm, micro):
    """(backbone norm kinds, ASPP-head norm kind) that a config of this variant must build."""
    bn = 'BN' if micro else 'SyncBN'
    return {
        'bn': ({bn}, 'GN' if micro else 'SyncBN'),
        'bn-ws': ({bn}, 'GN' if micro else 'SyncBN'),
        'gn': ({'GN'}, 'GN'),
        'gn-ws': ({'GN'}, 'GN'),
        'bcn-ws': ({'BCN'}, 'BCN'),
        # PN ResNet: GNPN where a ReLU followed the norm, plain GN before the residual add/downsample
        'gn-pn': ({'GNPN', 'GN'}, 'GNPN'),
        # IterNorm: GN in the ASPP head (single observation per image in the image-pool branch)
        'iternorm': ({'IterNorm'}, 'GN'),
    }[norm]


def produced_by(depth, norm):
    name = f'resnet{depth}-v1c_{norm}_in1k'
    return (f'python tools/train.py configs/imagenet/{name}.py && python tools/convert_checkpoint.py '
            f'work_dirs/{name}/epoch_90.pth checkpoints/{name}.pth --to mmseg')


def test_every_variant_has_configs():
    names = {parse_name(p) for p in SEG_CONFIGS}
    for norm in NORMS:
        for depth in (101, 50):
            assert (depth, 16, norm, False) in names and (depth, 8, norm, False) in names
            assert (depth, 16, norm, True) in names  # micro-batch variant
    assert len(SEG_CONFIGS) == len(names) == 7 * 6


@pytest.mark.parametrize('path', SEG_CONFIGS, ids=cfg_id)
def test_config_settings(path):
    """The paper's settings, the pretrained-backbone convention and the hooks, from the file alone."""
    depth, os_, norm, micro = parse_name(path)
    cfg = load(path)
    assert cfg.custom_imports == CUSTOM_IMPORTS
    assert cfg.default_scope == 'mmseg'
    # WS/BCN paper Sec. 8.4: crop 513, poly lr from 0.007, 30k iterations, 16 images per batch
    assert cfg.crop_size == (513, 513) and cfg.model.data_preprocessor.size == (513, 513)
    for ds in datasets_of(cfg.train_dataloader):
        crops = [t.crop_size for t in ds.pipeline if t.type == 'RandomCrop']
        assert crops == [(513, 513)]
    assert [d.ann_file for d in datasets_of(cfg.train_dataloader)] == [
        'ImageSets/Segmentation/train.txt', 'ImageSets/Segmentation/aug.txt']
    assert cfg.val_dataloader.dataset.ann_file == 'ImageSets/Segmentation/val.txt'
    assert cfg.val_evaluator.type == 'IoUMetric' and cfg.val_evaluator.iou_metrics == ['mIoU']
    assert cfg.optim_wrapper.optimizer.type == 'SGD' and cfg.optim_wrapper.optimizer.lr == 0.007
    (sched,) = cfg.param_scheduler
    assert sched.type == 'PolyLR' and sched.end == 30000 and sched.eta_min == 0.0
    assert cfg.train_cfg.max_iters == 30000
    assert cfg.train_dataloader.batch_size == (2 if micro else 4)  # x 8 GPUs / x 4 GPUs = 16
    assert cfg.auto_scale_lr.base_batch_size == 16
    assert cfg.model.auxiliary_head is None
    # pretrained backbone
    init = cfg.model.backbone.get('init_cfg')
    if norm == 'bn':
        assert cfg.model.pretrained == f'open-mmlab://resnet{depth}_v1c' and init is None
    elif norm == 'gn-ws':  # the WS authors' published backbone (tests/test_loading.py loads it key for key)
        assert cfg.model.pretrained is None and init.type == 'PretrainedBackbone'
        assert init.checkpoint == f'open-mmlab://jhu/resnet{depth}_gn_ws'
    else:
        assert cfg.model.pretrained is None
        assert init.type == 'PretrainedBackbone'
        assert init.checkpoint == f'checkpoints/resnet{depth}-v1c_{norm}_in1k.pth'
        assert init.produced_by.endswith(produced_by(depth, norm))
        if norm == 'bcn-ws':  # the authors' released BCN+WS weights come first, as the fast path
            assert '--to mmseg --from authors' in init.produced_by and 'model.backbone.type=ResNet' in init.produced_by
    hooks = [h.type for h in cfg.get('custom_hooks', [])]
    assert ('BCNRateHook' in hooks) == (norm == 'bcn-ws')
    assert ('ProxyNormCheckHook' in hooks) == (norm == 'gn-pn')
    for part in ('backbone', 'decode_head'):
        norm_cfg = cfg.model[part].norm_cfg
        if norm_cfg.type == 'BCN':
            assert norm_cfg.mode == 'estimate'  # so every BCN config here needs (and has) the hook


def backbone_layers(backbone_cfg):
    """What a converted checkpoint must agree on: backbone class, depth, norm kind and its group
    setting, conv type and WS formula (BN/SyncBN and BCN's two modes share their tensors)."""
    norm = backbone_cfg.get('norm_cfg') or dict(type='BN')  # mmpretrain's ResNet default
    kind = 'BN' if norm['type'] in ('BN', 'SyncBN') else norm['type']
    conv = backbone_cfg.get('conv_cfg') or dict(type='Conv2d')
    return (backbone_cfg['type'], backbone_cfg['depth'], kind, norm.get('num_groups'), norm.get('group_size'),
            conv['type'], conv.get('formula', 'paper') if conv['type'] == 'WSConv2d' else None)


# bn and gn-ws start from published weights (mmseg's, the WS authors'), not from a configs/imagenet run
PRETRAINED_CASES = sorted({(parse_name(p)[0], parse_name(p)[2]) for p in SEG_CONFIGS
                           if parse_name(p)[2] not in ('bn', 'gn-ws')})


@pytest.mark.parametrize('depth,norm', PRETRAINED_CASES, ids=[f'r{d}-{n}' for d, n in PRETRAINED_CASES])
def test_pretraining_config_matches(depth, norm):
    """The ImageNet config named in produced_by exists and trains the same backbone layers as the
    segmentation config that loads its converted checkpoint (strictly)."""
    path = osp.join(ROOT, 'configs', 'deeplabv3', f'deeplabv3_r{depth}-d16_{norm}_voc12aug-513x513.py')
    seg = load(path).model.backbone
    imagenet = osp.join(ROOT, 'configs', 'imagenet', f'resnet{depth}-v1c_{norm}_in1k.py')
    assert osp.isfile(imagenet), f'{seg.init_cfg.produced_by} names a missing config'
    assert backbone_layers(load(imagenet).model.backbone) == backbone_layers(seg)


@pytest.mark.parametrize('path', SEG_CONFIGS, ids=cfg_id)
def test_config_builds(path, voc_root, tmp_path):
    """Model (real depth) and dataloaders build from the config; the model is what the name says."""
    from mmengine.registry import init_default_scope

    from normdense.layers.ws import WSConv2d
    depth, os_, norm, micro = parse_name(path)
    cfg = point_at_toy_voc(load(path), voc_root, tmp_path)
    init_default_scope('mmseg')
    from mmseg.registry import MODELS
    model = MODELS.build(cfg.model)
    backbone, head = model.backbone, model.decode_head
    assert backbone.depth == depth
    # gn-ws: the published GN+WS weights have the plain 7x7 stem
    assert type(backbone).__name__ == {'gn-pn': 'PNResNetV1c', 'gn-ws': 'ResNet'}.get(norm, 'ResNetV1c')
    strides, dilations, rates = {16: ((1, 2, 2, 1), (1, 1, 1, 2), (1, 6, 12, 18)),
                                 8: ((1, 2, 1, 1), (1, 1, 2, 4), (1, 12, 24, 36))}[os_]
    assert tuple(backbone.strides) == strides and tuple(backbone.dilations) == dilations
    assert tuple(head.dilations) == rates and head.channels == 256
    assert model.with_auxiliary_head is False
    # WS on every backbone conv and every ASPP ConvModule, never on the classifier
    ws = norm.endswith('-ws')
    convs = [m for m in backbone.modules() if isinstance(m, nn.Conv2d)]
    convs += [m.conv for m in head.modules() if type(m).__name__ == 'ConvModule']
    assert convs and all(isinstance(c, WSConv2d) == ws for c in convs)
    assert not isinstance(head.conv_seg, WSConv2d)
    # norm layers
    backbone_kinds, head_kind = expected_norm_kinds(norm, micro)
    assert norm_kinds(backbone) == backbone_kinds
    assert norm_kinds(head) == {head_kind}
    pool_conv = head.image_pool[1]
    assert norm_kind(pool_conv.norm) == head_kind
    if norm == 'gn-pn':
        assert not pool_conv.with_activation  # the activation lives inside GNPN
    # dataloaders build on the toy set and give batches of the configured size and crop
    check_dataloaders(cfg)


_CHECKED_LOADERS = set()


def check_dataloaders(cfg):
    key = repr((cfg.train_dataloader.to_dict(), cfg.val_dataloader.to_dict()))
    if key in _CHECKED_LOADERS:  # the same settings were built and read for another config
        return
    from mmengine.runner import Runner
    batch = next(iter(Runner.build_dataloader(cfg.train_dataloader)))
    assert len(batch['inputs']) == cfg.train_dataloader.batch_size
    assert all(tuple(x.shape) == (3, 513, 513) for x in batch['inputs'])
    val = next(iter(Runner.build_dataloader(cfg.val_dataloader)))
    assert tuple(val['inputs'][0].shape) == (3, CROP, CROP)  # original size: no test-time resize
    _CHECKED_LOADERS.add(key)


@pytest.fixture
def pretty_text_fast(monkeypatch):
    """Runner dumps the config and stores it in the message hub as yapf-formatted text (~3 s here);
    a repr keeps the same information for these tests."""
    from mmengine.config import Config
    monkeypatch.setattr(Config, 'pretty_text', property(lambda self: repr(self._cfg_dict.to_dict())))


def train_runner(cfg, tmp_path, batch_size=1, iters=1):
    from mmengine.runner import Runner
    cfg.train_dataloader.batch_size = batch_size
    cfg.train_cfg = dict(type='IterBasedTrainLoop', max_iters=iters, val_interval=10 ** 6)
    cfg.param_scheduler = [dict(type='PolyLR', eta_min=0.0, power=0.9, begin=0, end=iters + 1, by_epoch=False)]
    cfg.val_cfg = cfg.val_dataloader = cfg.val_evaluator = None  # no validation at the last iteration
    cfg.default_hooks.checkpoint = None
    cfg.work_dir = str(tmp_path)
    cfg.randomness = dict(seed=0)
    return Runner.from_cfg(cfg)


def check_trained(runner, norm):
    loss = runner.message_hub.get_scalar('train/loss').current()
    assert math.isfinite(loss), loss
    from normdense.layers.bcn import BatchChannelNorm2d
    bcn = [m for m in runner.model.modules() if isinstance(m, BatchChannelNorm2d)]
    assert bool(bcn) == (norm == 'bcn-ws')
    for m in bcn:  # BCNRateHook gave them r = lr, so the estimates moved from (0, 1)
        assert m.current_rate is not None and m.current_rate > 0
        assert not torch.equal(m.running_mean, torch.zeros_like(m.running_mean))
    for p in runner.model.parameters():
        assert torch.isfinite(p).all()


def reduced_train_cfg(path, voc_root, tmp_path):
    cfg = shrink_crop(point_at_toy_voc(load(path), voc_root, tmp_path))
    cfg.model.backbone.depth = 18
    cfg.model.decode_head.in_channels = 512
    return cfg


R101_CONFIGS = [p for p in SEG_CONFIGS if parse_name(p)[0] == 101]
R50_CONFIGS = [p for p in SEG_CONFIGS if parse_name(p)[0] == 50]
STEP_CASES = [pytest.param(p, id=cfg_id(p)) for p in R101_CONFIGS] + \
    [pytest.param(p, id=cfg_id(p), marks=pytest.mark.slow) for p in R50_CONFIGS]


@pytest.mark.parametrize('path', STEP_CASES)
def test_train_step_batch1(path, voc_root, tmp_path, pretty_text_fast):
    """One Runner training iteration at 1 image per batch (hooks, optimizer, scheduler, real data).

    The paper-batch BN / BN+WS configs keep BN in the ASPP image-pool branch as the paper did: at 1
    image that BN sees 1 value per channel and torch refuses, as their files say; they are trained at
    2 images instead (their -micro variants are the batch-1 ones)."""
    depth, os_, norm, micro = parse_name(path)
    cfg = reduced_train_cfg(path, voc_root, tmp_path)
    if norm in ('bn', 'bn-ws') and not micro:
        with pytest.raises(ValueError, match='Expected more than 1 value per channel'):
            train_runner(copy.deepcopy(cfg), tmp_path / 'b1').train()
        runner = train_runner(cfg, tmp_path / 'b2', batch_size=2)
    else:
        runner = train_runner(cfg, tmp_path)
    runner.train()
    check_trained(runner, norm)


def test_demo_config_train_step_batch1(voc_root, tmp_path, pretty_text_fast):
    """The toy demo config (ResNet-18, BCN+WS estimate mode, 6 classes) at 1 image per batch."""
    cfg = shrink_crop(point_at_toy_voc(load(DEMO_CONFIG), voc_root, tmp_path))
    assert cfg.custom_imports == CUSTOM_IMPORTS
    assert [h.type for h in cfg.custom_hooks] == ['BCNRateHook']
    assert cfg.model.backbone.depth == 18 and cfg.model.decode_head.num_classes == 6
    assert cfg.train_dataloader.batch_size in (1, 2)
    runner = train_runner(cfg, tmp_path)
    runner.train()
    check_trained(runner, 'bcn-ws')
    pool_norm = runner.model.decode_head.image_pool[1].norm
    assert pool_norm.mode == 'estimate' and pool_norm.current_rate > 0


def _load_script(name, folder='scripts'):
    spec = importlib.util.spec_from_file_location(f'{folder}_{name}', osp.join(ROOT, folder, f'{name}.py'))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def toy_cfg_options(path, voc_root, crop=CROP):
    """--cfg-options that point a config at the toy set and a crop x crop training crop, with the
    pipeline indices taken from the config itself."""
    cfg = load(path)
    opts = [f'val_dataloader.dataset.data_root={voc_root}', f'test_dataloader.dataset.data_root={voc_root}',
            f'model.data_preprocessor.size=({crop},{crop})', 'log_level=WARNING']
    keys = {'RandomResize': 'scale', 'RandomCrop': 'crop_size', 'Pad': 'size'}
    for i, ds in enumerate(cfg.train_dataloader.dataset.datasets):
        prefix = f'train_dataloader.dataset.datasets.{i}'
        opts.append(f'{prefix}.data_root={voc_root}')
        opts += [f'{prefix}.pipeline.{j}.{keys[t.type]}=({crop},{crop})'
                 for j, t in enumerate(ds.pipeline) if t.type in keys]
    return opts


def test_tools_test_reports_miou(voc_root, tmp_path, pretty_text_fast):
    """tools/train.py for 3 iterations on the toy set, then tools/test.py on its checkpoint reports
    mIoU (mmseg's IoUMetric); the dumped predictions render into the demo's PNG and give the same
    mIoU when recomputed independently (scripts/demo_seg.py's functions)."""
    import numpy as np
    from PIL import Image
    train, test = _load_script('train', 'tools'), _load_script('test', 'tools')
    work = tmp_path / 'work'
    opts = ['--cfg-options', *toy_cfg_options(DEMO_CONFIG, voc_root)]
    train.main([DEMO_CONFIG, '--work-dir', str(work), *opts, 'train_cfg.max_iters=3',
                'train_cfg.val_interval=3', 'default_hooks.checkpoint.interval=3'])
    ckpt = work / 'iter_3.pth'
    assert ckpt.is_file()
    pkl = tmp_path / 'preds.pkl'
    metrics = test.main([DEMO_CONFIG, str(ckpt), '--work-dir', str(tmp_path / 'test'), '--out', str(pkl),
                         *opts])
    assert set(metrics) >= {'mIoU', 'aAcc', 'mAcc'}
    assert 0.0 <= metrics['mIoU'] <= 100.0
    demo = _load_script('demo_seg')
    preds = demo.load_predictions(str(pkl))
    assert len(preds) == 2 and preds[0][1].shape == preds[0][2].shape == (CROP, CROP)
    assert np.nanmean(demo.per_class_iou(preds, 6)) == pytest.approx(metrics['mIoU'], abs=0.01)
    png = demo.render_predictions(preds, str(tmp_path / 'p.png'), num_show=2)
    w, h = Image.open(png).size
    assert w > 300 and h > 200
