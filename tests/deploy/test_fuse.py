"""normdense.deploy.fuse: a fused eval model computes what the unfused eval model computes."""
import copy

import pytest
import torch
import torch.nn as nn

from normdense.deploy import ChannelLinear, RhoScaledConv2d, UnitizationStage2, fuse
from normdense.layers.bcn import BatchChannelNorm2d
from normdense.layers.equinorm import ChannelAffine, EquiConv2d
from normdense.layers.iternorm import IterNorm
from normdense.layers.proxy_norm import GroupProxyNorm
from normdense.layers.unitization import Unitization2d
from normdense.layers.ws import WSConv2d

# what must be gone after fusion (ChannelAffine is itself the single affine that replaces a norm without a conv)
NORMDENSE_TYPES = (WSConv2d, EquiConv2d, BatchChannelNorm2d, IterNorm, Unitization2d)


def _randomize_(model, seed=0):
    """Non-trivial eval statistics and affines, so that folding them is actually exercised."""
    g = torch.Generator().manual_seed(seed)

    def r(t, lo, hi):
        return (torch.rand(t.shape, generator=g, dtype=torch.float64) * (hi - lo) + lo).to(t)

    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, BatchChannelNorm2d):
                m.running_mean.copy_(r(m.running_mean, -0.5, 0.5))
                m.running_var.copy_(r(m.running_var, 0.3, 2.0))
                for p in (m.batch_weight, m.weight):
                    p.copy_(r(p, 0.5, 1.5))
                for p in (m.batch_bias, m.bias):
                    p.copy_(r(p, -0.3, 0.3))
            elif isinstance(m, Unitization2d):
                m.running_mean.copy_(r(m.running_mean, -0.5, 0.5))
                m.running_var.copy_(r(m.running_var, 0.3, 2.0))
                m.alpha.copy_(r(m.alpha, 0.1, 0.9))
                m.weight.copy_(r(m.weight, 0.5, 1.5))
                m.bias.copy_(r(m.bias, -0.3, 0.3))
            elif isinstance(m, (IterNorm, ChannelAffine)):
                m.weight.copy_(r(m.weight, 0.5, 1.5))
                m.bias.copy_(r(m.bias, -0.3, 0.3))
            elif isinstance(m, EquiConv2d):
                m.running_input_mean.copy_(r(m.running_input_mean, 0.2, 1.0))
            elif isinstance(m, GroupProxyNorm):
                m.weight.copy_(r(m.weight, 0.5, 1.5))
                m.bias.copy_(r(m.bias, -0.3, 0.3))
    return model


def _iternorm_running_stats_(model, x):
    """Give IterNorms real running statistics (a whitening matrix is not a random matrix)."""
    its = [m for m in model.modules() if isinstance(m, IterNorm)]
    for m in its:
        m.momentum = 1.0
    model.train()
    with torch.no_grad():
        model(x)
    for m in its:
        m.momentum = 0.1


def _check(model, x, min_folded=0):
    model.eval()
    with torch.no_grad():
        ref = model(x)
    stats = {}
    fused = fuse(copy.deepcopy(model), stats=stats)
    assert not any(isinstance(m, NORMDENSE_TYPES) for m in fused.modules()), fused
    assert not any(m.training for m in fused.modules()), [type(m).__name__ for m in fused.modules() if m.training]
    assert stats['folded'] >= min_folded, stats
    with torch.no_grad():
        out = fused(x)
    scale = ref.abs().max().item()
    diff = (out - ref).abs().max().item()
    assert diff <= 1e-4 * scale, (diff, scale)
    return fused


def _bcn(c, **kw):
    return BatchChannelNorm2d(c, num_groups=4, update_rate=0.1, **kw)


def _unit(c, **kw):
    return Unitization2d(c, **kw)


NORMS = {
    'bcn_estimate': lambda c: _bcn(c),
    'bcn_batch': lambda c: BatchChannelNorm2d(c, num_groups=4, mode='batch'),
    'bcn_channel_affine': lambda c: _bcn(c, group_affine=False),
    'unitization_batch': lambda c: _unit(c),
    'unitization_estimate_n': lambda c: _unit(c, mode='estimate', update_rate=0.1, n=7.0),
    'iternorm': lambda c: IterNorm(c, group_size=8, T=5),
    'iternorm_uneven': lambda c: IterNorm(c, group_size=12, T=3),
    'channel_affine': lambda c: ChannelAffine(c),
}
CONVS = {
    'ws': lambda ci, co, **kw: WSConv2d(ci, co, 3, padding=1, **kw),
    'ws_var_unbiased_s2': lambda ci, co, **kw: WSConv2d(ci, co, 3, stride=2, padding=1, formula='var_unbiased',
                                                        **kw),
    'equi': lambda ci, co, **kw: EquiConv2d(ci, co, 3, padding=1, **kw),
    'equi_s2': lambda ci, co, **kw: EquiConv2d(ci, co, 3, stride=2, padding=1, **kw),
    'plain': lambda ci, co, **kw: nn.Conv2d(ci, co, 3, padding=1, **kw),
}


@pytest.mark.parametrize('norm', sorted(NORMS))
@pytest.mark.parametrize('conv', sorted(CONVS))
@pytest.mark.parametrize('bias', [False, True])
def test_conv_norm_sequential(conv, norm, bias):
    torch.manual_seed(0)
    model = nn.Sequential(CONVS[conv](6, 16, bias=bias), NORMS[norm](16), nn.ReLU())
    _randomize_(model)
    x = torch.rand(2, 6, 11, 13)  # odd sizes: EquiNorm's rho != 1 for the strided conv
    _iternorm_running_stats_(model, x)
    fused = _check(model, x, min_folded=1)
    assert type(fused[0]) in (nn.Conv2d, RhoScaledConv2d)
    if 'equi_s2' == conv:
        assert type(fused[0]) is RhoScaledConv2d
    # a different input size after fusion (EquiNorm's rho, Unitization's n = H*W)
    model.eval()
    x2 = torch.rand(1, 6, 16, 9)
    with torch.no_grad():
        ref, out = model(x2), fused(x2)
    assert (out - ref).abs().max() <= 1e-4 * ref.abs().max()


@pytest.mark.parametrize('norm', sorted(NORMS))
def test_norm_without_conv(norm):
    """No conv in front (after a ReLU / as the whole model): a single affine / 1x1 map replaces it."""
    torch.manual_seed(1)
    layer = NORMS[norm](16)
    model = nn.Sequential(nn.Conv2d(6, 16, 1), nn.ReLU(), layer)
    _randomize_(model)
    x = torch.randn(2, 6, 9, 9)
    _iternorm_running_stats_(model, x)
    fused = _check(model, x)
    expected = {'iternorm': ChannelLinear, 'iternorm_uneven': ChannelLinear, 'channel_affine': ChannelAffine,
                'unitization_batch': UnitizationStage2, 'unitization_estimate_n': UnitizationStage2}
    if norm in expected:
        assert isinstance(fused[2], expected[norm])
    else:
        assert isinstance(fused[2], nn.Sequential) and type(fused[2][1]) is nn.GroupNorm
    # the layer itself as the model
    h = torch.relu(model[0](x)).detach()
    single = _check(copy.deepcopy(layer), h)
    assert not isinstance(single, NORMDENSE_TYPES)


@pytest.mark.parametrize('with_conv', [True, False], ids=['folded', 'standalone'])
def test_bcn_keeps_its_eps(with_conv):
    """A BCN with eps 1e-2 (both stages' eps): the fused channel stage keeps it (nn.GroupNorm's default 1e-5 made
    fused and unfused differ by 1.67 here)."""
    torch.manual_seed(6)
    conv = WSConv2d(6, 16, 3, padding=1) if with_conv else nn.Conv2d(6, 16, 1)
    model = nn.Sequential(conv, _bcn(16, eps=1e-2)) if with_conv else nn.Sequential(conv, nn.ReLU(), _bcn(16, eps=1e-2))
    _randomize_(model)
    with torch.no_grad():
        model[-1].running_var.mul_(1e-2)  # variances near eps, where eps counts
    fused = _check(model, 0.1 * torch.randn(2, 6, 7, 9), min_folded=int(with_conv))
    gn = fused[1] if with_conv else fused[2][1]
    assert type(gn) is nn.GroupNorm and gn.eps == 1e-2


def test_iternorm_on_features():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(10, 20), IterNorm(20, group_size=8))
    _randomize_(model)
    x = torch.randn(64, 10)
    _iternorm_running_stats_(model, x)
    _check(model, x)


def test_grouped_conv_then_iternorm_is_not_folded_across_groups():
    torch.manual_seed(3)
    model = nn.Sequential(WSConv2d(8, 16, 3, padding=1, groups=2), IterNorm(16, group_size=16))
    x = torch.randn(2, 8, 7, 7)
    _iternorm_running_stats_(model, x)
    fused = _check(model, x)
    assert type(fused[0]) is nn.Conv2d and isinstance(fused[1], ChannelLinear)


def test_single_convs():
    torch.manual_seed(4)
    ws = WSConv2d(4, 8, 3, padding=1, formula='std_unbiased')
    fused = _check(ws, torch.randn(1, 4, 8, 8))
    assert type(fused) is nn.Conv2d


GNPN = {
    'relu': dict(),
    'gelu_tanh': dict(act=dict(type='GELU', approximate='tanh')),
    'leaky_relu': dict(act=dict(type='LeakyReLU', negative_slope=0.2)),
    'mish_no_scaling': dict(act='mish', proxy_scaling=False),
    'silu_no_proxy_affine': dict(act='silu', proxy_affine=False),
    'ln_pn_softplus': dict(num_groups=1, act=dict(type='Softplus', beta=2.0, threshold=5.0)),
}


@pytest.mark.parametrize('case', sorted(GNPN))
def test_gnpn_becomes_group_norm_activation_affine(case):
    """GN+PN at inference: nn.GroupNorm (gamma, beta), phi's torch.nn module, the proxy normalization as one
    per-channel affine (constants of the parameters); equal to the eval layer, alone and in a model."""
    torch.manual_seed(4)
    kw = {'num_groups': 8, **GNPN[case]}
    model = nn.Sequential(WSConv2d(4, 32, 3), GroupProxyNorm(32, **kw))
    _randomize_(model)
    with torch.no_grad():
        if model[1].proxy_affine:
            model[1].proxy_beta.uniform_(-0.5, 0.5)
            model[1].proxy_gamma.uniform_(-0.5, 0.5)
    x = torch.randn(2, 4, 8, 8)
    fused = _check(model, x)
    gn, act, proxy = fused[1]
    assert type(gn) is nn.GroupNorm and gn.num_groups == kw['num_groups'] and type(proxy) is ChannelAffine
    assert type(act).__module__.startswith('torch.nn')
    assert not any(isinstance(m, GroupProxyNorm) for m in fused.modules())
    single = _check(copy.deepcopy(model[1]), torch.randn(2, 32, 5, 5))
    assert type(single) is nn.Sequential


def test_gnpn_fold_is_exact_in_float64():
    torch.manual_seed(5)
    layer = GroupProxyNorm(16, num_groups=4, act='gelu').double()
    _randomize_(layer)
    with torch.no_grad():
        layer.proxy_beta.uniform_(-0.5, 0.5)
        layer.proxy_gamma.uniform_(-0.5, 0.5)
    layer.eval()
    x = torch.randn(2, 16, 6, 6, dtype=torch.float64)
    with torch.no_grad():
        ref = layer(x)
        out = fuse(copy.deepcopy(layer))(x)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_fuse_refuses_training_mode():
    with pytest.raises(RuntimeError, match='eval'):
        fuse(nn.Sequential(WSConv2d(2, 4, 3), _bcn(4)))


def test_mmcv_conv_module_and_resnet_block():
    from mmcv.cnn import ConvModule
    from mmdet.models.backbones.resnet import Bottleneck

    import normdense  # noqa: F401  (registers the layers)
    torch.manual_seed(5)
    cm = ConvModule(6, 32, 3, padding=1, conv_cfg=dict(type='WSConv2d'),
                    norm_cfg=dict(type='BCN', num_groups=8, update_rate=0.1))
    _randomize_(cm)
    fused = _check(cm, torch.randn(2, 6, 9, 9), min_folded=1)
    assert type(fused.conv) is nn.Conv2d and type(fused.norm) is nn.GroupNorm
    # act before norm: not adjacent, so nothing is folded, but everything still becomes plain
    cm2 = ConvModule(6, 32, 3, padding=1, conv_cfg=dict(type='WSConv2d'), order=('conv', 'act', 'norm'),
                     norm_cfg=dict(type='IterNorm', group_size=16))
    x = torch.randn(2, 6, 9, 9)
    _iternorm_running_stats_(cm2, x)
    _check(cm2, x)
    down = nn.Sequential(WSConv2d(16, 64, 1, bias=False), _bcn(64))
    block = Bottleneck(16, 16, downsample=down, conv_cfg=dict(type='WSConv2d'),
                       norm_cfg=dict(type='BCN', num_groups=8, update_rate=0.1))
    _randomize_(block)
    _check(block, torch.randn(1, 16, 10, 10), min_folded=4)


@pytest.fixture(scope='module')
def mask_rcnn():
    from mmdet.testing import demo_mm_inputs

    from tests.mm_models import build_detector, mask_rcnn_cfg
    torch.manual_seed(0)
    cfg = mask_rcnn_cfg(conv_cfg=dict(type='WSConv2d'), norm_cfg=dict(type='BCN', num_groups=16))
    model = _randomize_(build_detector(cfg)).eval()
    data = demo_mm_inputs(1, image_shapes=[(3, 96, 128)], num_items=[3], num_classes=3, with_mask=True)
    data = model.data_preprocessor(data, False)
    return model, data


def _det_outputs(model, inputs, samples, proposals=None):
    feats = model.extract_feat(inputs)
    cls, reg = model.rpn_head(feats)
    if proposals is None:
        proposals = model.rpn_head.predict(feats, samples, rescale=False)
    roi = model.roi_head.forward(feats, proposals)
    return [*feats, *cls, *reg, *roi], proposals


def test_mask_rcnn_ws_bcn(mask_rcnn):
    model, data = mask_rcnn
    inputs, samples = data['inputs'], data['data_samples']
    with torch.no_grad():
        ref, proposals = _det_outputs(model, inputs, samples)
    stats = {}
    fused = fuse(copy.deepcopy(model), stats=stats)
    assert not any(isinstance(m, NORMDENSE_TYPES) for m in fused.modules())
    n_bcn = sum(isinstance(m, BatchChannelNorm2d) for m in model.modules())
    assert stats['folded'] == n_bcn and stats['standalone'] == 0, (stats, n_bcn)
    with torch.no_grad():
        out, _ = _det_outputs(fused, inputs, samples, proposals)
        # the whole pipeline too (boxes, scores, masks of the predictions)
        pred_ref = model.predict(inputs, copy.deepcopy(samples))[0].pred_instances
        pred_out = fused.predict(inputs, copy.deepcopy(samples))[0].pred_instances
    assert len(ref) == len(out) and len(ref) > 10
    for r, o in zip(ref, out):
        assert (o - r).abs().max() <= 1e-4 * r.abs().max(), ((o - r).abs().max(), r.abs().max())
    assert len(pred_ref) == len(pred_out)
    if len(pred_ref):
        assert torch.allclose(pred_out.scores, pred_ref.scores, rtol=0, atol=1e-4 * pred_ref.scores.abs().max())
        assert torch.allclose(pred_out.bboxes, pred_ref.bboxes, rtol=0, atol=1e-4 * pred_ref.bboxes.abs().max())


def test_fused_checkpoint_round_trip(mask_rcnn, tmp_path):
    """tools/deploy.py's file: a state_dict that load_fused puts back into a fused model built from config."""
    from normdense.deploy import load_fused, save_fused
    from tests.mm_models import mask_rcnn_cfg
    model, data = mask_rcnn
    fused = fuse(copy.deepcopy(model))
    path = tmp_path / 'fused.pth'
    save_fused(fused, str(path), meta=dict(config='inline'))
    cfg = dict(model=mask_rcnn_cfg(conv_cfg=dict(type='WSConv2d'), norm_cfg=dict(type='BCN', num_groups=16)),
               default_scope='mmdet')
    loaded = load_fused(cfg, str(path))
    with torch.no_grad():
        a = fused.extract_feat(data['inputs'])
        b = loaded.extract_feat(data['inputs'])
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_tools_deploy_cli(tmp_path):
    """tools/deploy.py CONFIG CHECKPOINT OUT on the demo config; load_fused gives the unfused outputs."""
    import importlib.util
    import os.path as osp

    from mmengine.config import Config

    from normdense.deploy import build_model_from_config, load_fused
    root = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
    config = osp.join(root, 'configs', 'demo', 'mask-rcnn_r18_fpn_bcn-ws_toy-coco.py')
    torch.manual_seed(0)
    model = _randomize_(build_detector_from(config, build_model_from_config))
    ckpt = tmp_path / 'trained.pth'
    torch.save(dict(state_dict=model.state_dict(), meta=dict()), ckpt)
    spec = importlib.util.spec_from_file_location('deploy_tool', osp.join(root, 'tools', 'deploy.py'))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    out = tmp_path / 'fused.pth'
    tool.main([config, str(ckpt), str(out)])
    fused = load_fused(Config.fromfile(config), str(out))
    assert not any(isinstance(m, NORMDENSE_TYPES) for m in fused.modules())
    x = torch.randn(1, 3, 64, 96)
    model.eval()
    with torch.no_grad():
        ref, got = model.extract_feat(x), fused.extract_feat(x)
    for r, o in zip(ref, got):
        assert (o - r).abs().max() <= 1e-4 * r.abs().max()


def build_detector_from(config, build):
    from mmengine.config import Config
    cfg = Config.fromfile(config)
    cfg.model.backbone.init_cfg = None  # the demo's pretrained backbone need not exist; weights are randomized
    model = build(cfg)
    model.init_weights()
    return model


FOLD_SMALL_VAR = {
    'unitization': lambda c: Unitization2d(c),
    'unitization_hw_squared': lambda c: Unitization2d(c, norm_divisor='hw_squared'),
    'unitization_estimate_no_affine': lambda c: Unitization2d(c, mode='estimate', update_rate=0.1, affine=False),
    'bcn_estimate': lambda c: _bcn(c),
}


@pytest.mark.parametrize('with_conv', [True, False], ids=['folded', 'standalone'])
@pytest.mark.parametrize('norm', sorted(FOLD_SMALL_VAR))
def test_folding_is_exact_in_float64_with_small_variances(norm, with_conv):
    """Running variances of 1e-4-1e-3 and WS weights of per-channel variance 1e-4-1e-3, where eps = 1e-5
    changes the result by a few per cent: the fused float64 model equals the unfused one to rounding (a fold
    that dropped eps, e.g. Unitization's eval affine or the WS standardization, passed the checks above)."""
    g = torch.Generator().manual_seed(7)
    layer = NORMS.get(norm, FOLD_SMALL_VAR[norm])(16).double()
    conv = WSConv2d(6, 16, 3, padding=1, bias=True).double()
    with torch.no_grad():
        scale = 1e-2 * (1 + 2 * torch.rand(16, 1, 1, 1, generator=g, dtype=torch.float64))  # std 0.01-0.03
        conv.weight.copy_(torch.randn(conv.weight.shape, generator=g, dtype=torch.float64) * scale + 0.1)
        layer.running_mean.copy_(torch.randn(16, generator=g, dtype=torch.float64) * 0.01)
        layer.running_var.copy_(1e-4 + 9e-4 * torch.rand(16, generator=g, dtype=torch.float64))
        for p in layer.parameters():
            p.copy_(p + 0.2 * torch.rand(p.shape, generator=g, dtype=torch.float64))
    model = nn.Sequential(conv, layer) if with_conv else nn.Sequential(nn.Conv2d(6, 16, 1).double(), nn.ReLU(),
                                                                      layer)
    x = 0.01 * torch.randn(2, 6, 7, 9, generator=g, dtype=torch.float64)
    model.eval()
    with torch.no_grad():
        ref = model(x)
        fused = fuse(copy.deepcopy(model))
        out = fused(x)
    assert not any(isinstance(m, NORMDENSE_TYPES) for m in fused.modules()), fused
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10 * ref.abs().max().item())
