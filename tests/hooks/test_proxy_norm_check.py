"""normdense.hooks.proxy_norm_check: the placement checks (static and run time), ProxyNormCheckHook and the
weight-decay paramwise_cfg of configs/_base_/proxy_norm.py."""
import os
import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from mmcv.cnn import ConvModule

import normdense  # noqa: F401  (registers GNPN)
from normdense.hooks.proxy_norm_check import (ActivationAfterProxyNormGuard, check_proxy_norm_placement,
                                              find_activations_after_proxy_norm, proxy_norm_paramwise_cfg)
from normdense.layers.proxy_norm import GroupProxyNorm

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_paramwise_cfg_gives_intended_decay():
    from mmengine.config import Config
    from mmengine.optim import DefaultOptimWrapperConstructor

    model = nn.Sequential(nn.Conv2d(3, 8, 3, bias=False), GroupProxyNorm(8, num_groups=2),
                          nn.Conv2d(8, 8, 1, bias=False), nn.GroupNorm(2, 8), nn.Flatten(), nn.Linear(8, 2))
    cfg = Config.fromfile(os.path.join(REPO, 'configs', '_base_', 'proxy_norm.py'))
    assert cfg.optim_wrapper.paramwise_cfg.to_dict() == proxy_norm_paramwise_cfg()
    assert cfg.custom_hooks == [dict(type='ProxyNormCheckHook')]
    constructor = DefaultOptimWrapperConstructor(
        dict(type='OptimWrapper', optimizer=dict(type='SGD', lr=0.1, momentum=0.9, weight_decay=1e-4)),
        paramwise_cfg=proxy_norm_paramwise_cfg())
    optimizer = constructor(model).optimizer
    decay = {}
    for group in optimizer.param_groups:
        for p in group['params']:
            decay[p] = group['weight_decay']
    names = {p: n for n, p in model.named_parameters()}
    got = {names[p]: d for p, d in decay.items()}
    assert got == {
        '0.weight': 1e-4,  # conv weights keep the base decay
        '1.weight': 0.0, '1.bias': 0.0,  # PN's gamma/beta: no decay
        '1.proxy_beta': 1e-4, '1.proxy_gamma': 1e-4,  # PN's beta~/gamma~: decayed
        '2.weight': 1e-4, '3.weight': 0.0, '3.bias': 0.0, '5.weight': 1e-4, '5.bias': 1e-4,
    }
    # ResNet recipe of the paper: everything decayed (mmengine default)
    resnet = DefaultOptimWrapperConstructor(
        dict(type='OptimWrapper', optimizer=dict(type='SGD', lr=0.1, weight_decay=1e-4)),
        paramwise_cfg=proxy_norm_paramwise_cfg(norm_decay_mult=1.0))(model).optimizer
    assert all(g['weight_decay'] == 1e-4 for g in resnet.param_groups)


def test_static_check_conv_module_and_sequential():
    pn_cfg = dict(type='GNPN', num_groups=4)
    bad = nn.ModuleDict({
        'head': ConvModule(8, 8, 3, padding=1, norm_cfg=pn_cfg),  # default act_cfg=ReLU
        'seq': nn.Sequential(nn.Conv2d(8, 8, 1), GroupProxyNorm(8, 4), nn.GELU()),
    })
    problems = find_activations_after_proxy_norm(bad)
    assert len(problems) == 2
    assert problems[0].startswith('head (ConvModule): ReLU applied after its GroupProxyNorm norm')
    assert problems[1].startswith('seq.2 (GELU) directly follows the PN layer seq.1')
    with pytest.raises(ValueError, match='act_cfg=None'):
        check_proxy_norm_placement(bad)
    good = nn.ModuleDict({
        'head': ConvModule(8, 8, 3, padding=1, norm_cfg=pn_cfg, act_cfg=None),
        'pre_act': ConvModule(8, 8, 3, padding=1, norm_cfg=pn_cfg, order=('norm', 'conv', 'act')),
        'gn_relu': ConvModule(8, 8, 3, padding=1, norm_cfg=dict(type='GN', num_groups=4)),
        'seq': nn.Sequential(GroupProxyNorm(8, 4), nn.Conv2d(8, 8, 1), nn.ReLU()),
    })
    check_proxy_norm_placement(good)


def test_runtime_guard_and_hook():
    from normdense.hooks.proxy_norm_check import ProxyNormCheckHook

    class Block(nn.Module):  # an activation called in forward code: invisible to the static check

        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 3, padding=1)
            self.gn1 = GroupProxyNorm(4, 2)
            self.relu = nn.ReLU(inplace=True)

        def forward(self, x):
            return self.relu(self.gn1(self.conv(x)) + x)  # ReLU after an add is fine ...

    class BadBlock(Block):

        def forward(self, x):
            return self.relu(self.gn1(self.conv(x)))  # ... directly on the PN output is not

    x = torch.randn(1, 4, 5, 5)
    with ActivationAfterProxyNormGuard(Block()):
        Block()(x)
    bad = BadBlock()
    assert find_activations_after_proxy_norm(bad) == []
    with pytest.raises(ValueError, match=r'relu \(ReLU\) is applied to the output of the PN layer gn1'):
        with ActivationAfterProxyNormGuard(bad):
            bad(x)
    assert not bad.gn1._forward_hooks and not bad.relu._forward_pre_hooks  # hooks removed

    hook = ProxyNormCheckHook()
    runner = types.SimpleNamespace(model=bad)
    hook.before_run(runner)  # static part passes
    hook.before_train_iter(runner, 0)
    bad(x)
    with pytest.raises(ValueError, match='output of the PN layer gn1'):
        hook.after_train_iter(runner, 0)
    hook.before_train_iter(runner, 1)  # checked once only: no hooks any more
    assert not bad.gn1._forward_hooks
    with pytest.raises(ValueError, match='act_cfg=None'):
        ProxyNormCheckHook().before_run(types.SimpleNamespace(
            model=ConvModule(4, 4, 1, norm_cfg=dict(type='GNPN', num_groups=2))))


def test_hook_from_config_in_a_runner(tmp_path):
    from mmengine.model import BaseModel
    from mmengine.runner import Runner
    from torch.utils.data import DataLoader, default_collate

    class Net(BaseModel):

        def __init__(self, relu_after_pn):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, padding=1)
            self.pn = GroupProxyNorm(4, num_groups=2)
            self.relu = nn.ReLU()
            self.head = nn.Linear(4, 2)
            self.relu_after_pn = relu_after_pn

        def forward(self, inputs, labels, mode='tensor'):
            h = self.pn(self.conv(inputs))
            h = self.relu(h) if self.relu_after_pn else h
            return dict(loss=F.cross_entropy(self.head(h.mean((2, 3))), labels))

    data = [dict(inputs=torch.randn(3, 8, 8), labels=torch.tensor(i % 2)) for i in range(4)]

    def run(relu_after_pn, name):
        runner = Runner(model=Net(relu_after_pn), work_dir=str(tmp_path / name),
                        train_dataloader=DataLoader(data, batch_size=2, collate_fn=default_collate),
                        train_cfg=dict(by_epoch=False, max_iters=2),
                        optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.01)),
                        default_hooks=dict(checkpoint=None), custom_hooks=[dict(type='ProxyNormCheckHook')])
        runner.train()
        return runner

    run(False, 'ok')
    with pytest.raises(ValueError, match=r'relu \(ReLU\) is applied to the output of the PN layer pn'):
        run(True, 'bad')
