import copy
import math

import pytest
import torch
import torch.nn as nn
from mmcv.cnn import build_norm_layer

import normdense  # noqa: F401  (registers BCN)
from normdense.layers import set_update_rate
from normdense.layers.bcn import BatchChannelNorm2d


def random_affines(bcn, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in bcn.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5 + (1.0 if name.endswith('weight') else 0.0))
    return bcn


def channel_stage(xd, G, gamma_c, beta_c, eps, group_affine):
    """Eq. 42 element by element: per sample b and group g, normalize over C/G x H x W."""
    B, C, H, W = xd.shape
    y = torch.empty_like(xd)
    cg = C // G
    for b in range(B):
        for g in range(G):
            block = xd[b, g * cg:(g + 1) * cg]
            n = block.numel()
            mu = block.sum().item() / n
            var = ((block - mu) ** 2).sum().item() / n
            for k in range(cg):
                c = g * cg + k
                gam, bet = (gamma_c[g], beta_c[g]) if group_affine else (gamma_c[c], beta_c[c])
                y[b, c] = gam * (xd[b, c] - mu) / math.sqrt(var + eps) + bet
    return y


def algorithm1(x, mu_hat, var_hat, r, gamma_b, beta_b, gamma_c, beta_c, G, eps, group_affine):
    """Algorithm 1 (micro-batch BCN), float64, explicit sums."""
    B, C, H, W = x.shape
    mu_hat, var_hat = mu_hat.clone(), var_hat.clone()
    xd = torch.empty_like(x)
    for c in range(C):
        vals = x[:, c]
        n = vals.numel()
        mu_dot = vals.sum().item() / n                                   # step 1
        var_dot = ((vals - mu_hat[c]) ** 2).sum().item() / n             # step 2
        mu_hat[c] = mu_hat[c] + r * (mu_dot - mu_hat[c])                 # step 3
        var_hat[c] = var_hat[c] + r * (var_dot - var_hat[c])             # step 4
        xd[:, c] = gamma_b[c] * (vals - mu_hat[c]) / math.sqrt(var_hat[c] + eps) + beta_b[c]  # step 5
    return channel_stage(xd, G, gamma_c, beta_c, eps, group_affine), mu_hat, var_hat   # steps 6-8


@pytest.mark.parametrize('group_affine', [True, False])
def test_estimate_mode_matches_algorithm1(group_affine):
    torch.manual_seed(0)
    C, G, eps, r = 8, 4, 1e-5, 0.3
    bcn = random_affines(BatchChannelNorm2d(C, num_groups=G, group_affine=group_affine, eps=eps).double())
    with torch.no_grad():
        bcn.running_mean.copy_(torch.randn(C))
        bcn.running_var.copy_(torch.rand(C) + 0.5)
    set_update_rate(bcn, r)
    x = torch.randn(2, C, 3, 5, dtype=torch.float64) * 2 + 1
    expected, mu, var = algorithm1(x, bcn.running_mean, bcn.running_var, r, bcn.batch_weight.detach(),
                                   bcn.batch_bias.detach(), bcn.weight.detach(), bcn.bias.detach(), G, eps,
                                   group_affine)
    y = bcn.train()(x)
    torch.testing.assert_close(y, expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(bcn.running_mean, mu, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(bcn.running_var, var, rtol=1e-12, atol=1e-12)


def test_batch_mode_matches_eq40_43():
    torch.manual_seed(0)
    C, G, eps = 6, 3, 1e-5
    bcn = random_affines(BatchChannelNorm2d(C, num_groups=G, mode='batch', eps=eps).double())
    x = torch.randn(4, C, 3, 3, dtype=torch.float64) * 3 - 1
    xd = torch.empty_like(x)
    for c in range(C):
        vals = x[:, c]
        mu = vals.sum().item() / vals.numel()
        var = ((vals - mu) ** 2).sum().item() / vals.numel()
        xd[:, c] = bcn.batch_weight[c].item() * (vals - mu) / math.sqrt(var + eps) + bcn.batch_bias[c].item()
    expected = channel_stage(xd, G, bcn.weight.detach(), bcn.bias.detach(), eps, True)
    torch.testing.assert_close(bcn.train()(x), expected, rtol=1e-10, atol=1e-10)
    # running statistics follow BN's momentum rule and are what eval uses
    unbiased = x.transpose(0, 1).reshape(C, -1).var(1)
    torch.testing.assert_close(bcn.running_var, 0.9 + 0.1 * unbiased)


def test_eval_uses_estimates_without_updating():
    bcn = BatchChannelNorm2d(8, num_groups=2)
    with torch.no_grad():
        bcn.running_mean.fill_(3.0)
        bcn.running_var.fill_(4.0)
    bcn.eval()
    x = torch.randn(1, 8, 4, 4) + 3.0
    y1 = bcn(x)  # no rate needed in eval
    assert torch.equal(bcn.running_mean, torch.full((8,), 3.0))
    set_update_rate(bcn, 0.5)
    y2 = bcn.train()(x)
    assert not torch.equal(bcn.running_mean, torch.full((8,), 3.0))
    # the train output normalizes with the *updated* estimates, so it differs from eval's
    assert not torch.allclose(y1, y2)


def bcn_transcription(x, mu_hat, var_hat, bw, bb, w, b, G, eps):
    """Eq. 40 and 42 with the estimates as constants, differentiable (float64): per-group affine."""
    xd = bw.view(1, -1, 1, 1) * (x - mu_hat.view(1, -1, 1, 1)) / torch.sqrt(var_hat.view(1, -1, 1, 1) + eps) \
        + bb.view(1, -1, 1, 1)
    B, C, H, W = x.shape
    grouped = xd.reshape(B, G, -1)
    mu = grouped.mean(2, keepdim=True)
    var = (grouped - mu).square().mean(2, keepdim=True)
    yd = ((grouped - mu) / torch.sqrt(var + eps)).reshape(B, G, C // G, H, W)
    return (yd * w.view(1, G, 1, 1, 1) + b.view(1, G, 1, 1, 1)).reshape(B, C, H, W)


def test_estimates_are_not_trained_by_the_loss():
    """The loss's gradient treats the (updated) estimates as constants: equal to the gradient of Eq. 40/42
    with Algorithm 1's step 3-4 estimates plugged in as numbers."""
    torch.manual_seed(0)
    bcn = random_affines(BatchChannelNorm2d(4, num_groups=2, update_rate=0.1).double())
    x = (torch.randn(2, 4, 3, 3, dtype=torch.float64) * 2 + 1).requires_grad_(True)
    _, mu, var = algorithm1(x.detach(), bcn.running_mean, bcn.running_var, 0.1, bcn.batch_weight.detach(),
                            bcn.batch_bias.detach(), bcn.weight.detach(), bcn.bias.detach(), 2, bcn.eps, True)
    bcn(x).pow(2).sum().backward()
    names = [n for n, p in bcn.named_parameters()]
    assert 'running_mean' not in names and 'running_var' not in names
    leaves = [x.detach().clone().requires_grad_(True)] + [p.detach().clone().requires_grad_(True) for p in
                                                          (bcn.batch_weight, bcn.batch_bias, bcn.weight, bcn.bias)]
    bcn_transcription(leaves[0], mu, var, *leaves[1:], 2, bcn.eps).pow(2).sum().backward()
    for got, ref in zip([x, bcn.batch_weight, bcn.batch_bias, bcn.weight, bcn.bias], leaves):
        torch.testing.assert_close(got.grad, ref.grad, rtol=1e-10, atol=1e-12)


def test_missing_rate_fails_loudly_in_training():
    bcn = BatchChannelNorm2d(4, num_groups=2)
    with pytest.raises(RuntimeError, match='BCNRateHook'):
        bcn.train()(torch.randn(1, 4, 2, 2))


def test_layer_called_twice_before_backward():
    """Each call of one iteration normalizes as its only call would (same starting estimates): the
    gradients equal those of two copies of the layer called once each."""
    torch.manual_seed(0)
    bcn = random_affines(BatchChannelNorm2d(4, num_groups=2, update_rate=0.5).double())
    x1 = torch.randn(1, 4, 3, 3, dtype=torch.float64, requires_grad=True)
    x2 = torch.randn(1, 4, 2, 2, dtype=torch.float64, requires_grad=True)
    copies = [copy.deepcopy(bcn) for _ in range(2)]
    r1, r2 = x1.detach().clone().requires_grad_(True), x2.detach().clone().requires_grad_(True)
    (bcn(x1).sum() + bcn(x2).pow(2).sum()).backward()
    (copies[0](r1).sum() + copies[1](r2).pow(2).sum()).backward()
    torch.testing.assert_close(x1.grad, r1.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x2.grad, r2.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(bcn.batch_weight.grad, copies[0].batch_weight.grad + copies[1].batch_weight.grad,
                               rtol=1e-12, atol=1e-12)


def test_batch_size_one_with_1x1_map():
    torch.manual_seed(0)
    bcn = random_affines(BatchChannelNorm2d(64, num_groups=32, update_rate=0.02).double())
    x = torch.randn(1, 64, 1, 1, dtype=torch.float64)
    expected, mu, _ = algorithm1(x, bcn.running_mean, bcn.running_var, 0.02, bcn.batch_weight.detach(),
                                 bcn.batch_bias.detach(), bcn.weight.detach(), bcn.bias.detach(), 32, bcn.eps, True)
    y = bcn.train()(x)
    assert y.shape == (1, 64, 1, 1)
    torch.testing.assert_close(y, expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(bcn.running_mean, mu, rtol=1e-12, atol=1e-12)


def test_gradcheck_float64():
    torch.manual_seed(0)
    x = torch.randn(2, 4, 3, 3, dtype=torch.float64, requires_grad=True)
    for bcn in (BatchChannelNorm2d(4, num_groups=2, update_rate=0.0),   # deterministic estimate mode
                BatchChannelNorm2d(4, num_groups=2, mode='batch', group_affine=False)):
        bcn = random_affines(bcn.double().train())
        assert torch.autograd.gradcheck(lambda inp, *ps: bcn(inp), (x, *bcn.parameters()))


def test_state_dict_round_trip():
    bcn = random_affines(BatchChannelNorm2d(8, num_groups=4, update_rate=0.2))
    bcn.train()(torch.randn(2, 8, 3, 3) * 5)
    other = BatchChannelNorm2d(8, num_groups=4, update_rate=0.2)
    other.load_state_dict(bcn.state_dict())
    assert set(bcn.state_dict()) == {'weight', 'bias', 'batch_weight', 'batch_bias', 'running_mean', 'running_var',
                                     'num_batches_tracked'}
    assert int(other.num_batches_tracked) == 1
    x = torch.randn(1, 8, 3, 3)
    torch.testing.assert_close(other.eval()(x), bcn.eval()(x))


def test_build_norm_layer_and_bad_configs():
    name, layer = build_norm_layer(dict(type='BCN', num_groups=16, mode='estimate'), 64, postfix=2)
    assert name == 'bcn2' and isinstance(layer, BatchChannelNorm2d) and layer.eps == 1e-5
    assert layer.weight.shape == (16,)
    with pytest.raises(ValueError, match='divide'):
        build_norm_layer(dict(type='BCN', num_groups=32), 48)
    with pytest.raises(ValueError, match='mode'):
        build_norm_layer(dict(type='BCN', mode='micro'), 64)
    with pytest.raises(ValueError, match='update_rate'):
        build_norm_layer(dict(type='BCN', mode='batch', update_rate=0.1), 64)


def test_norm_decay_mult_exempts_all_bcn_parameters():
    from mmengine.optim import DefaultOptimWrapperConstructor
    model = nn.Sequential(nn.Conv2d(3, 8, 3), BatchChannelNorm2d(8, num_groups=4, update_rate=0.1))
    constructor = DefaultOptimWrapperConstructor(
        dict(type='OptimWrapper', optimizer=dict(type='SGD', lr=0.1, weight_decay=1e-4)),
        paramwise_cfg=dict(norm_decay_mult=0.0))
    optim = constructor(model).optimizer
    decay = {id(p): g['weight_decay'] for g in optim.param_groups for p in g['params']}
    assert decay[id(model[0].weight)] == 1e-4
    assert [decay[id(p)] for p in model[1].parameters()] == [0.0] * 4


@pytest.mark.codebases
def test_norm_eval_does_not_half_freeze_bcn():
    from mmdet.models.backbones import ResNet
    net = ResNet(18, num_stages=1, strides=(1,), dilations=(1,), out_indices=(0,), norm_cfg=dict(type='BCN', num_groups=8, update_rate=0.5),
                 norm_eval=True)
    net.train()
    bcns = [m for m in net.modules() if isinstance(m, BatchChannelNorm2d)]
    assert bcns and all(m.training for m in bcns)
    before = bcns[0].running_mean.clone()
    net(torch.randn(1, 3, 32, 32))
    assert not torch.equal(before, bcns[0].running_mean)


def test_convert_norm_carries_bn_statistics_and_gn_affine():
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(8)
    bn.train()(torch.randn(16, 8, 4, 4) * 3 + 2)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 2)
        bn.bias.uniform_(-1, 1)
    model = nn.Sequential(nn.Conv2d(3, 8, 1), bn, nn.GroupNorm(4, 8))
    with torch.no_grad():
        model[2].weight.uniform_(0.5, 2)
    bn_eval = bn.eval()
    x = torch.randn(2, 8, 5, 5)
    bn_out = bn_eval(x)
    gn_ref = nn.GroupNorm(4, 8)
    gn_ref.load_state_dict(model[2].state_dict())
    BatchChannelNorm2d.convert_norm(model, num_groups=4, group_affine=False)
    bcn_bn, bcn_gn = model[1], model[2]
    assert isinstance(bcn_bn, BatchChannelNorm2d) and isinstance(bcn_gn, BatchChannelNorm2d)
    torch.testing.assert_close(bcn_bn.running_mean, bn.running_mean)
    # the first stage is exactly the eval-mode BN; the whole layer adds a GN on top of it
    torch.testing.assert_close(bcn_bn.eval()._batch_stage(x), bn_out)
    torch.testing.assert_close(bcn_bn.eval()(x), nn.functional.group_norm(bn_out, 4, eps=1e-5))
    # GN -> BCN keeps the GN's function (identity first stage up to eps)
    torch.testing.assert_close(bcn_gn.eval()(x), gn_ref(x), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match='group_affine=False'):
        BatchChannelNorm2d.convert_norm(model_gn_with_varying_affine())


def model_gn_with_varying_affine():
    gn = nn.GroupNorm(2, 4)
    with torch.no_grad():
        gn.weight.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    return gn


@pytest.mark.parametrize('mode', ['estimate', 'batch'])
def test_empty_input_leaves_statistics_untouched(mode):
    # mmdet's RoI heads can see zero RoIs: the estimates must not become NaN
    bcn = BatchChannelNorm2d(8, num_groups=4, mode=mode, **({'update_rate': 0.5} if mode == 'estimate' else {}))
    y = bcn.train()(torch.zeros(0, 8, 7, 7))
    assert y.shape == (0, 8, 7, 7)
    assert torch.equal(bcn.running_mean, torch.zeros(8)) and torch.equal(bcn.running_var, torch.ones(8))


def test_convert_norm_keeps_float64():
    bn = nn.BatchNorm2d(4).double()
    with torch.no_grad():
        bn.running_mean.copy_(torch.tensor([0.1, 1 / 3, 2 / 7, 5 / 9], dtype=torch.float64))
    bcn = BatchChannelNorm2d.convert_norm(bn, num_groups=2)
    assert bcn.running_mean.dtype == torch.float64 and torch.equal(bcn.running_mean, bn.running_mean)


