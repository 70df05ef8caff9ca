"""The group policy (normdense/layers/groups.py) of GN ('GNAuto'), BCN and GN+PN: each rule, the exact-count error,
and the layers built by mmcv's build_norm_layer at channel counts of the model zoo that 32 does not divide."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from mmcv.cnn import build_norm_layer

import normdense  # noqa: F401  (registers GNAuto, BCN, GNPN)
from normdense.layers import BatchChannelNorm2d, GroupNorm, GroupProxyNorm, resolve_groups, set_update_rate


@pytest.mark.parametrize('channels, groups', [
    (64, 32), (256, 32), (2048, 32),  # 32 where it divides with >= 2 channels per group (the GN paper's G)
    (32, 16),  # not 32 groups of 1 channel: a 1x1 map would leave one value per group
    (48, 24), (18, 9), (16, 8), (35, 7), (432, 36), (720, 30), (24, 12),
    (60, 30), (44, 22), (28, 14),  # nearest divisor, >= 2 channels each
    (3, 1), (2, 1), (1, 1), (17, 1),  # no divisor keeps 2 channels per group but one group
])
def test_auto_rule(channels, groups):
    assert resolve_groups(channels, 'auto') == groups


def test_auto_ties_take_fewer_groups():
    # 252: 28 and 36 groups are both 4 from 32 -> 28 (9 channels per group rather than 7)
    assert resolve_groups(252, 'auto') == 28


@pytest.mark.parametrize('channels', range(1, 300))
def test_auto_always_divides_and_keeps_two_channels(channels):
    g = resolve_groups(channels, 'auto')
    assert channels % g == 0
    assert channels // g >= 2 or g == 1
    if channels % 32 == 0 and channels >= 64:
        assert g == 32  # what mmcv's GN(32) builds, so configs that worked keep their layers


@pytest.mark.parametrize('channels, per_group, groups', [(256, 16, 16), (48, 16, 3), (18, 16, 1), (35, 16, 5),
                                                         (64, 8, 8), (36, 16, 2), (30, 4, 6), (12, 5, 2)])
def test_channels_per_group_rule(channels, per_group, groups):
    # the width nearest K among C's divisors: 36 -> 18 (2 from 16; 12 is 4 away) -> 2 groups; a tie goes to the
    # wider group: 30 at K = 4 -> width 5 (3 is as near) -> 6 groups, 12 at K = 5 -> width 6 (not 4) -> 2 groups
    assert resolve_groups(channels, 'auto', channels_per_group=per_group) == groups


def test_exact_count_stays_exact_and_fails_in_one_line():
    assert resolve_groups(64, 16) == 16
    with pytest.raises(ValueError) as e:
        resolve_groups(48, 32, layer='BCN')
    message = str(e.value)
    assert '\n' not in message and "BCN: num_groups=32 does not divide this layer's 48 channels" in message
    assert "num_groups='auto'" in message and 'channels_per_group' in message


@pytest.mark.parametrize('kwargs', [dict(num_groups=0), dict(num_groups='32'), dict(num_groups=True),
                                    dict(num_groups=8, channels_per_group=4), dict(channels_per_group=0)])
def test_bad_values(kwargs):
    with pytest.raises(ValueError):
        resolve_groups(64, **kwargs)


def test_gnauto_through_mmcv_is_a_groupnorm_with_gn_names():
    name, layer = build_norm_layer(dict(type='GNAuto', requires_grad=True), 48, postfix=1)
    assert name == 'gn1' and isinstance(layer, nn.GroupNorm) and type(layer) is GroupNorm
    assert layer.num_groups == 24 and layer.group_policy == 'auto'
    assert list(layer.state_dict()) == list(nn.GroupNorm(24, 48).state_dict())
    x = torch.randn(2, 48, 5, 7, dtype=torch.float64)
    layer = layer.double()
    torch.testing.assert_close(layer(x), F.group_norm(x, 24, layer.weight, layer.bias, layer.eps), rtol=0, atol=0)
    _, exact = build_norm_layer(dict(type='GNAuto', num_groups=16), 48)
    assert exact.num_groups == 16 and exact.group_policy == 'exact'
    with pytest.raises(ValueError, match="GNAuto: num_groups=32 does not divide this layer's 48 channels"):
        build_norm_layer(dict(type='GNAuto', num_groups=32), 48)


def test_bcn_auto_fits_the_channels_and_its_per_group_affine():
    _, bcn = build_norm_layer(dict(type='BCN', num_groups='auto', mode='estimate'), 48)
    assert bcn.num_groups == 24 and bcn.weight.shape == (24,) and bcn.group_policy == 'auto'
    _, per16 = build_norm_layer(dict(type='BCN', channels_per_group=16), 48)
    assert per16.num_groups == 3 and per16.weight.shape == (3,)
    assert BatchChannelNorm2d(32).num_groups == 32  # the default stays the paper's exact 32 (checkpoints load)
    assert BatchChannelNorm2d(64, num_groups='auto').num_groups == 32
    with pytest.raises(ValueError, match="BCN: num_groups=32 does not divide this layer's 48 channels"):
        build_norm_layer(dict(type='BCN', num_groups=32), 48)
    bcn.train()
    set_update_rate(bcn, 0.1)
    y = bcn(torch.randn(2, 48, 4, 4))
    assert torch.isfinite(y).all()


def test_gnpn_auto_fits_the_channels():
    layer = GroupProxyNorm(18, num_groups='auto')
    assert layer.num_groups == 9 and layer.group_policy == 'auto'
    assert GroupProxyNorm(18, channels_per_group=6).num_groups == 3
    assert GroupProxyNorm(32, num_groups=1).num_groups == 1  # LN+PN stays exact
    assert GroupProxyNorm(32).num_groups == 32  # the default stays exact 32
    with pytest.raises(ValueError, match="GNPN: num_groups=32 does not divide this layer's 18 channels"):
        GroupProxyNorm(18, num_groups=32)


@pytest.mark.parametrize('shape', [(3, 8, 5), (3, 8)], ids=['NCL', 'NC'])
@pytest.mark.parametrize('mode', ['batch', 'estimate'])
def test_bcn_takes_n_c_l_and_n_c_inputs_as_maps(mode, shape):
    """(N, C, L) and (N, C) as nn.GroupNorm and BN1d take them (EncNet builds its codeword norm from the slot's
    norm_cfg; a classifier head's BN1d slot, e.g. mmpretrain's MobileNetV3 head, gets (N, C))."""
    torch.manual_seed(0)
    x = torch.randn(*shape, dtype=torch.float64)
    outs = []
    for shape in (x.shape, x.shape + (1, ) * (4 - x.dim())):
        layer = BatchChannelNorm2d(8, num_groups=4, mode=mode).double().train()
        set_update_rate(layer, 0.1)
        xi = x.reshape(shape).clone().requires_grad_()
        y = layer(xi)
        y.backward(torch.ones_like(y))
        outs.append((y.reshape(x.shape), xi.grad.reshape(x.shape), layer.running_mean.clone()))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
