import pytest
import torch
import torch.nn.functional as F
from mmcv.cnn import ConvModule, build_conv_layer, build_norm_layer

import normdense  # noqa: F401  (registers 'EquiConv2d', 'ChannelAffine')
from normdense.layers.equinorm import ChannelAffine, EquiConv2d, balance_weight_signs_, equinorm_weight


def paper_weight(w, x_sums, r, single_pass):
    """Sec. 4.1 "Full case" (and the single-pass s) transcribed literally, float64, groups=1.

    w: (D, C, kh, kw); x_sums: v_c = sum_{i,j,k} x_icjk; r = batch * H_out * W_out * stride^2.
    """
    D, C, kh, kw = w.shape
    out = torch.empty_like(w)
    for d in range(D):
        num = sum(x_sums[c] * w[d, c].sum() for c in range(C))                 # sum_c v_c wbar_dc
        b = -num / (kh * kw * sum(x_sums[c] for c in range(C)))              # b_d
        den = 0.0
        for c in range(C):
            if single_pass:
                w_pos = sum(w[d, c, j, k] for j in range(kh) for k in range(kw) if w[d, c, j, k] > 0)
                n_pos = sum(1 for j in range(kh) for k in range(kw) if w[d, c, j, k] > 0)
                den = den + x_sums[c] * (w_pos + b * n_pos)
            else:
                w_pos = sum(w[d, c, j, k] + b for j in range(kh) for k in range(kw) if w[d, c, j, k] + b > 0)
                den = den + x_sums[c] * w_pos
        s = r / den                                                           # s_d
        out[d] = s * (w[d] + b)                                               # w''_dcjk
    return out


@pytest.mark.parametrize('single_pass', [True, False])
@pytest.mark.parametrize('stride,padding', [(1, 1), (2, 1), (1, 0)])
def test_matches_paper_full_case(single_pass, stride, padding):
    torch.manual_seed(0)
    conv = EquiConv2d(3, 4, 3, stride=stride, padding=padding, bias=False, single_pass=single_pass).double()
    x = torch.rand(2, 3, 7, 6, dtype=torch.float64)
    y = conv.train()(x)
    h_out, w_out = y.shape[2:]
    r = 2 * h_out * w_out * stride ** 2
    v = x.sum((0, 2, 3))
    expected_w = paper_weight(conv.weight.detach(), v, r, single_pass)
    torch.testing.assert_close(conv.normalized_weight(x.mean((0, 2, 3)), 7, 6), expected_w, rtol=1e-10,
                               atol=1e-12)
    torch.testing.assert_close(y, F.conv2d(x, expected_w, None, stride, padding), rtol=1e-10, atol=1e-10)


def test_grouped_conv_uses_each_groups_channels():
    torch.manual_seed(0)
    conv = EquiConv2d(4, 6, 3, padding=1, groups=2, bias=False).double()
    x = torch.rand(2, 4, 5, 5, dtype=torch.float64)
    y = conv.train()(x)
    r = 2 * 5 * 5
    v = x.sum((0, 2, 3))
    w = conv.weight.detach()
    expected = torch.cat([paper_weight(w[:3], v[:2], r, True), paper_weight(w[3:], v[2:], r, True)])
    torch.testing.assert_close(y, F.conv2d(x, expected, None, 1, 1, groups=2), rtol=1e-10, atol=1e-10)


def cyclic_conv(x, w):
    kh, kw = w.shape[2:]
    return F.conv2d(F.pad(x, (kw // 2, kw // 2, kh // 2, kh // 2), mode='circular'), w)


def test_balance_property_stride1_cyclic():
    """Sec. 4: with stride 1 and cyclic padding the output sums to 0 and the positive weights contribute
    exactly r = B H_out W_out (two-pass: the positive entries of w''; single pass: the entries whose sign
    was positive before adding b, which is what its s is computed from)."""
    torch.manual_seed(0)
    x = torch.rand(3, 5, 6, 7, dtype=torch.float64) + 0.1
    r = 3 * 6 * 7
    for single_pass in (False, True):
        conv = EquiConv2d(5, 4, 3, padding=1, padding_mode='circular', bias=False,
                          single_pass=single_pass).double().train()
        y = conv(x)
        w2 = conv.normalized_weight(x.mean((0, 2, 3)), 6, 7)
        torch.testing.assert_close(y, cyclic_conv(x, w2), rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(y.sum((0, 2, 3)), torch.zeros(4, dtype=torch.float64), rtol=0, atol=1e-9)
        pos_mask = (w2 > 0) if not single_pass else (conv.weight.detach() > 0)
        positive = cyclic_conv(x, w2 * pos_mask).sum((0, 2, 3))
        negative = cyclic_conv(x, w2 * ~pos_mask).sum((0, 2, 3))
        torch.testing.assert_close(positive, torch.full((4,), float(r), dtype=torch.float64), rtol=1e-10, atol=0)
        torch.testing.assert_close(negative, -positive, rtol=1e-10, atol=0)


def test_eval_uses_running_input_mean_and_transfers_across_shapes():
    torch.manual_seed(0)
    conv = EquiConv2d(3, 2, 3, padding=1, momentum=0.5, bias=False).double()
    x = torch.rand(2, 3, 5, 5, dtype=torch.float64)
    conv.train()(x)
    torch.testing.assert_close(conv.running_input_mean, 0.5 * 1.0 + 0.5 * x.mean((0, 2, 3)))
    # eval: v_c = running mean * (B H W) of the eval input, r from the eval shapes
    x2 = torch.rand(1, 3, 8, 6, dtype=torch.float64)
    y2 = conv.eval()(x2)
    v = conv.running_input_mean * (1 * 8 * 6)
    expected = paper_weight(conv.weight.detach(), v, 1 * 8 * 6, True)
    torch.testing.assert_close(y2, F.conv2d(x2, expected, None, 1, 1), rtol=1e-10, atol=1e-10)
    # and eval does not depend on the other samples of the batch
    y_single = conv(x2[:1])
    y_batch = conv(torch.cat([x2, torch.rand_like(x2) * 5]))[:1]
    torch.testing.assert_close(y_single, y_batch)


@pytest.mark.parametrize('single_pass', [True, False])
@pytest.mark.parametrize('training', [True, False])
def test_gradcheck(single_pass, training):
    torch.manual_seed(0)
    conv = EquiConv2d(2, 3, 3, stride=2, padding=1, single_pass=single_pass).double().train(training)
    x = torch.rand(2, 2, 5, 4, dtype=torch.float64, requires_grad=True)
    state = {k: v.clone() for k, v in conv.state_dict().items()}

    def fn(inp, weight, bias):
        conv.load_state_dict(state)
        return torch.func.functional_call(conv, {'weight': weight, 'bias': bias}, (inp,))

    inputs = (x, conv.weight.detach().clone().requires_grad_(), conv.bias.detach().clone().requires_grad_())
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-6, rtol=1e-5)


def test_balanced_init_and_init_weights():
    torch.manual_seed(0)
    conv = EquiConv2d(1, 64, (1, 2))  # 2 weights per output channel: one-signed kernels are common by chance
    flat = conv.weight.detach().view(64, -1)
    assert ((flat > 0).any(1) & (flat < 0).any(1)).all()
    with torch.no_grad():
        conv.weight.abs_()  # what a re-initialization could produce
    conv.init_weights()
    flat = conv.weight.detach().view(64, -1)
    assert ((flat > 0).any(1) & (flat < 0).any(1)).all()
    w = torch.zeros(3, 2, 2, 2)
    assert balance_weight_signs_(w) == 3
    assert ((w.view(3, -1) > 0).any(1) & (w.view(3, -1) < 0).any(1)).all()


def test_init_weights_runs_after_mmengine_init_cfg():
    from mmengine.model import BaseModule

    class Net(BaseModule):
        def __init__(self):
            super().__init__(init_cfg=dict(type='Constant', val=0.5, layer='Conv2d'))
            self.conv = EquiConv2d(4, 8, 3)

    net = Net()
    net.init_weights()
    flat = net.conv.weight.detach().view(8, -1)
    assert ((flat > 0).any(1) & (flat < 0).any(1)).all()
    assert torch.allclose(flat.abs(), torch.full_like(flat, 0.5))


def test_build_through_mmcv_and_state_dict_round_trip(tmp_path):
    conv = build_conv_layer(dict(type='EquiConv2d', momentum=0.2), 4, 8, 3, stride=2, padding=1, bias=False)
    assert isinstance(conv, EquiConv2d) and conv.momentum == 0.2 and conv.stride == (2, 2)
    name, affine = build_norm_layer(dict(type='ChannelAffine', requires_grad=True), 8, postfix=1)
    assert name == 'ca1' and isinstance(affine, ChannelAffine)
    cm = ConvModule(4, 8, 3, padding=1, conv_cfg=dict(type='EquiConv2d'), norm_cfg=dict(type='ChannelAffine'))
    assert isinstance(cm.conv, EquiConv2d) and cm.conv.bias is None and cm.norm_name == 'ca'
    x = torch.rand(2, 4, 6, 6)
    cm.train()(x)
    torch.save(cm.state_dict(), tmp_path / 'cm.pth')
    other = ConvModule(4, 8, 3, padding=1, conv_cfg=dict(type='EquiConv2d'), norm_cfg=dict(type='ChannelAffine'))
    other.load_state_dict(torch.load(tmp_path / 'cm.pth'))
    assert 'conv.running_input_mean' in other.state_dict()
    torch.testing.assert_close(other.eval()(x), cm.eval()(x))


def test_channel_affine():
    ca = ChannelAffine(3)
    with torch.no_grad():
        ca.weight.copy_(torch.tensor([1.0, 2.0, -1.0]))
        ca.bias.copy_(torch.tensor([0.0, 1.0, 0.5]))
    x = torch.randn(2, 3, 4, 4)
    torch.testing.assert_close(ca(x), x * ca.weight.view(1, 3, 1, 1) + ca.bias.view(1, 3, 1, 1))
    with pytest.raises(ValueError, match='expects'):
        ca(torch.randn(2, 4, 4, 4))


@pytest.mark.parametrize('kwargs', [dict(in_channels=1, out_channels=4, kernel_size=1),
                                    dict(in_channels=4, out_channels=4, kernel_size=1, groups=4),
                                    dict(in_channels=4, out_channels=4, kernel_size=3, momentum=2.0),
                                    dict(in_channels=4, out_channels=4, kernel_size=3, eps=-1.0)])
def test_bad_arguments_fail_at_build(kwargs):
    with pytest.raises(ValueError):
        build_conv_layer(dict(type='EquiConv2d'), **kwargs)


def test_functional_form_is_scale_invariant_in_v():
    """b and s only depend on v up to a common factor with r (why we can keep means instead of sums)."""
    torch.manual_seed(0)
    w = torch.randn(4, 3, 3, 3, dtype=torch.float64)
    m = torch.rand(3, dtype=torch.float64)
    torch.testing.assert_close(equinorm_weight(w, m, 0.7), equinorm_weight(w, m * 123.0, 0.7 * 123.0))


def test_empty_batch_keeps_running_mean():
    conv = EquiConv2d(4, 8, 3, padding=1).train()
    y = conv(torch.zeros(0, 4, 7, 7))
    assert y.shape == (0, 8, 7, 7)
    assert torch.equal(conv.running_input_mean, torch.ones(4)) and int(conv.num_batches_tracked) == 0


def test_warns_once_on_negative_input_means():
    conv = EquiConv2d(4, 8, 3, padding=1).train()
    with pytest.warns(UserWarning, match='non-negative'):
        conv(torch.randn(2, 4, 6, 6) - 1)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        conv(torch.randn(2, 4, 6, 6) - 1)


# --- inside mmdet / mmseg models built from config (tests/mm_models.py) -------------------------------
# EquiNorm assumes non-negative inputs (Sec. 5.2): images are fed in [0, 1] (no mean subtraction), and in
# Mask R-CNN only the backbone uses it (FPN output convs and the RoI heads' first convs see signed
# features; see docs/unitization_equinorm.md).
EQUI = dict(type='EquiConv2d')
AFFINE = dict(type='ChannelAffine', requires_grad=True)
UNIT_RANGE = {'data_preprocessor.mean': [0.0, 0.0, 0.0], 'data_preprocessor.std': [255.0, 255.0, 255.0]}


@pytest.mark.codebases
def test_mask_rcnn_training_step_backbone():
    import warnings

    from tests.mm_models import build_detector, det_train_step, mask_rcnn_cfg

    backbone = dict(type='ResNet', depth=18, num_stages=4, out_indices=(0, 1, 2, 3), frozen_stages=-1,
                    norm_eval=False, style='pytorch', conv_cfg=EQUI, norm_cfg=AFFINE)
    cfg = mask_rcnn_cfg(norm_cfg=dict(type='GN', num_groups=8), backbone=backbone, overrides=UNIT_RANGE)
    with warnings.catch_warnings():
        warnings.filterwarnings('error', message='EquiConv2d got input')  # every Equi conv sees >= 0 inputs
        model, losses = det_train_step(cfg)
    assert {'loss_rpn_cls', 'loss_cls', 'loss_bbox', 'loss_mask'} <= set(losses)
    assert losses['loss'] < 20  # sane magnitudes (signed inputs make b and s explode)
    convs = [m for m in model.backbone.modules() if isinstance(m, EquiConv2d)]
    assert len(convs) == 1 + 16 + 3 and all(int(m.num_batches_tracked) == 1 for m in convs)
    assert all(not torch.equal(m.running_input_mean, torch.ones_like(m.running_input_mean)) for m in convs)
    # the same seed rebuilds the initial weights: the step trained the stem and the last downsample conv
    # (inside residual branches mmdet's zero-initialised last affine blocks the first step's gradient)
    torch.manual_seed(0)
    init = build_detector(cfg)
    for name in ('backbone.conv1.weight', 'backbone.layer4.0.downsample.0.weight'):
        assert not torch.equal(model.state_dict()[name], init.state_dict()[name])
    # balanced signs survive mmdet's Kaiming init_cfg (EquiConv2d.init_weights runs after it)
    for m in init.backbone.modules():
        if isinstance(m, EquiConv2d):
            flat = m.weight.detach().flatten(1)
            assert ((flat > 0).any(1) & (flat < 0).any(1)).all()
    assert isinstance(model.backbone.norm1, ChannelAffine) and model.backbone.norm1_name == 'ca1'


@pytest.mark.codebases
def test_deeplabv3_training_step_everywhere():
    import warnings

    from tests.mm_models import deeplabv3_cfg, seg_train_step

    cfg = deeplabv3_cfg(conv_cfg=EQUI, norm_cfg=AFFINE, overrides=UNIT_RANGE)
    with warnings.catch_warnings():
        warnings.filterwarnings('error', message='EquiConv2d got input')
        model, losses = seg_train_step(cfg, batch_size=1)
    assert 'decode.loss_ce' in losses and losses['decode.loss_ce'] < 20
    assert sum(isinstance(m, EquiConv2d) for m in model.decode_head.modules()) >= 5
