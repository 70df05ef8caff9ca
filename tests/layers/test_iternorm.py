import copy

import pytest
import torch
from mmcv.cnn import ConvModule, build_norm_layer

import normdense  # noqa: F401  (registers IterNorm)
from normdense.layers.iternorm import IterNorm, newton_whitening_matrix, zca_whitening_matrix
from tests.layers.recompute_checks import assert_recompute_matches_plain, assert_saves_only_the_input, saved_bytes


def algorithm1_reference(x, group_sizes, eps, T):
    """Algorithm 1 written out group by group in float64; returns (output, means, whitening matrices)."""
    c = x.shape[1]
    X = x.double().transpose(0, 1).reshape(c, -1)  # d x m, m = N*H*W
    m = X.shape[1]
    out, means, wms = [], [], []
    start = 0
    for d in group_sizes:
        Xg = X[start:start + d]
        mu = Xg @ torch.ones(m, 1, dtype=torch.float64) / m  # line 4
        Xc = Xg - mu @ torch.ones(1, m, dtype=torch.float64)  # line 5
        sigma = Xc @ Xc.T / m + eps * torch.eye(d, dtype=torch.float64)  # line 6
        sigma_n = sigma / torch.trace(sigma)  # Eq. 4
        P = torch.eye(d, dtype=torch.float64)  # line 8
        for _ in range(T):  # Eq. 3
            P = 0.5 * (3 * P - torch.linalg.matrix_power(P, 3) @ sigma_n)
        W = P / torch.sqrt(torch.trace(sigma))  # line 12, Eq. 5
        out.append(W @ Xc)  # line 13
        means.append(mu.flatten())
        wms.append(W)
        start += d
    y = torch.cat(out).reshape(c, x.shape[0], *x.shape[2:]).transpose(0, 1)
    return y, torch.cat(means), wms


def correlated(n, c, h, w, seed=0, cond=4.0):
    """Conv-shaped input with a well-conditioned, non-diagonal channel covariance."""
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(c, c, generator=g, dtype=torch.float64))
    scales = torch.linspace(1.0, cond ** 0.5, c, dtype=torch.float64)
    z = torch.randn(n, c, h, w, generator=g, dtype=torch.float64)
    mixed = torch.einsum('ij,njhw->nihw', q * scales, z)
    return mixed + torch.linspace(-2, 2, c, dtype=torch.float64).view(1, c, 1, 1)


def covariance(y, start, stop):
    Y = y.transpose(0, 1).reshape(y.shape[1], -1)[start:stop]
    Yc = Y - Y.mean(1, keepdim=True)
    return Yc @ Yc.T / Y.shape[1]


@pytest.mark.parametrize('c, group_size, T', [(10, 4, 5), (6, 64, 3), (8, 8, 0), (7, 3, 7)])
def test_matches_algorithm1_transcription(c, group_size, T):
    torch.manual_seed(c)
    x = correlated(3, c, 4, 5, seed=c)
    layer = IterNorm(c, group_size=group_size, T=T, eps=1e-3).double()
    with torch.no_grad():
        layer.weight.uniform_(0.5, 1.5)
        layer.bias.uniform_(-1, 1)
        y = layer(x)
    expected_sizes = [min(group_size, c)] * (c // min(group_size, c)) + ([c % group_size] if c % min(group_size, c) else [])
    assert layer.group_sizes == expected_sizes  # last group smaller when c % group_size != 0
    ref, _, _ = algorithm1_reference(x, layer.group_sizes, 1e-3, T)
    ref = ref * layer.weight.detach().view(1, -1, 1, 1) + layer.bias.detach().view(1, -1, 1, 1)
    torch.testing.assert_close(y, ref, rtol=1e-10, atol=1e-10)


def test_covariance_approaches_identity_and_zca_as_T_grows():
    x = correlated(8, 8, 16, 16, seed=1)
    zca = IterNorm(8, group_size=8, eps=1e-12, method='zca', affine=False).double()
    with torch.no_grad():
        y_zca = zca(x)
    eye = torch.eye(8, dtype=torch.float64)
    torch.testing.assert_close(covariance(y_zca, 0, 8), eye, rtol=0, atol=1e-9)
    cov_err, zca_err = [], []
    for T in (0, 1, 2, 3, 5, 8, 12, 40):
        layer = IterNorm(8, group_size=8, T=T, eps=1e-12, affine=False).double()
        with torch.no_grad():
            y = layer(x)
        cov_err.append((covariance(y, 0, 8) - eye).abs().max().item())
        zca_err.append((y - y_zca).abs().max().item())
    assert all(a > b for a, b in zip(cov_err[:-1], cov_err[1:-1])), cov_err  # monotone until converged
    assert all(a > b for a, b in zip(zca_err[:-1], zca_err[1:-1])), zca_err
    assert cov_err[-1] < 1e-9 and zca_err[-1] < 1e-9, (cov_err, zca_err)


def test_coupled_iteration_equals_eq3_and_stays_stable():
    """The layer's coupled Newton form gives Eq. 3's iterates; unlike the literal form it does not
    amplify round-off after convergence."""
    x = correlated(4, 64, 8, 8, seed=7, cond=100.0)
    xc = x.transpose(0, 1).reshape(1, 64, -1)
    xc = xc - xc.mean(-1, keepdim=True)
    for T in (1, 2, 5, 8):
        torch.testing.assert_close(newton_whitening_matrix(xc, 1e-5, T, coupled=True),
                                   newton_whitening_matrix(xc, 1e-5, T, coupled=False), rtol=1e-9, atol=1e-9)
    exact = zca_whitening_matrix(xc, 1e-5)
    for dtype, tol in ((torch.float64, 1e-9), (torch.float32, 1e-3)):
        w = newton_whitening_matrix(xc.to(dtype), 1e-5, 60, coupled=True).double()
        assert (w - exact).abs().max() < tol * exact.abs().max()
    literal = newton_whitening_matrix(xc, 1e-5, 60, coupled=False)
    assert not torch.isfinite(literal).all() or (literal - exact).abs().max() > exact.abs().max()


def test_newton_matches_zca_in_float32_groups():
    x = correlated(4, 16, 8, 8, seed=2).float()
    newton = IterNorm(16, group_size=8, T=40, eps=1e-5)
    zca = IterNorm(16, group_size=8, eps=1e-5, method='zca')
    with torch.no_grad():
        torch.testing.assert_close(newton(x), zca(x), rtol=1e-3, atol=1e-3)


def test_running_statistics_and_eval():
    x = correlated(2, 10, 6, 6, seed=3)
    layer = IterNorm(10, group_size=4, T=5, eps=1e-4, momentum=0.1).double()
    with torch.no_grad():
        layer.weight.uniform_(0.5, 1.5)
        layer.bias.uniform_(-1, 1)
    init_wm = layer.running_wm.clone()
    assert torch.equal(layer.running_mean, torch.zeros(10, dtype=torch.float64))
    assert torch.equal(init_wm[0], torch.eye(4).double()) and torch.equal(init_wm[2, :2, :2], torch.eye(2).double())
    assert init_wm[2, 2:].abs().sum() == 0 and init_wm[2, :, 2:].abs().sum() == 0
    with torch.no_grad():
        y_train = layer.train()(x)
    _, mean, wms = algorithm1_reference(x, [4, 4, 2], 1e-4, 5)
    torch.testing.assert_close(layer.running_mean, 0.1 * mean)  # Eq. 8 from 0 and I
    for i, w in enumerate(wms):
        d = w.shape[0]
        expected = 0.9 * torch.eye(d, dtype=torch.float64) + 0.1 * w
        torch.testing.assert_close(layer.running_wm[i, :d, :d], expected)

    with torch.no_grad():
        y_eval = layer.eval()(x)  # uses the running statistics, not the batch
    X = x.transpose(0, 1).reshape(10, -1)
    expected = []
    for i, (start, d) in enumerate([(0, 4), (4, 4), (8, 2)]):
        expected.append(layer.running_wm[i, :d, :d].double() @ (X[start:start + d] - layer.running_mean[start:start + d, None].double()))
    expected = torch.cat(expected).reshape(10, 2, 6, 6).transpose(0, 1)
    expected = expected * layer.weight.detach().view(1, -1, 1, 1) + layer.bias.detach().view(1, -1, 1, 1)
    torch.testing.assert_close(y_eval, expected)
    assert not torch.allclose(y_eval, y_train)
    before = (layer.running_mean.clone(), layer.running_wm.clone())
    with torch.no_grad():
        layer(x)  # eval does not update
    assert torch.equal(before[0], layer.running_mean) and torch.equal(before[1], layer.running_wm)

    # momentum 1: running statistics = last batch, so eval reproduces the training output
    full = IterNorm(10, group_size=4, momentum=1.0).double()
    with torch.no_grad():
        y_train = full.train()(x)
        y_eval = full.eval()(x)
    torch.testing.assert_close(y_eval, y_train, rtol=1e-10, atol=1e-10)


def test_finite_on_constant_and_zero_channels():
    x = torch.randn(2, 12, 5, 5)
    x[:, 3] = 7.0  # one constant channel inside a group
    x[:, 8:12] = 0.0  # a whole all-zero group
    x.requires_grad_(True)
    layer = IterNorm(12, group_size=4)
    y = layer(x)
    y.square().sum().backward()
    assert torch.isfinite(y).all() and torch.isfinite(x.grad).all()
    assert torch.isfinite(layer.running_wm).all()
    assert y[:, 8:12].abs().max() == 0 and y[:, 3].abs().max() == 0
    assert torch.isfinite(layer.weight.grad).all()
    with torch.no_grad():
        assert torch.isfinite(layer.eval()(x)).all()
    single = IterNorm(4, group_size=4).eval()(torch.randn(1, 4))  # m = 1 observation: fine in eval
    assert torch.isfinite(single).all()
    assert torch.isfinite(IterNorm(4, method='zca')(torch.zeros(2, 4, 3, 3))).all()


def test_gradcheck_float64():
    torch.manual_seed(5)
    x = correlated(2, 6, 3, 3, seed=5).requires_grad_(True)
    layer = IterNorm(6, group_size=4, T=5, eps=1e-3).double()
    w = layer.weight.detach().clone().uniform_(0.5, 1.5).requires_grad_(True)
    b = layer.bias.detach().clone().requires_grad_(True)

    def f(inp, weight, bias):
        return torch.func.functional_call(layer, {'weight': weight, 'bias': bias}, (inp, ))

    assert torch.autograd.gradcheck(f, (x, w, b))
    zca = IterNorm(6, group_size=3, eps=1e-3, method='zca').double()
    assert torch.autograd.gradcheck(lambda inp: zca(inp), (x, ))


def test_state_dict_round_trip():
    x = correlated(2, 10, 4, 4, seed=6).float()
    src = IterNorm(10, group_size=4)
    with torch.no_grad():
        src.weight.uniform_(0.5, 1.5)
        for _ in range(3):
            src(x)
    sd = src.state_dict()
    assert set(sd) == {'weight', 'bias', 'running_mean', 'running_wm'}
    assert sd['running_wm'].shape == (3, 4, 4)
    dst = IterNorm(10, group_size=4)
    dst.load_state_dict(sd)
    with torch.no_grad():
        torch.testing.assert_close(dst.eval()(x), src.eval()(x), rtol=0, atol=0)


def test_batch_size_one_and_feature_input():
    layer = IterNorm(64)
    y = layer(torch.randn(1, 64, 16, 16))  # m = 256 pixels of one image
    cov = covariance(y.double(), 0, 64)
    assert torch.isfinite(y).all() and cov.diagonal().mean() > 0.5
    feats = IterNorm(32, group_size=16)(torch.randn(40, 32))  # after global pooling ("DF")
    assert feats.shape == (40, 32)
    assert IterNorm(8, group_size=4)(torch.randn(0, 8, 7, 7)).shape == (0, 8, 7, 7)


def test_fp32_under_autocast():
    layer = IterNorm(16, group_size=8)
    x = torch.randn(2, 16, 5, 5)
    with torch.no_grad():
        plain = layer(x)
        with torch.autocast('cpu', dtype=torch.bfloat16):
            auto = layer(x)
            auto_bf16 = layer(x.bfloat16())
    assert auto.dtype == torch.float32 and auto_bf16.dtype == torch.bfloat16
    torch.testing.assert_close(auto, plain, rtol=0, atol=0)
    assert torch.isfinite(auto_bf16).all()


def test_build_norm_layer_and_conv_module():
    name, layer = build_norm_layer(dict(type='IterNorm', T=3, group_size=16), 48, postfix=1)
    assert name == 'bn1' and isinstance(layer, IterNorm)
    assert (layer.eps, layer.T, layer.group_sizes, layer.momentum) == (1e-5, 3, [16, 16, 16], 0.1)
    module = ConvModule(3, 48, 3, padding=1, norm_cfg=dict(type='IterNorm', group_size=16))
    out = module(torch.randn(1, 3, 8, 8))
    assert out.shape == (1, 48, 8, 8) and (out >= 0).all()


@pytest.mark.parametrize('kwargs, match', [
    (dict(group_size=0), 'group_size'),
    (dict(T=-1), 'T must be'),
    (dict(eps=0.0), 'eps must be > 0'),
    (dict(momentum=0.0), 'momentum'),
    (dict(method='svd'), "method must be 'newton' or 'zca'"),
])
def test_build_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_norm_layer(dict(type='IterNorm', **kwargs), 32)


@pytest.mark.codebases
def test_mask_rcnn_train_step_with_iternorm_everywhere():
    from tests.mm_models import det_train_step, mask_rcnn_cfg
    model, losses = det_train_step(mask_rcnn_cfg(norm_cfg=dict(type='IterNorm')))
    layers = [m for m in model.modules() if isinstance(m, IterNorm)]
    assert len(layers) > 20 and losses['loss_mask'] > 0
    assert isinstance(model.backbone.bn1, IterNorm) and isinstance(model.roi_head.mask_head.convs[0].norm, IterNorm)
    assert model.backbone.bn1.running_mean.abs().sum() > 0  # running statistics were updated
    assert not torch.equal(model.backbone.bn1.weight, torch.ones(64))  # affine trained


@pytest.mark.codebases
def test_deeplabv3_train_step_with_iternorm_everywhere():
    from tests.mm_models import deeplabv3_cfg, seg_train_step
    # batch 2: the ASPP image-pool branch is a 1x1 map, so 2 observations there
    model, losses = seg_train_step(deeplabv3_cfg(norm_cfg=dict(type='IterNorm')), batch_size=2)
    assert isinstance(model.decode_head.image_pool[1].norm, IterNorm)
    assert isinstance(model.backbone.stem[1], IterNorm) and losses['decode.loss_ce'] > 0
    assert model.backbone.stem[1].running_wm.abs().sum() > 0
    # batch 1: one observation on the image-pool branch is refused with a message, as BN's is
    with pytest.raises(ValueError, match='at least 2 observations'):
        seg_train_step(deeplabv3_cfg(norm_cfg=dict(type='IterNorm')))


# --- recompute=True: only the input is kept for backward, the rest is recomputed ------------------------

@pytest.mark.parametrize('kwargs, shapes', [
    (dict(group_size=4), [(2, 10, 4, 5), (1, 10, 3, 3)]),          # two blocks (groups 4, 4, 2)
    (dict(group_size=3, method='zca', eps=1e-3), [(2, 6, 4, 4), (3, 6, 2, 3)]),
    (dict(group_size=8), [(16, 8), (5, 8)]),                         # (N, C) features
])
@pytest.mark.parametrize('autocast, eval_before_backward', [(False, False), (True, False), (False, True)])
def test_recompute_equals_plain_autograd(kwargs, shapes, autocast, eval_before_backward):
    """Outputs, gradients and running statistics are identical with and without recompute, for a layer
    called twice before one backward; the running statistics (Eq. 8) move once per call and backward
    leaves them alone."""
    layer = IterNorm(shapes[0][1], **kwargs)
    with torch.no_grad():
        layer.weight.uniform_(0.5, 1.5)
        layer.bias.uniform_(-1, 1)
    xs = [correlated(s[0], s[1], *(s[2:] or (1, 1)), seed=i).float().reshape(s) for i, s in enumerate(shapes)]
    if autocast:
        xs = [x.bfloat16() for x in xs]
    reference = copy.deepcopy(layer)
    with torch.no_grad():
        for x in xs:
            reference(x)
    rec = assert_recompute_matches_plain(layer.train(), xs, autocast=autocast,
                                         eval_before_backward=eval_before_backward)
    for name in ('running_mean', 'running_wm'):
        assert torch.equal(getattr(rec, name), getattr(reference, name))


def test_recompute_gradcheck_float64():
    x = correlated(2, 6, 3, 3, seed=5).requires_grad_(True)
    for layer in (IterNorm(6, group_size=4, T=5, eps=1e-3, recompute=True),
                  IterNorm(6, group_size=3, eps=1e-3, method='zca', recompute=True)):
        layer = layer.double()
        w = layer.weight.detach().clone().uniform_(0.5, 1.5).requires_grad_(True)
        b = layer.bias.detach().clone().uniform_(-1, 1).requires_grad_(True)

        def f(inp, weight, bias):  # parameters unlike the module's: the recomputation must use these
            return torch.func.functional_call(layer, {'weight': weight, 'bias': bias}, (inp, ))

        assert torch.autograd.gradcheck(f, (x, w, b))


def test_recompute_saves_only_the_input():
    """Plain IterNorm keeps two activation-sized tensors for backward (centred groups and whitened
    output), with recompute one, as nn.GroupNorm."""
    plain, rec = IterNorm(32, group_size=16), IterNorm(32, group_size=16, recompute=True)
    assert_saves_only_the_input(plain, rec, torch.randn(2, 32, 8, 8), plain_factor=2)


def test_recompute_inactive_in_eval_without_grad_and_on_empty_input():
    layer = IterNorm(8, group_size=4)
    rec = IterNorm(8, group_size=4, recompute=True)
    x = torch.randn(2, 8, 4, 4)
    with torch.no_grad():
        assert torch.equal(rec(x), layer(x))
        assert torch.equal(rec.running_wm, layer.running_wm)
    rec.eval()
    layer.eval()
    x.requires_grad_(True)
    assert (saved_bytes(lambda: rec(x), list(rec.parameters()))
            == saved_bytes(lambda: layer(x), list(layer.parameters())))
    rec.train()
    empty = torch.zeros(0, 8, 7, 7, requires_grad=True)
    before = rec.running_wm.clone()
    rec(empty).sum().backward()
    assert rec.weight.grad is not None and torch.equal(rec.running_wm, before)


def test_recompute_from_config_keeps_state_dict_keys():
    _, layer = build_norm_layer(dict(type='IterNorm', group_size=16, recompute=True), 48)
    assert layer.recompute and 'recompute=True' in repr(layer) and not IterNorm(48).recompute
    assert set(layer.state_dict()) == set(IterNorm(48, group_size=16).state_dict())


# --- a batch without covariance (dead feature map, zero padding) leaves the running statistics -----------

def _eval_std_on_normal_data(layer, c):
    x = torch.randn(4, c, 8, 8, generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        return layer.eval()(x).std().item()


@pytest.mark.parametrize('method', ['newton', 'zca'])
@pytest.mark.parametrize('steps', [1, 5])
def test_all_zero_batches_leave_eval_at_unit_scale(steps, method):
    """Before the fix one all-zero batch at momentum 0.1 added ~0.1 * eps^{-1/2} * (T's convergence) to
    the running whitening matrix: eval scaled N(0, 1) inputs 25x (100x after 5 such batches)."""
    layer = IterNorm(64, method=method)  # affine at init: eval output = whitened input
    for _ in range(steps):
        y = layer.train()(torch.zeros(2, 64, 8, 8))
        assert torch.isfinite(y).all() and y.abs().max() == 0  # the training output stays the paper's
    assert torch.equal(layer.running_wm, IterNorm(64).running_wm)
    assert torch.equal(layer.running_mean, torch.zeros(64))
    assert abs(_eval_std_on_normal_data(layer, 64) - 1) < 0.02


@pytest.mark.parametrize('dead', [torch.zeros, lambda *s: torch.full(s, 3.0),
                                  lambda *s: 3.0 + 1e-4 * torch.randn(s)], ids=['zeros', 'constant', 'variance-1e-8'])
def test_dead_batch_after_training_keeps_the_whitening(dead):
    """Trained on correlated data, then a batch whose covariance is 0, or below eps (variance 1e-8 < 1e-5):
    the running statistics stay those of the training data."""
    g = torch.Generator().manual_seed(0)
    mixing = torch.eye(16) + 0.3 * torch.randn(16, 16, generator=g)  # one correlated distribution

    def data(n, h, w):
        return torch.einsum('ij,njhw->nihw', mixing, torch.randn(n, 16, h, w, generator=g)) + 1.0

    layer = IterNorm(16, group_size=8, momentum=0.5)  # 0.5: the initial identity is forgotten in 20 steps
    for _ in range(20):
        layer(data(8, 12, 12))
    before = {n: b.clone() for n, b in layer.named_buffers()}
    for _ in range(3):
        assert torch.isfinite(layer(dead(2, 16, 6, 6))).all()
    for n, b in layer.named_buffers():
        assert torch.equal(b, before[n]), n
    with torch.no_grad():
        y = layer.eval()(data(8, 16, 16)).double()
    # the layer still whitens: the output covariance of fresh data from the training distribution ~ I
    # (up to sampling noise and T = 5's partial convergence; before the fix its diagonal was ~600)
    for start in (0, 8):
        cov = covariance(y, start, start + 8)
        assert (cov - torch.eye(8, dtype=torch.float64)).abs().max() < 0.2, cov


@pytest.mark.parametrize('group', [1, 2], ids=['middle-group', 'smaller-last-group'])
def test_a_group_without_covariance_leaves_the_other_groups_updates_intact(group):
    """Groups 4, 4, 2 (two batched blocks): one group all zero, the others updated exactly as with live data
    in that group (float64), the zero group's statistics untouched (no host sync: a per-group torch.where)."""
    x = correlated(3, 10, 4, 5, seed=4)
    dead_x = x.clone()
    zero = slice(4 * group, min(4 * group + 4, 10))
    dead_x[:, zero] = 0.0
    live, dead = IterNorm(10, group_size=4).double(), IterNorm(10, group_size=4).double()
    with torch.no_grad():
        live(x)
        dead(dead_x)
    fresh = IterNorm(10, group_size=4).double()
    for g, (start, d) in enumerate([(0, 4), (4, 4), (8, 2)]):
        src = fresh if g == group else live
        torch.testing.assert_close(dead.running_wm[g], src.running_wm[g], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(dead.running_mean[start:start + d], src.running_mean[start:start + d],
                                   rtol=1e-12, atol=1e-12)
    assert torch.equal(dead.running_wm[group], fresh.running_wm[group])
    assert not torch.equal(live.running_wm[group], fresh.running_wm[group])  # that group did move with data


@pytest.mark.parametrize('variance, live', [(3e-6, False), (8e-6, False), (2e-5, True)],
                         ids=['between-eps/d-and-eps', 'just-below-eps', 'above-eps'])
def test_live_group_threshold_is_the_mean_channel_variance_against_eps(variance, live):
    """A group is live when tr(C) > d * eps (mean channel variance above eps), not tr(C) > eps: a batch whose
    variance lies between eps / d and eps leaves the running statistics; one above eps moves them."""
    d, eps = 8, 1e-5
    layer = IterNorm(d, group_size=d, eps=eps, momentum=0.5).double()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, d, 6, 6, generator=g, dtype=torch.float64)
    x = (x - x.mean((0, 2, 3), keepdim=True)) / x.std((0, 2, 3), correction=0, keepdim=True)
    x = x * variance ** 0.5 + 1.0  # every channel's batch variance exactly `variance`
    before = {n: b.clone() for n, b in layer.named_buffers()}
    layer.train()(x)
    moved = [n for n, b in layer.named_buffers() if n != 'num_batches_tracked' and not torch.equal(b, before[n])]
    assert bool(moved) == live, (variance, moved)
