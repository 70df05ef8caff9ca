"""normdense.convert.backbone: ImageNet classifier / authors' / torchvision checkpoints -> mmdet/mmseg ResNets.

* Round trips: every configs/imagenet norm variant (shrunk to ResNet-18, 2 iterations on a toy ImageNet in
  tmp_path) -> convert -> load strictly into mmdet's and mmseg's ResNets (PNResNet for GN+PN): the backbone
  features equal the classifier's.
* Synthetic checkpoints in the WS/BCN authors' layouts (built here from torchvision's ResNet naming with
  transcriptions of the authors' released modules) convert and reproduce the authors' model's features.
* torchvision BN ResNets -> BN/BCN + WS starting points: the stated effect on the outputs holds exactly.
* Partial conversions are listed and refused unless allowed.
"""
import copy
import os
import os.path as osp

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from normdense.convert.backbone import (ConversionError, PartialConversionError, convert_backbone, detect_source,
                                        load_source, save_backbone_checkpoint, sequential_stem, ws_scale)
from normdense.layers.ws import WSConv2d
from tests.pretrain_utils import build_backbone, build_classifier, make_toy_imagenet, pretrain, reduced_cfg
from tests.pretrain_utils import single_thread  # noqa: F401  (fixture)

torchvision = pytest.importorskip('torchvision')
pytestmark = pytest.mark.usefixtures('single_thread')


@pytest.fixture(scope='module')
def toy_imagenet(tmp_path_factory):
    return make_toy_imagenet(tmp_path_factory.mktemp('toy_imagenet'))


# --------------------------------------------------------------------------------------------------
# round trips through the real pretraining configs
# --------------------------------------------------------------------------------------------------
EXPECTED = {  # config name part -> (conv, norm type)
    'gn': ('Conv2d', 'GN'), 'gn-ws': ('WSConv2d', 'GN'), 'bn-ws': ('WSConv2d', 'BN'),
    'bcn-ws': ('WSConv2d', 'BCN'), 'bcn-ws-micro': ('WSConv2d', 'BCN'), 'gn-pn': ('Conv2d', 'GNPN'),
    'iternorm': ('Conv2d', 'IterNorm')}
ROUND_TRIPS = [  # every norm variant in both stems; the v1c stem mapping is generic, so some are slow-only
    'resnet50_gn-ws_in1k', 'resnet50_bcn-ws_in1k', 'resnet50_bcn-ws-micro_in1k', 'resnet50_gn-pn_in1k',
    'resnet50_iternorm_in1k', 'resnet50-v1c_bcn-ws_in1k', 'resnet50-v1c_gn-pn_in1k',
    pytest.param('resnet50_gn_in1k', marks=pytest.mark.slow),
    pytest.param('resnet50-v1c_gn_in1k', marks=pytest.mark.slow),
    pytest.param('resnet50-v1c_gn-ws_in1k', marks=pytest.mark.slow),
    pytest.param('resnet50-v1c_bn-ws_in1k', marks=pytest.mark.slow),
    pytest.param('resnet50-v1c_bcn-ws-micro_in1k', marks=pytest.mark.slow),
    pytest.param('resnet50-v1c_iternorm_in1k', marks=pytest.mark.slow),
]


@pytest.mark.parametrize('name', ROUND_TRIPS)
def test_pretrain_convert_load_round_trip(name, toy_imagenet, tmp_path):
    cfg = reduced_cfg(name, toy_imagenet, tmp_path / 'work')
    ckpt = pretrain(cfg)
    classifier = build_classifier(cfg, ckpt)
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = classifier.backbone(x)[-1]
    variant = name.split('_')[1]
    v1c = '-v1c' in name
    conv_type, norm_type = EXPECTED[variant]
    for target in ('mmdet', 'mmseg'):
        conv = convert_backbone(load_source(ckpt), target)
        assert conv.complete, conv.report()
        assert conv.source_format == 'mmpretrain'
        assert [k for k, _ in conv.dropped] == ['head.fc.weight', 'head.fc.bias']
        assert not any(k.startswith('backbone.') for k in conv.state_dict)
        dst = str(tmp_path / 'checkpoints' / f'{target}.pth')
        final = save_backbone_checkpoint(conv, dst, source_path=ckpt)
        meta = torch.load(dst)['meta']  # weights_only=True must read it
        assert (meta['conv'], meta['norm']) == (conv_type, norm_type)
        assert meta['ws_formula'] == ('paper' if conv_type == 'WSConv2d' else None)
        assert meta['partial'] is False and meta['source']['format'] == 'mmpretrain'
        assert meta['source']['iter'] == 2
        if norm_type == 'BCN':
            assert meta['choices']['bcn_mode_trained'] == ('estimate' if 'micro' in variant else 'batch')
        backbone_type = conv.backbone_cfg['type']
        if norm_type == 'GNPN':
            assert backbone_type == ('PNResNetV1c' if v1c else 'PNResNet')
        elif target == 'mmseg':
            assert backbone_type == ('ResNetV1c' if v1c else 'ResNet')
        else:
            assert backbone_type == 'ResNet' and conv.backbone_cfg.get('deep_stem', False) == v1c
        assert osp.realpath(dst) == osp.realpath(final)
        backbone = build_backbone(target, conv.backbone_cfg, checkpoint=dst)  # strict
        with torch.no_grad():
            out = backbone(x)[-1]
        assert torch.equal(out, expected), (out - expected).abs().max()
    if v1c:  # the DeepLabV3 form (output stride 8) of the same backbone loads strictly too
        seg = build_backbone('mmseg', conv.backbone_cfg, checkpoint=dst, strides=(1, 2, 1, 1),
                             dilations=(1, 1, 2, 4), contract_dilation=True)
        with torch.no_grad():
            out = seg(x)[-1]
        assert out.shape[-1] == 8 and torch.isfinite(out).all()


@pytest.mark.parametrize('name', ['resnet50_bcn-ws_in1k', 'resnet50-v1c_bcn-ws_in1k'])
def test_narrow_resnet_round_trip(name, toy_imagenet, tmp_path):
    """A half-width ResNet-18 (stem and base 32 channels, as the segmentation demo's) converts to a backbone
    cfg that carries its widths and loads strictly with identical features."""
    cfg = reduced_cfg(name, toy_imagenet, tmp_path / 'work')
    cfg.model.backbone.update(stem_channels=32, base_channels=32, norm_cfg=dict(cfg.model.backbone.norm_cfg,
                                                                                 num_groups=16))
    cfg.model.head.in_channels = 256
    ckpt = pretrain(cfg)
    classifier = build_classifier(cfg, ckpt)
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = classifier.backbone(x)[-1]
    for target in ('mmdet', 'mmseg'):
        conv = convert_backbone(load_source(ckpt), target)
        assert conv.complete, conv.report()
        assert (conv.backbone_cfg['stem_channels'], conv.backbone_cfg['base_channels']) == (32, 32)
        dst = str(tmp_path / f'{target}.pth')
        save_backbone_checkpoint(conv, dst, source_path=ckpt)
        backbone = build_backbone(target, conv.backbone_cfg, checkpoint=dst)  # strict
        with torch.no_grad():
            out = backbone(x)[-1]
        assert out.shape[1] == 256 and torch.equal(out, expected), (out - expected).abs().max()


def test_standard_widths_stay_out_of_the_backbone_cfg(toy_imagenet, tmp_path):
    cfg = reduced_cfg('resnet50-v1c_bcn-ws_in1k', toy_imagenet, tmp_path / 'work', max_iters=1)
    conv = convert_backbone(load_source(pretrain(cfg)), 'mmseg')
    assert conv.complete and 'stem_channels' not in conv.backbone_cfg and 'base_channels' not in conv.backbone_cfg


def test_sequential_stem_renames_convmodule_stem():
    sd = {'stem.0.conv.weight': 0, 'stem.0.bcn.weight': 1, 'stem.2.conv.weight': 2, 'stem.2.bcn.running_mean': 3,
          'layer1.0.conv1.weight': 4}
    out, changed = sequential_stem(sd)
    assert changed and list(out) == ['stem.0.weight', 'stem.1.weight', 'stem.6.weight', 'stem.7.running_mean',
                                     'layer1.0.conv1.weight']
    assert sequential_stem({'stem.0.weight': 0})[1] is False


def test_partial_mmpretrain_conversion_is_refused(toy_imagenet, tmp_path):
    cfg = reduced_cfg('resnet50_gn-ws_in1k', toy_imagenet, tmp_path / 'work', max_iters=1)
    ckpt = torch.load(pretrain(cfg))
    del ckpt['state_dict']['backbone.layer2.0.conv1.weight']
    conv = convert_backbone(ckpt, 'mmdet')
    assert not conv.complete and conv.missing == ['layer2.0.conv1.weight']
    assert 'NOT MAPPED' in conv.report() and 'layer2.0.conv1.weight' in conv.report()
    dst = str(tmp_path / 'ck' / 'partial.pth')
    with pytest.raises(PartialConversionError, match='--allow-partial'):
        save_backbone_checkpoint(conv, dst)
    assert not osp.exists(tmp_path / 'ck') or not os.listdir(tmp_path / 'ck')
    save_backbone_checkpoint(conv, dst, allow_partial=True)
    meta = torch.load(dst)['meta']
    assert meta['partial'] is True and meta['not_mapped']['missing'] == ['layer2.0.conv1.weight']
    with pytest.raises(RuntimeError, match='layer2.0.conv1.weight'):
        build_backbone('mmdet', conv.backbone_cfg, checkpoint=dst)  # strict load names the hole
    with pytest.raises(ConversionError, match='contradicts'):
        convert_backbone(ckpt, 'mmdet', ws_formula='var_unbiased')  # config says 'paper'
    with pytest.raises(ConversionError, match='contradicts'):
        convert_backbone(ckpt, 'mmdet', norm='bcn')


def test_mmpretrain_without_config_needs_ws_choice(toy_imagenet, tmp_path):
    cfg = reduced_cfg('resnet50-v1c_bcn-ws_in1k', toy_imagenet, tmp_path / 'work', max_iters=1)
    ckpt = torch.load(pretrain(cfg))
    # a state dict saved without the Runner's meta, and (as before the convs saved their formula) without
    # the WSConv2d formulas: whether the convs were weight-standardized is unknown
    bare = {'state_dict': {k: v for k, v in ckpt['state_dict'].items() if not k.endswith('._extra_state')}}
    with pytest.raises(ConversionError, match='--ws-formula'):
        convert_backbone(bare, 'mmseg')
    conv = convert_backbone(bare, 'mmseg', ws_formula='paper')
    assert conv.complete, conv.report()
    # the formula saved with the weights answers it; a contradicting --ws-formula is refused
    with_state = {'state_dict': ckpt['state_dict']}
    assert convert_backbone(with_state, 'mmseg').spec.conv_cfg == dict(type='WSConv2d', formula='paper')
    with pytest.raises(ConversionError, match="trained with WS formula 'paper'"):
        convert_backbone(with_state, 'mmseg', ws_formula='var_unbiased')
    assert conv.spec.norm_cfg == dict(type='BCN', num_groups=32)  # groups read from the (G,) weights
    assert conv.backbone_cfg['type'] == 'ResNetV1c'
    # with the Runner's meta: the saved formula is what the convs computed (a run whose weights were loaded
    # from another formula switches to it), so it wins over the stored config's, with a note
    switched = {k: torch.tensor([2.0, 1e-5], dtype=torch.float64) if k.endswith('._extra_state') else v
                for k, v in ckpt['state_dict'].items()}
    conv = convert_backbone(dict(ckpt, state_dict=switched), 'mmseg')
    assert conv.complete and conv.spec.conv_cfg == dict(type='WSConv2d', formula='var_unbiased')
    assert any("'var_unbiased'" in n and 'stored config' in n for n in conv.notes)


# --------------------------------------------------------------------------------------------------
# the WS/BCN authors' layouts (transcriptions of their released modules)
# --------------------------------------------------------------------------------------------------
class AuthorsWSConv(nn.Conv2d):
    """The authors' WS conv: w / sqrt(var_unbiased + 1e-5) (BCN code) or w / (std_unbiased + 1e-5)."""

    def __init__(self, conv, formula):
        super().__init__(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding,
                         conv.dilation, conv.groups, conv.bias is not None)
        self.formula = formula

    def forward(self, x):
        w = self.weight - self.weight.mean(dim=(1, 2, 3), keepdim=True)
        flat = w.view(w.size(0), -1)
        if self.formula == 'var_unbiased':
            w = w / torch.sqrt(flat.var(dim=1) + 1e-5).view(-1, 1, 1, 1)
        else:
            w = w / (flat.std(dim=1).view(-1, 1, 1, 1) + 1e-5)
        return F.conv2d(x, w, self.bias, self.stride, self.padding, self.dilation, self.groups)


class AuthorsEstBN(nn.Module):
    """The release's micro-batch batch stage (eval path: normalize with the running estimates)."""

    def __init__(self, c):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(c)), nn.Parameter(torch.zeros(c))
        self.register_buffer('running_mean', torch.zeros(c))
        self.register_buffer('running_var', torch.ones(c))
        self.register_buffer('num_batches_tracked', torch.tensor(0, dtype=torch.long))
        self.register_buffer('estbn_moving_speed', torch.zeros(1))

    def forward(self, x):
        out = (x - self.running_mean.view(1, -1, 1, 1)) / torch.sqrt(self.running_var + 1e-5).view(1, -1, 1, 1)
        return self.weight.view(1, -1, 1, 1) * out + self.bias.view(1, -1, 1, 1)


class AuthorsBCN(nn.Module):
    """The authors' BCN: inner BN (``pbn`` or ``bn``), then per-sample group normalization with a
    (1, G, 1) affine."""

    def __init__(self, c, groups=32, inner='pbn', estimate=False):
        super().__init__()
        self.groups, self.inner = groups, inner
        self.weight = nn.Parameter(torch.ones(1, groups, 1))
        self.bias = nn.Parameter(torch.zeros(1, groups, 1))
        self.add_module(inner, AuthorsEstBN(c) if estimate else nn.BatchNorm2d(c))

    def forward(self, x):
        out = getattr(self, self.inner)(x)
        n = x.size(0)
        out = F.batch_norm(out.reshape(1, n * self.groups, -1), None, None, training=True, momentum=0.0, eps=1e-5)
        out = self.weight * out.view(n, self.groups, -1) + self.bias
        return out.view_as(x)


def _randomize(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if not t.is_floating_point():
                continue
            if name.endswith('running_var'):
                t.copy_(torch.rand(t.shape, generator=g) * 1.5 + 0.5)
            elif name.endswith('running_mean') or name.endswith('bias'):
                t.copy_(torch.randn(t.shape, generator=g) * 0.2)
            elif t.dim() <= 3 and 'fc' not in name:  # norm scales
                t.copy_(torch.rand(t.shape, generator=g) * 0.8 + 0.6)
            else:
                t.copy_(torch.randn(t.shape, generator=g) * 0.1 + 0.01)
    return model


def _swap_convs(module, make):
    for name, child in module.named_children():
        if type(child) is nn.Conv2d:
            setattr(module, name, make(child))
        else:
            _swap_convs(child, make)
    return module


def authors_resnet18(kind='bcn', inner='pbn', estimate=False, formula=None, seed=0):
    if kind == 'bcn':
        norm = lambda c: AuthorsBCN(c, inner=inner, estimate=estimate)  # noqa: E731
        formula = formula or 'var_unbiased'
    else:  # their first WS release: GroupNorm(32) under BN names
        norm = lambda c: nn.GroupNorm(32, c)  # noqa: E731
        formula = formula or 'std_unbiased'
    model = torchvision.models.resnet18(num_classes=10, norm_layer=norm)
    _swap_convs(model, lambda conv: AuthorsWSConv(conv, formula))
    return _randomize(model, seed).double().eval()


def tv_features(model, x):
    x = model.maxpool(model.relu(model.bn1(model.conv1(x))))
    return model.layer4(model.layer3(model.layer2(model.layer1(x))))


def authors_checkpoint(model):
    """Saved like the authors' pytorch-classification code: DataParallel keys in a dict with 'state_dict'."""
    return {'state_dict': {f'module.{k}': v for k, v in model.state_dict().items()}, 'epoch': 90,
            'best_acc': 76.9}


@pytest.mark.parametrize('inner,estimate', [('pbn', False), ('bn', False), ('bn', True)])
def test_authors_bcn_checkpoint(inner, estimate, tmp_path):
    model = authors_resnet18('bcn', inner=inner, estimate=estimate)
    ckpt = authors_checkpoint(model)
    assert ckpt['state_dict']['module.layer1.0.bn1.weight'].shape == (1, 32, 1)
    assert detect_source(ckpt['state_dict']) == 'authors'
    conv = convert_backbone(ckpt, 'mmdet')
    assert conv.complete, conv.report()
    assert conv.source_format == 'authors'
    assert conv.spec.conv_cfg == dict(type='WSConv2d', formula='var_unbiased')
    assert conv.spec.norm_cfg == dict(type='BCN', num_groups=32, mode='estimate' if estimate else 'batch')
    dropped = {k for k, _ in conv.dropped}
    assert {'fc.weight', 'fc.bias'} <= dropped  # names after stripping 'module.'
    assert f'layer1.0.bn1.{inner}.num_batches_tracked' in dropped
    assert (f'layer1.0.bn1.{inner}.estbn_moving_speed' in dropped) == estimate
    dst = str(tmp_path / 'resnet18_bcn-ws_authors.pth')
    save_backbone_checkpoint(conv, dst)
    meta = torch.load(dst)['meta']
    assert meta['ws_formula'] == 'var_unbiased' and 'BCN code' in meta['choices']['ws_formula_reason']
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = tv_features(model, x)
    for target in ('mmdet', 'mmseg'):
        # the config's WS formula is left at the default: PretrainedBackbone applies the recorded one
        cfg = dict(conv.backbone_cfg, conv_cfg=dict(type='WSConv2d'))
        backbone = build_backbone(target, cfg, checkpoint=dst if target == 'mmdet' else
                                  _saved(convert_backbone(ckpt, target), tmp_path / f'{target}.pth'),
                                  dtype=torch.float64)
        assert {m.formula for m in backbone.modules() if isinstance(m, WSConv2d)} == {'var_unbiased'}
        with torch.no_grad():
            out = backbone(x)[-1]
        torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-9)
    # the formula is in the weights too: a plain strict load_state_dict into a 'paper' backbone computes
    # the authors' function (no PretrainedBackbone, no meta)
    sd = torch.load(dst)['state_dict']
    assert sd['layer1.0.conv1._extra_state'].tolist() == [2.0, 1e-5]
    backbone = build_backbone('mmdet', dict(conv.backbone_cfg, conv_cfg=dict(type='WSConv2d')), dtype=torch.float64)
    backbone.load_state_dict(sd, strict=True)
    with torch.no_grad():
        torch.testing.assert_close(backbone(x)[-1], expected, rtol=1e-9, atol=1e-9)


def _saved(conv, path):
    save_backbone_checkpoint(conv, str(path))
    return str(path)


def test_authors_gn_ws_checkpoint(tmp_path):
    model = authors_resnet18('gn')
    ckpt = authors_checkpoint(model)
    conv = convert_backbone(ckpt, 'mmdet', source='authors')
    assert conv.complete, conv.report()
    assert conv.spec.conv_cfg == dict(type='WSConv2d', formula='std_unbiased')
    assert conv.spec.norm_cfg['type'] == 'GN'
    assert 'layer1.0.gn1.weight' in conv.state_dict
    x = torch.randn(1, 3, 64, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    backbone = build_backbone('mmdet', conv.backbone_cfg, checkpoint=_saved(conv, tmp_path / 'gnws.pth'),
                              dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(backbone(x)[-1], tv_features(model, x), rtol=1e-9, atol=1e-9)
    # --ws-formula overrides the default and is recorded
    other = convert_backbone(ckpt, 'mmdet', source='authors', ws_formula='var_unbiased')
    assert other.spec.conv_cfg['formula'] == 'var_unbiased'
    assert other.choices['ws_formula_reason'] == 'given on the command line'


def test_authors_partial_conversion_lists_and_refuses(tmp_path):
    """The DeepLab code's 'beta' stem (three convs under conv1.0/1/2, no norms between) has no place in an
    mmdet/mmseg ResNet: listed, refused, written only with allow_partial."""
    ckpt = authors_checkpoint(authors_resnet18('bcn'))
    sd = ckpt['state_dict']
    w = sd.pop('module.conv1.weight')
    for i in range(3):
        sd[f'module.conv1.{i}.weight'] = w[:, :3] if i == 0 else torch.zeros(64, 64, 3, 3)
    sd['module.aspp.conv2.weight'] = torch.zeros(4, 4, 1, 1)
    conv = convert_backbone(ckpt, 'mmseg')
    assert conv.missing == ['conv1.weight']
    assert set(conv.unexpected) == {'conv1.0.weight', 'conv1.1.weight', 'conv1.2.weight', 'aspp.conv2.weight'}
    report = conv.report()
    assert 'would stay at their initialization' in report and 'aspp.conv2.weight' in report
    with pytest.raises(PartialConversionError):
        save_backbone_checkpoint(conv, str(tmp_path / 'p.pth'))
    save_backbone_checkpoint(conv, str(tmp_path / 'p.pth'), allow_partial=True)
    saved = torch.load(tmp_path / 'p.pth')
    assert 'conv1.1.weight' not in saved['state_dict'] and saved['meta']['partial'] is True
    assert sorted(saved['meta']['not_mapped']['unexpected']) == sorted(conv.unexpected)


# --------------------------------------------------------------------------------------------------
# torchvision BN ResNet -> BN/BCN + WS starting point
# --------------------------------------------------------------------------------------------------
def _ws_sigma(w, formula, eps=1e-5):
    flat = w.reshape(w.shape[0], -1)
    if formula == 'paper':
        return torch.sqrt(flat.var(dim=1, unbiased=False) + eps)
    if formula == 'std_unbiased':
        return flat.std(dim=1) + eps
    return torch.sqrt(flat.var(dim=1) + eps)


def expected_starting_point(model, formula, norm, groups=32):
    """The function the conversion is documented to produce, built on the torchvision model itself: every
    kernel made zero-mean per output channel, BN eps acting as eps * sigma^2, and (BCN) a group
    normalization after every BN."""
    ref = copy.deepcopy(model)
    convs = {n: m for n, m in ref.named_modules() if isinstance(m, nn.Conv2d)}
    bns = dict(ref.named_modules())
    with torch.no_grad():
        for name, conv in convs.items():
            bn_name = name[:-1] + '1' if name.endswith('downsample.0') else name.replace('conv', 'bn')
            bn = bns[bn_name]
            if formula is not None:
                sigma = _ws_sigma(conv.weight, formula)
                conv.weight -= conv.weight.mean(dim=(1, 2, 3), keepdim=True)
                bn.running_var += (sigma ** 2 - 1) * bn.eps
    if norm == 'bcn':
        for name, bn in [(n, m) for n, m in ref.named_modules() if isinstance(m, nn.BatchNorm2d)]:
            parent, _, attr = name.rpartition('.')
            holder = ref.get_submodule(parent) if parent else ref
            setattr(holder, attr, nn.Sequential(bn, nn.GroupNorm(groups, bn.num_features, eps=1e-5, affine=False)))
    return ref.eval()


def torchvision_resnet18(seed=0):
    return _randomize(torchvision.models.resnet18(num_classes=10), seed).double().eval()


@pytest.mark.parametrize('norm,formula,mode', [
    ('bn', 'none', None), ('bn', 'paper', None), ('bcn', 'paper', 'estimate'), ('bcn', 'var_unbiased', 'batch'),
    ('bcn', 'none', 'estimate')])
def test_torchvision_starting_point_effect(norm, formula, mode, tmp_path):
    model = torchvision_resnet18()
    sd = model.state_dict()  # float64, so that the comparison below can be tight
    assert detect_source(sd) == 'torchvision'
    conv = convert_backbone({'state_dict': sd}, 'mmdet', norm=norm, ws_formula=formula, bcn_mode=mode)
    assert conv.complete, conv.report()
    assert conv.source_format == 'torchvision'
    if norm == 'bcn':
        assert conv.spec.norm_cfg == dict(type='BCN', num_groups=32, mode=mode)
        assert ('layer1.0.bcn1.weight', 'BCN channel-stage affine starts as identity (1, 0)') in conv.created
        assert 'group normalization' in conv.choices['effect']
    else:
        assert conv.spec.norm_cfg['type'] == 'BN'
    if norm == 'bn' and formula == 'none':
        assert 'identical' in conv.choices['effect']
    dst = _saved(conv, tmp_path / 'tv.pth')
    assert torch.load(dst)['meta']['choices']['effect'] == conv.choices['effect']
    backbone = build_backbone('mmdet', conv.backbone_cfg, checkpoint=dst, dtype=torch.float64)
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        out = backbone(x)[-1]
        expected = tv_features(expected_starting_point(model, None if formula == 'none' else formula, norm), x)
        original = tv_features(model, x)
    torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-9)
    if norm == 'bn' and formula == 'none':
        assert torch.equal(expected, original)
    else:
        assert not torch.allclose(out, original, rtol=1e-3, atol=1e-3)  # a starting point, not the same function


def test_torchvision_options_are_checked():
    sd = torchvision.models.resnet18().state_dict()
    with pytest.raises(ConversionError, match='bcn or bn'):
        convert_backbone(sd, 'mmdet', source='torchvision', norm='gn')
    with pytest.raises(ConversionError, match='torchvision sources only'):
        convert_backbone({'state_dict': {f'module.{k}': v for k, v in authors_resnet18().state_dict().items()}},
                         'mmdet', bcn_mode='batch')
    conv = convert_backbone(sd, 'mmseg', source='torchvision')
    assert conv.complete and conv.backbone_cfg['type'] == 'ResNet'
    assert any('ResNetV1c' in n for n in conv.notes)  # a 7x7 stem cannot fill mmseg's deep stem


def test_ws_scale_follows_wsconv2d():
    w = torch.randn(8, 4, 3, 3, dtype=torch.float64)
    for formula in ('paper', 'std_unbiased', 'var_unbiased'):
        torch.testing.assert_close(ws_scale(w, formula), _ws_sigma(w, formula), rtol=1e-12, atol=1e-15)
    w[3] = 0.5  # a constant filter standardizes to 0: any scale works, 1 is used
    assert ws_scale(w, 'paper')[3] == 1


def test_unknown_layout_is_reported():
    with pytest.raises(ConversionError, match='--from'):
        detect_source({'foo.weight': torch.zeros(1)})
