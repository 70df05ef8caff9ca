"""mmengine's paramwise weight-decay options treat every normdense norm as they treat GroupNorm
(normdense/optim.py): built through mmengine's own ``build_optim_wrapper`` and default constructor, as a
config that names no constructor is."""
import types
import warnings

import pytest
import torch
import torch.nn as nn
from mmengine.optim import build_optim_wrapper
from mmengine.optim.optimizer import default_constructor
from torch.nn.modules.batchnorm import _BatchNorm

import normdense  # noqa: F401  (recognises the norms at import; the tests of the mechanism import it themselves)
from normdense.layers.bcn import BatchChannelNorm2d
from normdense.layers.equinorm import ChannelAffine, EquiConv2d
from normdense.layers.iternorm import IterNorm
from normdense.layers.proxy_norm import GroupProxyNorm
from normdense.layers.unitization import Unitization2d
from normdense.layers.ws import WSConv2d

WD, LR = 0.01, 0.1


def model():
    return nn.ModuleDict(dict(
        conv=nn.Conv2d(8, 8, 3), ws=WSConv2d(8, 8, 3), equi=EquiConv2d(8, 8, 3), linear=nn.Linear(8, 8),
        gn=nn.GroupNorm(4, 8), bn=nn.BatchNorm2d(8),
        bcn=BatchChannelNorm2d(8, 4, update_rate=0.1), gnpn=GroupProxyNorm(8, 4),
        unitization=Unitization2d(8), unitization_estimate=Unitization2d(8, mode='estimate', update_rate=0.1),
        iternorm=IterNorm(8, group_size=4), affine=ChannelAffine(8)))


NORMS = ('gn', 'bn', 'bcn', 'gnpn', 'unitization', 'unitization_estimate', 'iternorm', 'affine')
NORMDENSE_NORMS = ('bcn', 'gnpn', 'unitization', 'unitization_estimate', 'iternorm', 'affine')
CONVS = ('conv', 'ws', 'equi', 'linear')


def groups_of(net, paramwise_cfg):
    """{parameter name: its param group's (lr, weight_decay)} of mmengine's default constructor."""
    wrapper = build_optim_wrapper(net, dict(optimizer=dict(type='SGD', lr=LR, momentum=0.9, weight_decay=WD),
                                            paramwise_cfg=paramwise_cfg))
    by_param = {}
    for group in wrapper.optimizer.param_groups:
        for p in group['params']:
            by_param[p] = (group['lr'], group['weight_decay'])
    return wrapper, {n: by_param[p] for n, p in net.named_parameters()}


def test_every_normdense_layer_with_affine_parameters_is_listed():
    from normdense.optim import NORM_CLASSES
    listed = set(NORM_CLASSES) | {BatchChannelNorm2d, GroupProxyNorm}
    for name in NORMDENSE_NORMS:
        layer = model()[name]
        assert any(True for _ in layer.parameters()) and type(layer) in listed, name
    assert all(issubclass(c, nn.GroupNorm) for c in (BatchChannelNorm2d, GroupProxyNorm))
    # not BatchNorm: mmdet's norm_eval / convert_sync_batchnorm would then treat them as one
    assert not any(issubclass(c, _BatchNorm) for c in NORM_CLASSES)


def test_norm_decay_mult_zero_reaches_every_normdense_norm():
    net = model()
    _, groups = groups_of(net, dict(norm_decay_mult=0.0))
    names = {n.split('.')[0] for n in groups}
    assert names == set(NORMS) | set(CONVS)
    for name, (lr, wd) in groups.items():
        layer = name.split('.')[0]
        assert lr == LR, name
        assert wd == (0.0 if layer in NORMS else WD), (name, wd)
    # every parameter of the normdense norms: gamma/beta, BCN's batch stage, GN+PN's proxy, Unitization's alpha
    assert {'unitization.alpha', 'bcn.batch_weight', 'gnpn.proxy_gamma', 'iternorm.weight',
            'affine.bias'} <= set(groups)


def test_no_decay_applied_in_a_step():
    """One SGD step with zero gradients: only decay moves a parameter; norms stay, conv weights shrink."""
    net = model()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # alpha, beta etc. away from 0
    wrapper, _ = groups_of(net, dict(norm_decay_mult=0.0))
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    wrapper.step()
    for name, p in net.named_parameters():
        if name.split('.')[0] in NORMS:
            assert torch.equal(p, before[name]), name
        else:
            torch.testing.assert_close(p, before[name] * (1 - LR * WD), rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize('paramwise_cfg', [dict(bias_decay_mult=0.0), dict(bias_decay_mult=0.0, norm_decay_mult=0.5),
                                           dict(bias_lr_mult=2.0, bias_decay_mult=0.0)])
def test_bias_options_treat_normdense_biases_as_groupnorms(paramwise_cfg):
    """As for GroupNorm's bias: bias_lr_mult skips it, norm_decay_mult (where set) wins over bias_decay_mult."""
    _, groups = groups_of(model(), paramwise_cfg)
    for name in NORMDENSE_NORMS:
        for pname in ('weight', 'bias'):
            if f'{name}.{pname}' in groups:
                assert groups[f'{name}.{pname}'] == groups[f'gn.{pname}'], (name, pname)
    assert groups['conv.bias'] == (LR * paramwise_cfg.get('bias_lr_mult', 1.0), 0.0)
    assert groups['gn.bias'][0] == LR  # bias_lr_mult skips norms
    if 'norm_decay_mult' in paramwise_cfg:  # then it wins over bias_decay_mult for a norm's bias
        assert groups['gn.bias'][1] == groups['iternorm.bias'][1] == WD * paramwise_cfg['norm_decay_mult']


def test_mechanism_is_idempotent_and_keeps_mmengines_own_norms():
    from normdense.optim import NORM_CLASSES, recognise_norms
    assert recognise_norms() and recognise_norms()
    flat = default_constructor._InstanceNorm
    assert flat[0] is torch.nn.modules.instancenorm._InstanceNorm and set(flat[1:]) == set(NORM_CLASSES)
    net = nn.Sequential(nn.InstanceNorm2d(8, affine=True), nn.LayerNorm(8), nn.Conv2d(8, 8, 1))
    _, groups = groups_of(net, dict(norm_decay_mult=0.0))
    assert [groups[n][1] for n in ('0.weight', '1.weight', '2.weight')] == [0.0, 0.0, WD]


def test_warns_in_one_line_where_mmengine_stops_reading_the_name():
    from normdense.optim import recognise_norms
    class Constructor:
        def add_params(self, params, module):
            return isinstance(module, nn.GroupNorm)

    fake = types.ModuleType('fake_default_constructor')
    fake.DefaultOptimWrapperConstructor = Constructor
    with pytest.warns(UserWarning, match=r"no longer checks norms via '_InstanceNorm'.*custom_keys") as record:
        assert not recognise_norms(fake)
    assert '\n' not in str(record[0].message) and not hasattr(fake, '_InstanceNorm')
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        assert recognise_norms()  # mmengine's own module: no warning
