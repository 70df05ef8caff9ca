"""Regression tests for the layer failures found by probing: collectives on empty ranks, the update rate's
range wherever it is set, 0/0 statistics, IterNorm with one observation, negative eps, one value per
group, bf16 estimates and batch-mode momentum."""

import pytest
import torch
from mmengine.optim import OptimWrapper

from normdense.hooks.estimate_rate import BCNRateHook, EstimateRateHook
from normdense.layers import set_update_rate
from normdense.layers.bcn import BatchChannelNorm2d
from normdense.layers.iternorm import IterNorm
from normdense.layers.proxy_norm import GroupProxyNorm
from normdense.layers.unitization import Unitization2d
from normdense.layers.ws import WSConv2d
from tests.layers import dist_empty_worker
from tests.layers.two_ranks import run_two_ranks


# --- collectives and statistics with empty batches (two gloo processes) -------------------------------

@pytest.mark.slow  # two interpreters importing the stack: ~30-60 s on 2 shared cores
def test_empty_ranks_join_every_collective_and_keep_statistics_finite(tmp_path):
    ranks = run_two_ranks(tmp_path, 'tests.layers.dist_empty_worker')

    # 1. one rank empty: both ranks apply the update of rank 1's samples (count-weighted), identically
    for name in ('unitization_estimate', 'bcn_estimate'):
        ref = dist_empty_worker.layers()[name].train()
        ref(dist_empty_worker.rank_batch(1))  # one process seeing all the samples there are
        for n, b in ref.named_buffers():
            assert torch.equal(ranks[0][name][n], ranks[1][name][n]), (name, n)
            torch.testing.assert_close(ranks[0][name][n], b, msg=f'{name} {n}')
        assert not torch.equal(ranks[0][name]['running_mean'], torch.zeros(dist_empty_worker.C))

    # 2. one rank empty in batch mode, sync_stats: rank 0 takes the reference path, rank 1 the fused one (with
    # its closed-form backward's all-reduces); rank 1 equals one process on its samples, and both ranks track
    # the same running statistics
    name = 'bcn_batch_one_empty'
    ref = dist_empty_worker.layers()[name].train()
    x = dist_empty_worker.rank_batch(1).requires_grad_(True)
    out = ref(x)
    (out * dist_empty_worker.loss_weight(out)).sum().backward()
    got = ranks[1][name]
    torch.testing.assert_close(got['out'], out.detach())
    torch.testing.assert_close(got['grad_x'], x.grad, rtol=1e-4, atol=1e-5)
    for n, p in ref.named_parameters():  # rank 0 adds nothing: no samples
        torch.testing.assert_close(got['grad_' + n] + ranks[0][name]['grad_' + n], p.grad, rtol=1e-4, atol=1e-5)
    for n, b in ref.named_buffers():
        assert torch.equal(ranks[0][name][n], got[n]), n
        torch.testing.assert_close(got[n], b, msg=f'{name} {n}')

    # 3. every rank empty in batch mode: the running statistics stay as they were, never 0/0
    stats = ranks[0]['bcn_batch_all_empty']
    assert torch.equal(stats['running_mean'], torch.zeros(dist_empty_worker.C))
    assert torch.equal(stats['running_var'], torch.ones(dist_empty_worker.C))


# --- the update rate r is range-checked wherever it is set ---------------------------------------------

class _Runner:
    """What EstimateRateHook reads of mmengine's Runner."""

    def __init__(self, model, lr):
        self.model = model
        self.optim_wrapper = OptimWrapper(torch.optim.SGD(model.parameters(), lr=lr))
        self.iter = 7
        self.logger = type('L', (), {'info': print, 'warning': print})()


def test_hook_refuses_a_rate_above_one_before_any_estimate_moves():
    model = torch.nn.Sequential(BatchChannelNorm2d(8, 4), Unitization2d(8, mode='estimate'))
    runner = _Runner(model, lr=0.1)
    hook = BCNRateHook(rate_scale=20)  # r = 2
    hook.before_train(runner)
    with pytest.raises(ValueError, match=r'rate_scale x lr = 20.0 x 0.1 .*iteration 7.*\[0, 1\]'):
        hook.before_train_iter(runner, 0)
    assert all(m.current_rate is None for m in model)
    ok = EstimateRateHook(rate_scale=5)  # r = 0.5: fine, and both layer types get it
    ok.before_train(runner)
    ok.before_train_iter(runner, 0)
    assert [m.current_rate for m in model] == [0.5, 0.5]
    assert BCNRateHook is EstimateRateHook


@pytest.mark.parametrize('bad', [1.5, -0.1, float('nan'), float('inf'), 'lr'])
def test_rate_setters_refuse_rates_outside_zero_one(bad):
    model = torch.nn.Sequential(BatchChannelNorm2d(8, 4), Unitization2d(8, mode='estimate'))
    with pytest.raises(ValueError, match='must'):
        set_update_rate(model, bad)
    for m in model:
        with pytest.raises(ValueError, match='must'):
            m.set_current_rate(bad)
        with pytest.raises(ValueError, match='must'):
            # BCN: 4 groups (its default of 32 does not divide 8 and would fail first, on num_groups)
            type(m)(8, update_rate=bad, **({'mode': 'estimate'} if isinstance(m, Unitization2d) else {'num_groups': 4}))
    assert set_update_rate(model, 1.0) == 2 and set_update_rate(model, 0.0) == 2
    with pytest.raises(ValueError, match='rate_scale'):
        EstimateRateHook(rate_scale=-1)


# --- IterNorm needs two observations in training ------------------------------------------------------

@pytest.mark.parametrize('shape', [(1, 8), (1, 8, 1, 1)])
def test_iternorm_refuses_one_observation_in_training_and_keeps_its_statistics(shape):
    layer = IterNorm(8, group_size=4)
    before = {n: b.clone() for n, b in layer.named_buffers()}
    with pytest.raises(ValueError, match='at least 2 observations'):
        layer(torch.randn(shape))
    for n, b in layer.named_buffers():
        assert torch.equal(b, before[n]), n
    assert torch.isfinite(layer.eval()(torch.randn(shape))).all()  # eval: running statistics, fine
    assert layer.train()(torch.randn(2, 8)).shape == (2, 8)
    assert layer(torch.randn(0, 8)).shape == (0, 8)  # empty (no RoIs): passes through


# --- eps, momentum and one value per group are refused with the fix named ------------------------------

@pytest.mark.parametrize('build', [
    lambda: BatchChannelNorm2d(8, 4, eps=-1e-3),
    lambda: BatchChannelNorm2d(8, 4, eps=0.0),
    lambda: WSConv2d(4, 4, 3, eps=-1e-3, formula='var_unbiased'),
    lambda: WSConv2d(4, 4, 3, eps=-1e-3),
    lambda: BatchChannelNorm2d(8, 4, mode='batch', momentum=1.5),
    lambda: BatchChannelNorm2d(8, 4, mode='batch', momentum=-0.1),
    lambda: BatchChannelNorm2d(8, 4, mode='batch', momentum=None),
], ids=['bcn-eps-neg', 'bcn-eps-zero', 'ws-eps-var-unbiased', 'ws-eps-paper', 'bcn-momentum-high',
        'bcn-momentum-neg', 'bcn-momentum-none'])
def test_bad_options_are_refused_at_build(build):
    with pytest.raises(ValueError, match='must'):
        build()


GROUP_LAYERS = {'bcn-estimate': lambda groups: BatchChannelNorm2d(8, groups, update_rate=0.1),
                'bcn-batch': lambda groups: BatchChannelNorm2d(8, groups, mode='batch'),
                'gnpn': lambda groups: GroupProxyNorm(8, num_groups=groups)}


# batch-mode BCN at batch 1 on a 1x1 map has one value per channel in its batch stage: not a case here
GROUP_CASES = [(name, batch) for name in GROUP_LAYERS for batch in (1, 2, 5) if (name, batch) != ('bcn-batch', 1)]


@pytest.mark.parametrize('name, batch', GROUP_CASES, ids=[f'{n}-{b}' for n, b in GROUP_CASES])
def test_one_value_per_group_per_sample_names_the_fix(name, batch):
    """The channel stage's statistics are per sample: one channel per group on a 1x1 map is one value per
    group at any batch size (batch >= 2 used to pass and output the bias with a zero gradient)."""
    make = GROUP_LAYERS[name]
    with pytest.raises(ValueError, match=r'single value per sample.*num_groups <= 4'):
        make(8)(torch.randn(batch, 8, 1, 1))
    assert make(8)(torch.randn(0, 8, 1, 1)).shape == (0, 8, 1, 1)  # empty batch (no RoIs): no group to normalize
    assert torch.isfinite(make(8)(torch.randn(batch, 8, 2, 1))).all()  # two positions per group: fine
    x = torch.randn(batch, 8, 1, 1, requires_grad=True)
    y = make(4)(x)  # 2 channels per group on a 1x1 map: fine, and the input gets a gradient
    (y * torch.randn(y.shape)).sum().backward()
    assert torch.isfinite(y).all() and x.grad.abs().sum() > 0


def test_one_value_per_group_on_feature_inputs():
    """GN+PN takes (N, C) inputs: one channel per group is one value per group there too."""
    with pytest.raises(ValueError, match='num_groups <= 4'):
        GroupProxyNorm(8, num_groups=8)(torch.randn(4, 8))
    assert torch.isfinite(GroupProxyNorm(8, num_groups=4)(torch.randn(4, 8))).all()


# --- estimates stay float32 under model.bfloat16() / half() --------------------------------------------

@pytest.mark.parametrize('make', [lambda: BatchChannelNorm2d(16, 4, update_rate=1e-3),
                                  lambda: Unitization2d(16, mode='estimate', update_rate=1e-3)],
                         ids=['bcn', 'unitization'])
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_estimates_stay_float32_and_keep_small_updates(make, dtype):
    torch.manual_seed(0)
    ref, low = make(), make()
    with torch.no_grad():
        for m in (ref, low):
            m.running_var.fill_(3.0)  # bf16 spacing at 3 is 0.016: an update of r * delta ~ 1e-3 would vanish
    low = low.to(dtype)
    assert low.running_mean.dtype == low.running_var.dtype == torch.float32
    assert torch.equal(low.running_var, ref.running_var)  # no rounding on the way
    assert low.alpha.dtype == dtype if isinstance(low, Unitization2d) else low.weight.dtype == dtype
    x = torch.randn(2, 16, 4, 4)
    for _ in range(3):
        ref(x.to(dtype).float())
        low(x.to(dtype))
    torch.testing.assert_close(low.running_var, ref.running_var, rtol=0, atol=1e-6)
    assert (low.running_var - 3.0).abs().max() > 1e-3  # the updates did land
    copy = make().to(dtype)
    copy.load_state_dict(low.state_dict())
    assert torch.equal(copy.running_var, low.running_var) and copy.running_var.dtype == torch.float32
