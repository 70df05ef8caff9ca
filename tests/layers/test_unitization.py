import copy
import math
import re

import pytest
import torch
import torch.nn.functional as F
from mmcv.cnn import build_norm_layer

import normdense  # noqa: F401  (registers 'Unitization')
from normdense.layers import set_update_rate
from normdense.layers.unitization import Unitization2d


def randomize(layer, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer.alpha.copy_(torch.rand(layer.num_features, generator=g, dtype=layer.alpha.dtype) * 1.5 - 0.2)
        if layer.affine:
            layer.weight.copy_(torch.randn(layer.num_features, generator=g, dtype=layer.weight.dtype) * 0.5 + 1)
            layer.bias.copy_(torch.randn(layer.num_features, generator=g, dtype=layer.bias.dtype) * 0.5)
    return layer


def algorithm2(x, mean, var, alpha, gamma, beta, eps, n=None):
    """Algorithm 2 line by line, float64, with given stage-1 statistics (line 5: BN(x; D))."""
    N, C, H, W = x.shape
    HW = H * W
    n = HW if n is None else n
    xf = x.reshape(N, C, HW)
    y = torch.empty_like(xf)
    for k in range(N):
        s = 0.0                                                                     # line 2
        x_hat = torch.empty(C, HW, dtype=torch.float64)
        for i in range(C):
            for j in range(HW):
                x_hat[i, j] = (xf[k, i, j] - mean[i]) / math.sqrt(var[i] + eps)    # line 5
                s += x_hat[i, j].item() ** 2                                        # line 6
        s = s / n                                                                   # line 9
        p = 1 / math.sqrt(s + eps)                                                  # line 10
        for i in range(C):
            for j in range(HW):
                x_bar = (p * alpha[i] + (1 - alpha[i])) * x_hat[i, j]               # line 13
                y[k, i, j] = gamma[i] * x_bar + beta[i]                             # line 14
    return y.reshape(N, C, H, W)


def batch_moments(x):
    """Algorithm 1 lines 1-2 per channel over the mini-batch and positions (biased variance)."""
    C = x.shape[1]
    vals = x.transpose(0, 1).reshape(C, -1)
    mean = vals.sum(1) / vals.shape[1]
    var = ((vals - mean[:, None]) ** 2).sum(1) / vals.shape[1]
    return mean, var


def params(layer):
    return layer.alpha.detach(), layer.weight.detach(), layer.bias.detach()


@pytest.mark.parametrize('fused', [True, False])
def test_keras_conventions_match_algorithm2_with_their_divisor_and_variance(fused):
    """norm_divisor='hw_squared' divides the squared norm by (H*W)^2; var_correction='keras' normalizes a
    training batch with var * m / (m - 1 - eps) (m values per channel); running statistics unchanged."""
    torch.manual_seed(1)
    C, eps = 5, 1e-3
    layer = randomize(Unitization2d(C, eps=eps, norm_divisor='hw_squared', var_correction='keras',
                                    fused=fused).double())
    x = torch.randn(3, C, 4, 3, dtype=torch.float64) * 2 + 0.5
    mean, var = batch_moments(x)
    m = x.numel() / C
    expected = algorithm2(x, mean, var * m / (m - 1 - eps), *params(layer), eps, n=(4 * 3) ** 2)
    torch.testing.assert_close(layer.train()(x), expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(layer.running_var, 0.9 + 0.1 * var * m / (m - 1), rtol=1e-12, atol=1e-12)
    expected_eval = algorithm2(x, layer.running_mean, layer.running_var, *params(layer), eps, n=(4 * 3) ** 2)
    torch.testing.assert_close(layer.eval()(x), expected_eval, rtol=1e-10, atol=1e-10)
    assert "norm_divisor='hw_squared'" in repr(layer) and "var_correction='keras'" in repr(layer)


@pytest.mark.parametrize('kwargs, match', [(dict(norm_divisor='hw2'), 'norm_divisor'),
                                           (dict(norm_divisor='hw_squared', n=4.0), 'n=None only'),
                                           (dict(var_correction='unbiased'), 'var_correction')])
def test_keras_convention_options_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Unitization2d(4, **kwargs)


@pytest.mark.parametrize('n', [None, 7.0])
def test_batch_mode_matches_algorithm2(n):
    torch.manual_seed(0)
    C, eps = 5, 1e-5
    layer = randomize(Unitization2d(C, eps=eps, n=n).double())
    x = torch.randn(3, C, 4, 3, dtype=torch.float64) * 2 + 0.5
    mean, var = batch_moments(x)
    expected = algorithm2(x, mean, var, *params(layer), eps, n)
    y = layer.train()(x)
    torch.testing.assert_close(y, expected, rtol=1e-10, atol=1e-10)
    # running statistics as nn.BatchNorm (momentum 0.1, unbiased variance)
    m = x.numel() / C
    torch.testing.assert_close(layer.running_mean, 0.1 * mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(layer.running_var, 0.9 + 0.1 * var * m / (m - 1), rtol=1e-12, atol=1e-12)
    # eval: the same formula with the running statistics
    y_eval = layer.eval()(x)
    expected_eval = algorithm2(x, layer.running_mean, layer.running_var, *params(layer), eps, n)
    torch.testing.assert_close(y_eval, expected_eval, rtol=1e-10, atol=1e-10)
    assert not torch.allclose(y_eval, y)


def test_alpha_zero_is_batchnorm():
    torch.manual_seed(0)
    layer = Unitization2d(6)
    x = torch.randn(2, 6, 5, 5)
    torch.testing.assert_close(layer.train()(x), F.batch_norm(x, None, None, training=True, eps=1e-5))


def test_flat_input_is_algorithm1():
    """(N, C) input: n = 1 and p = 1 / sqrt(||x_hat||^2 + eps) (Algorithm 1 lines 1-7)."""
    torch.manual_seed(0)
    C, eps = 4, 1e-5
    layer = randomize(Unitization2d(C, eps=eps).double())
    x = torch.randn(6, C, dtype=torch.float64)
    mean, var = x.mean(0), x.var(0, correction=0)
    alpha, gamma, beta = params(layer)
    expected = torch.empty_like(x)
    for i in range(6):
        x_hat = (x[i] - mean) / torch.sqrt(var + eps)
        p = 1 / math.sqrt((x_hat ** 2).sum().item() + eps)
        expected[i] = gamma * ((p * alpha + 1 - alpha) * x_hat) + beta
    torch.testing.assert_close(layer.train()(x), expected, rtol=1e-10, atol=1e-10)


def test_estimate_mode_matches_bcn_estimates_then_algorithm2():
    torch.manual_seed(0)
    C, eps, r = 4, 1e-5, 0.25
    layer = randomize(Unitization2d(C, eps=eps, mode='estimate').double())
    mu0, var0 = torch.randn(C, dtype=torch.float64), torch.rand(C, dtype=torch.float64) + 0.5
    with torch.no_grad():
        layer.running_mean.copy_(mu0)
        layer.running_var.copy_(var0)
    assert layer.needs_update_rate
    assert set_update_rate(layer, r) == 1
    x = torch.randn(2, C, 3, 3, dtype=torch.float64) * 1.5 + 2
    vals = x.transpose(0, 1).reshape(C, -1)
    mu_dot = vals.mean(1)
    var_dot = ((vals - mu0[:, None]) ** 2).mean(1)          # around the old estimate (BCN Alg. 1 step 2)
    mu1 = mu0 + r * (mu_dot - mu0)
    var1 = var0 + r * (var_dot - var0)
    expected = algorithm2(x, mu1, var1, *params(layer), eps)
    y = layer.train()(x)
    torch.testing.assert_close(y, expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(layer.running_mean, mu1, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(layer.running_var, var1, rtol=1e-12, atol=1e-12)
    # eval normalizes with the estimates without moving them
    before = layer.running_mean.clone(), layer.running_var.clone()
    y_eval = layer.eval()(x)
    torch.testing.assert_close(y_eval, expected, rtol=1e-10, atol=1e-10)
    assert torch.equal(layer.running_mean, before[0]) and torch.equal(layer.running_var, before[1])


def test_estimate_mode_fixed_rate_and_batch1_1x1():
    layer = randomize(Unitization2d(8, mode='estimate', update_rate=0.1).double())
    assert not layer.needs_update_rate
    x = torch.randn(1, 8, 1, 1, dtype=torch.float64, requires_grad=True)
    y = layer.train()(x)
    y.pow(2).sum().backward()
    mean = 0.1 * x.detach().flatten()                                  # steps 3-4 from (0, 1)
    var = 0.9 + 0.1 * x.detach().flatten().square()
    torch.testing.assert_close(layer.running_mean, mean, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(layer.running_var, var, rtol=1e-12, atol=1e-14)
    # Algorithm 2 with those estimates as constants: output and gradients
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, layer.alpha, layer.weight, layer.bias)]
    x_hat = (leaves[0] - mean.view(1, -1, 1, 1)) / torch.sqrt(var.view(1, -1, 1, 1) + layer.eps)
    p = torch.rsqrt(x_hat.square().sum() / 1 + layer.eps)
    a = leaves[1].view(1, -1, 1, 1)
    ref = leaves[2].view(1, -1, 1, 1) * (p * a + 1 - a) * x_hat + leaves[3].view(1, -1, 1, 1)
    ref.pow(2).sum().backward()
    torch.testing.assert_close(y, ref.detach(), rtol=1e-10, atol=1e-12)
    for got, want in zip((x, layer.alpha, layer.weight, layer.bias), leaves):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-10, atol=1e-12)


def test_estimate_mode_without_rate_fails_loudly():
    layer = Unitization2d(4, mode='estimate').train()
    with pytest.raises(RuntimeError, match='no update rate'):
        layer(torch.randn(2, 4, 3, 3))
    layer.eval()(torch.randn(2, 4, 3, 3))  # eval needs no rate


def test_batch_mode_single_value_per_channel_is_a_clear_error():
    with pytest.raises(ValueError, match="mode='estimate'"):
        Unitization2d(4).train()(torch.randn(1, 4, 1, 1))


@pytest.mark.parametrize('kwargs', [dict(n=0), dict(n=-3), dict(n='hw'), dict(mode='batchy'), dict(eps=0),
                                    dict(momentum=1.5), dict(update_rate=0.1),
                                    dict(mode='estimate', update_rate=2.0)])
def test_bad_arguments_fail_at_build(kwargs):
    with pytest.raises(ValueError):
        build_norm_layer(dict(type='Unitization', **kwargs), 8)


def test_wrong_channel_count():
    with pytest.raises(ValueError, match='expects'):
        Unitization2d(4)(torch.randn(2, 5, 3, 3))


@pytest.mark.parametrize('mode,training', [('batch', True), ('batch', False), ('estimate', True)])
def test_gradcheck(mode, training):
    """float64 gradcheck w.r.t. input, alpha, gamma, beta. In estimate mode the estimates are constants for
    autograd by design (not trained by the loss), so the check runs with r = 0 (estimates fixed at
    non-trivial values); the training-mode update itself is covered by the transcription test."""
    torch.manual_seed(0)
    layer = randomize(Unitization2d(3, mode=mode, update_rate=0.0 if mode == 'estimate' else None).double())
    with torch.no_grad():
        layer.running_mean.copy_(torch.randn(3))
        layer.running_var.copy_(torch.rand(3) + 0.5)
    layer.train(training)
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    x = torch.randn(2, 3, 3, 2, dtype=torch.float64, requires_grad=True)

    def fn(inp, alpha, weight, bias):
        layer.load_state_dict(state)  # identical buffers for every evaluation
        return torch.func.functional_call(layer, {'alpha': alpha, 'weight': weight, 'bias': bias}, (inp,))

    inputs = (x,) + tuple(p.detach().clone().requires_grad_() for p in params(layer))
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-6, rtol=1e-5)


def test_build_norm_layer_and_state_dict_round_trip(tmp_path):
    name, layer = build_norm_layer(dict(type='Unitization', n=16, momentum=0.05, requires_grad=False), 6,
                                   postfix=2)
    assert name == 'un2' and isinstance(layer, Unitization2d)
    assert layer.eps == 1e-5 and layer.n == 16 and layer.momentum == 0.05
    assert all(not p.requires_grad for p in layer.parameters())
    randomize(layer)
    layer.train()(torch.randn(2, 6, 4, 4))
    torch.save(layer.state_dict(), tmp_path / 'u.pth')
    other = Unitization2d(6, n=16)
    other.load_state_dict(torch.load(tmp_path / 'u.pth'))
    assert set(other.state_dict()) == {'alpha', 'weight', 'bias', 'running_mean', 'running_var',
                                       'num_batches_tracked'}
    x = torch.randn(3, 6, 4, 4)
    torch.testing.assert_close(other.eval()(x), layer.eval()(x))


def test_no_affine_and_half_precision():
    layer = Unitization2d(4, affine=False)
    with torch.no_grad():
        layer.alpha.fill_(0.7)
    assert layer.weight is None and [n for n, _ in layer.named_parameters()] == ['alpha']
    x = (torch.randn(2, 4, 8, 8) * 300).half()
    y = copy.deepcopy(layer).train()(x)
    ref = layer.double().train()(x.double())  # the same half values, in float64
    assert y.dtype == torch.float16
    torch.testing.assert_close(y.double(), ref, rtol=2e-3, atol=2e-3)  # fp16 output rounding (2^-11 relative)


@pytest.mark.parametrize('mode', ['batch', 'estimate'])
def test_empty_batch_keeps_buffers(mode):
    """mmdet's RoI heads can see zero RoIs: no NaN statistics may reach the buffers."""
    layer = Unitization2d(4, mode=mode, update_rate=0.1 if mode == 'estimate' else None).train()
    y = layer(torch.zeros(0, 4, 7, 7, requires_grad=True))
    assert y.shape == (0, 4, 7, 7)
    y.sum().backward()
    assert torch.equal(layer.running_mean, torch.zeros(4)) and torch.equal(layer.running_var, torch.ones(4))
    # in the graph (DDP sees every parameter used) with an exact zero gradient
    for p in layer.parameters():
        assert torch.equal(p.grad, torch.zeros_like(p))


# --- inside mmdet / mmseg models built from config (tests/mm_models.py) -------------------------------

@pytest.mark.codebases
def test_mask_rcnn_training_step_estimate_mode():
    from tests.mm_models import det_train_step, mask_rcnn_cfg

    norm_cfg = dict(type='Unitization', mode='estimate', requires_grad=True)
    model, losses = det_train_step(mask_rcnn_cfg(norm_cfg=norm_cfg))
    assert {'loss_rpn_cls', 'loss_cls', 'loss_bbox', 'loss_mask'} <= set(losses)
    layers = [m for m in model.modules() if isinstance(m, Unitization2d)]
    # stem + 16 in basic blocks + 3 downsample + 4 lateral + 4 FPN + 4 bbox-head + 4 mask-head convs
    assert len(layers) == 1 + 16 + 3 + 8 + 4 + 4
    assert all(bool((m.running_mean != 0).any()) for m in layers if m.training)  # estimates moved
    assert model.backbone.layer1[0].norm1 is model.backbone.layer1[0].un1


@pytest.mark.codebases
def test_mask_rcnn_training_step_batch_mode():
    from tests.mm_models import det_train_step, mask_rcnn_cfg

    model, losses = det_train_step(mask_rcnn_cfg(norm_cfg=dict(type='Unitization')), batch_size=2)
    assert all(v == v for v in losses.values())
    layers = {n: m for n, m in model.named_modules() if isinstance(m, Unitization2d)}
    assert layers and all(int(m.num_batches_tracked) >= 1 for m in layers.values())
    # alpha (init 0) is trained. mmdet zero-initialises gamma of each residual branch's last norm, which
    # blocks the first step's gradient to everything inside the branch; elsewhere alpha moved.
    in_branch = re.compile(r'backbone\.layer\d\.\d\.un[12]$')
    outside = [n for n in layers if not in_branch.match(n)]
    assert len(outside) == 1 + 3 + 8 + 4 + 4
    assert all(bool((layers[n].alpha != 0).any()) for n in outside)
    assert all(bool((m.weight != 0).any()) for n, m in layers.items() if n.endswith('un2'))


@pytest.mark.codebases
def test_deeplabv3_training_step_batch_one_estimate_mode():
    """Batch size 1: ASPP's image-pool branch normalizes a 1x1 map, which only estimate mode can do."""
    from mmcv.cnn import ConvModule

    from tests.mm_models import deeplabv3_cfg, seg_train_step

    norm_cfg = dict(type='Unitization', mode='estimate', requires_grad=True)
    model, losses = seg_train_step(deeplabv3_cfg(norm_cfg=norm_cfg), batch_size=1)
    assert 'decode.loss_ce' in losses
    pool_norms = [m.norm for m in model.decode_head.image_pool.modules() if isinstance(m, ConvModule)]
    assert pool_norms and isinstance(pool_norms[0], Unitization2d) and (pool_norms[0].running_mean != 0).any()
