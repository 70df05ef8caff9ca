import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import normdense  # noqa: F401  (registers GNPN, PNResNet)
from normdense.hooks.proxy_norm_check import ActivationAfterProxyNormGuard, check_proxy_norm_placement
from normdense.layers.proxy_norm import GroupProxyNorm
from normdense.models.backbones.pn_resnet import PNBasicBlock, PNBottleneck, PNResNet, PNResNetV1c

PN = dict(type='GNPN', num_groups=4)
GN = dict(type='GN', num_groups=4)


def pn_step(x, layer):
    """GN without affine, then Eq. 7 with ReLU and the 200 quantile proxy samples, written out."""
    n, c = x.shape[:2]
    xg = x.reshape(n, layer.num_groups, -1)
    z = ((xg - xg.mean(-1, keepdim=True)) / torch.sqrt(xg.var(-1, unbiased=False, keepdim=True) + layer.eps)).reshape(x.shape)
    gamma, beta = layer.weight.view(1, c, 1, 1), layer.bias.view(1, c, 1, 1)
    q = torch.tensor([math.sqrt(2) * torch.special.erfinv(torch.tensor(2 * (i + 0.5) / 200 - 1, dtype=torch.float64)).item()
                      for i in range(200)], dtype=x.dtype)
    proxy = layer.proxy_beta[:, None] + (1 + layer.proxy_gamma[:, None]) * q  # (C, 200)
    a = torch.relu(layer.weight[:, None] * proxy + layer.bias[:, None])
    mean, var = a.mean(1).view(1, c, 1, 1), a.var(1, unbiased=False).view(1, c, 1, 1)
    return (torch.relu(gamma * z + beta) - mean) / torch.sqrt(var + layer.proxy_eps)


def gn_affine(x, layer):
    return F.group_norm(x, layer.num_groups, layer.weight, layer.bias, layer.eps)


def conv(x, m):
    return F.conv2d(x, m.weight, m.bias, m.stride, m.padding, m.dilation, m.groups)


def randomize(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * (0.3 if 'proxy' in name else 0.5)
                    + (1.0 if name.endswith('weight') and p.dim() == 1 else 0.0))
    return module


def test_bottleneck_matches_hand_assembled_reference():
    downsample = nn.Sequential(nn.Conv2d(16, 32, 1, stride=2, bias=False), nn.GroupNorm(4, 32))
    block = PNBottleneck(16, 8, stride=2, downsample=downsample, norm_cfg=GN, pn_norm_cfg=PN)
    assert [type(block.norm1), type(block.norm2), type(block.norm3)] == [GroupProxyNorm, GroupProxyNorm, nn.GroupNorm]
    assert (block.norm1_name, block.norm2_name, block.norm3_name) == ('gn1', 'gn2', 'gn3')
    block = randomize(block).double()
    x = torch.randn(2, 16, 9, 9, dtype=torch.float64)
    with torch.no_grad():
        out = pn_step(conv(x, block.conv1), block.norm1)  # no separate ReLU: it is inside PN
        out = pn_step(conv(out, block.conv2), block.norm2)
        out = gn_affine(conv(out, block.conv3), block.norm3)  # plain affine GN before the add
        identity = gn_affine(conv(x, block.downsample[0]), block.downsample[1])
        expected = torch.relu(out + identity)  # the ReLU after the add stays
        torch.testing.assert_close(block(x), expected, rtol=1e-10, atol=1e-10)


def test_basic_block_matches_hand_assembled_reference():
    block = randomize(PNBasicBlock(8, 8, norm_cfg=GN, pn_norm_cfg=PN), seed=1).double()
    assert [type(block.norm1), type(block.norm2)] == [GroupProxyNorm, nn.GroupNorm]
    x = torch.randn(2, 8, 6, 6, dtype=torch.float64)
    with torch.no_grad():
        out = gn_affine(conv(pn_step(conv(x, block.conv1), block.norm1), block.conv2), block.norm2)
        torch.testing.assert_close(block(x), torch.relu(out + x), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize('deep_stem', [False, True])
def test_stem_and_whole_network_match_reference(deep_stem):
    model = PNResNet(depth=18, base_channels=8, stem_channels=16, norm_cfg=PN, deep_stem=deep_stem,
                     out_indices=(0, 3))
    model = randomize(model, seed=2).double().eval()
    x = torch.randn(1, 3, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        if deep_stem:
            h = x
            for i in (0, 3, 6):
                assert isinstance(model.stem[i + 1], GroupProxyNorm) and isinstance(model.stem[i + 2], nn.Identity)
                h = pn_step(conv(h, model.stem[i]), model.stem[i + 1])
        else:
            h = pn_step(conv(x, model.conv1), model.norm1)
        h = F.max_pool2d(h, 3, 2, 1)
        outs = []
        for i, name in enumerate(model.res_layers):
            for block in getattr(model, name):
                identity = h if block.downsample is None else gn_affine(conv(h, block.downsample[0]), block.downsample[1])
                r = pn_step(conv(h, block.conv1), block.norm1)
                h = torch.relu(gn_affine(conv(r, block.conv2), block.norm2) + identity)
            outs.append(h)
        got = model(x)
    assert len(got) == 2
    torch.testing.assert_close(got[0], outs[0], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(got[1], outs[3], rtol=1e-9, atol=1e-9)


def test_parameter_names_match_gn_resnet_and_gn_checkpoint_loads():
    from mmseg.models.backbones import ResNet, ResNetV1c
    for pn_cls, gn_cls in ((PNResNet, ResNet), (PNResNetV1c, ResNetV1c)):
        pn = pn_cls(depth=50, base_channels=8, stem_channels=16, norm_cfg=PN)
        gn = gn_cls(depth=50, base_channels=8, stem_channels=16, norm_cfg=GN)
        pn_keys = set(pn.state_dict())
        proxy = {k for k in pn_keys if 'proxy_' in k}
        assert pn_keys - proxy == set(gn.state_dict())
        # proxy params exactly where a ReLU followed a norm: stem (1 or 3) + 2 per bottleneck
        n_blocks = 3 + 4 + 6 + 3
        assert len(proxy) == 2 * ((3 if pn_cls is PNResNetV1c else 1) + 2 * n_blocks)
        result = pn.load_state_dict(gn.state_dict(), strict=False)
        assert set(result.missing_keys) == proxy and not result.unexpected_keys
    assert {'stem.1.weight', 'layer1.0.gn1.proxy_beta', 'layer1.0.gn3.weight', 'layer1.0.downsample.1.weight'} <= pn_keys


def test_no_activation_after_pn_and_plain_resnet_is_caught():
    from mmseg.models.backbones import ResNet
    x = torch.randn(1, 3, 32, 32)
    model = PNResNet(depth=50, base_channels=8, stem_channels=16, norm_cfg=PN)
    check_proxy_norm_placement(model)
    with ActivationAfterProxyNormGuard(model):
        model(x)
    wrong = ResNet(depth=18, base_channels=8, stem_channels=16, norm_cfg=PN)  # ReLU after each norm
    with pytest.raises(ValueError, match=r'relu \(ReLU\) is applied to the output of the PN layer gn1'):
        with ActivationAfterProxyNormGuard(wrong):
            wrong(x)


def test_init_weights_zero_init_residual_and_checkpointing():
    model = PNResNet(depth=50, base_channels=8, stem_channels=16, norm_cfg=PN)
    randomize(model)
    model.init_weights()
    block = model.layer1[0]
    assert torch.all(block.norm3.weight == 0) and torch.all(block.norm3.bias == 0)  # zero_init_residual
    assert torch.all(block.norm1.weight == 1) and torch.all(block.norm1.bias == 0)
    assert torch.all(model.norm1.weight == 1)
    basic = PNResNet(depth=18, base_channels=8, stem_channels=16, norm_cfg=PN)
    basic.init_weights()
    assert torch.all(basic.layer2[1].norm2.weight == 0)

    cp = PNResNet(depth=18, base_channels=8, stem_channels=16, norm_cfg=PN, with_cp=True)
    ref = PNResNet(depth=18, base_channels=8, stem_channels=16, norm_cfg=PN)
    ref.load_state_dict(randomize(cp).state_dict())
    x = torch.randn(1, 3, 32, 32, requires_grad=True)
    sum(o.sum() for o in cp(x)).backward()
    grad_cp = x.grad.clone()
    x.grad = None
    sum(o.sum() for o in ref(x)).backward()
    torch.testing.assert_close(grad_cp, x.grad)


def test_deeplab_style_dilated_v1c_and_frozen_stages():
    model = PNResNetV1c(depth=50, base_channels=8, stem_channels=16, norm_cfg=PN, dilations=(1, 1, 2, 4),
                        strides=(1, 2, 1, 1), contract_dilation=True, frozen_stages=1)
    model.train()
    outs = model(torch.randn(1, 3, 33, 33))
    assert [o.shape[-1] for o in outs] == [9, 5, 5, 5]
    assert not any(p.requires_grad for p in model.stem.parameters())
    assert not any(p.requires_grad for p in model.layer1.parameters())
    assert all(p.requires_grad for p in model.layer2.parameters())


def test_plain_norm_cfg_override_and_bad_norm_cfg():
    model = PNResNet(depth=18, base_channels=8, stem_channels=16, norm_cfg=dict(type='GNPN', num_groups=2, eps=1e-3),
                     plain_norm_cfg=dict(type='GN', num_groups=8))
    assert model.layer1[0].norm2.num_groups == 8 and model.layer1[0].norm1.num_groups == 2
    assert model.norm1.eps == 1e-3
    default = PNResNet(depth=18, base_channels=8, stem_channels=16, norm_cfg=dict(type='GNPN', num_groups=2, eps=1e-3))
    assert (default.layer1[0].norm2.num_groups, default.layer1[0].norm2.eps) == (2, 1e-3)
    with pytest.raises(ValueError, match="type='GNPN'"):
        PNResNet(depth=18, norm_cfg=dict(type='GN', num_groups=32))
    with pytest.raises(ValueError, match='num_groups=3 does not divide this layer'):
        PNResNet(depth=18, norm_cfg=dict(type='GNPN', num_groups=3))


def test_built_by_mmdet_mmseg_and_mmpretrain_registries():
    from mmdet.registry import MODELS as MMDET_MODELS
    from mmpretrain.registry import MODELS as MMPRETRAIN_MODELS
    from mmseg.registry import MODELS as MMSEG_MODELS
    cfg = dict(type='PNResNet', depth=18, base_channels=8, stem_channels=16, norm_cfg=PN)
    for registry in (MMDET_MODELS, MMSEG_MODELS, MMPRETRAIN_MODELS):
        assert isinstance(registry.build(cfg), PNResNet)
    assert isinstance(MMSEG_MODELS.build(dict(cfg, type='PNResNetV1c')), PNResNetV1c)


def test_mmpretrain_image_classifier_trains():
    from mmengine.registry import DefaultScope
    from mmpretrain.registry import MODELS
    from mmpretrain.structures import DataSample
    cfg = dict(
        type='ImageClassifier',
        backbone=dict(type='PNResNet', depth=18, base_channels=8, stem_channels=16, out_indices=(3, ), norm_cfg=PN),
        neck=dict(type='GlobalAveragePooling'),
        head=dict(type='LinearClsHead', num_classes=5, in_channels=64, loss=dict(type='CrossEntropyLoss')))
    with DefaultScope.overwrite_default_scope('mmpretrain'):  # other tests may leave mmdet/mmseg as default
        model = MODELS.build(cfg)
    model.init_weights()
    samples = [DataSample().set_gt_label(i) for i in (1, 3)]
    losses = model(torch.randn(2, 3, 32, 32), samples, mode='loss')
    losses['loss'].backward()
    assert torch.isfinite(losses['loss']) and isinstance(model.backbone, PNResNet)
    assert model.backbone.norm1.proxy_gamma.grad.abs().sum() > 0


PN32 = dict(type='GNPN', num_groups=32)
GN32 = dict(type='GN', num_groups=32)


def test_mask_rcnn_train_step_with_pn_backbone():
    from tests.mm_models import build_detector, det_train_step, mask_rcnn_cfg
    backbone = dict(type='PNResNet', depth=18, num_stages=4, out_indices=(0, 1, 2, 3), frozen_stages=-1,
                    norm_eval=False, style='pytorch', norm_cfg=PN32)
    # FPN has no activation after its norms and mmdet's box/mask heads hard-code ReLU: plain GN there
    model, losses = det_train_step(mask_rcnn_cfg(norm_cfg=GN32, backbone=backbone))
    assert isinstance(model.backbone, PNResNet) and losses['loss_mask'] > 0
    check_proxy_norm_placement(model)
    # PN's own parameters are trained (the stem's: block PNs get no gradient on the very first step
    # because zero_init_residual zeroes the norm after them)
    assert model.backbone.norm1.proxy_gamma.abs().sum() > 0 and model.backbone.norm1.proxy_beta.abs().sum() > 0

    # GNPN in the box/mask heads would sit under their hard-coded ReLU: caught with the module names
    wrong = build_detector(mask_rcnn_cfg(norm_cfg=PN32, backbone=backbone))
    with pytest.raises(ValueError, match=r'roi_head\.bbox_head\.shared_convs\.0 \(ConvModule\): ReLU applied'):
        check_proxy_norm_placement(wrong)


def test_deeplabv3_train_step_with_pn_backbone_and_heads():
    from tests.mm_models import deeplabv3_cfg, seg_train_step
    cfg = deeplabv3_cfg(norm_cfg=PN32, overrides={'backbone.type': 'PNResNetV1c', 'decode_head.act_cfg': None,
                                                  'auxiliary_head.act_cfg': None})
    model, losses = seg_train_step(cfg)  # batch size 1, ASPP image-pool branch on a 1x1 map included
    assert isinstance(model.backbone, PNResNetV1c) and model.backbone.deep_stem
    assert isinstance(model.decode_head.image_pool[1].norm, GroupProxyNorm)
    assert losses['decode.loss_ce'] > 0
    check_proxy_norm_placement(model)
    assert model.decode_head.bottleneck.norm.proxy_beta.abs().sum() > 0
