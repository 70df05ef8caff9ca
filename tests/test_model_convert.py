"""normdense.convert_model / revert_model on a model that hard-codes nn.BatchNorm2d, nn.GroupNorm and nn.Conv2d."""
import copy

import pytest
import torch
import torch.nn as nn

import normdense
from normdense import convert_model, revert_model
from normdense.layers import BatchChannelNorm2d, IterNorm, Unitization2d, WSConv2d


class HardCoded(nn.Module):
    """What no config reaches: layers built directly, not from norm_cfg / conv_cfg."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU())
        self.block = nn.Sequential(nn.Conv2d(32, 32, 3, padding=1), nn.GroupNorm(8, 32), nn.ReLU())
        self.head = nn.Conv2d(32, 5, 1)  # a predictor: feeds no norm, stays plain

    def forward(self, x):
        return self.head(self.block(self.stem(x)))


@pytest.fixture
def net():
    torch.manual_seed(0)
    model = HardCoded().double()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
                m.weight.normal_(), m.bias.normal_()
        bn = model.stem[1]
        bn.running_mean.normal_(), bn.running_var.uniform_(0.5, 2.0)
    return model.eval()


def x():
    return torch.randn(2, 3, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def test_layers_export_the_classes():
    import normdense.layers as layers
    for name in ('BatchChannelNorm2d', 'WSConv2d', 'GroupProxyNorm', 'IterNorm', 'Unitization2d', 'EquiConv2d',
                 'ChannelAffine'):
        assert name in layers.__all__ and isinstance(getattr(layers, name), type)
    assert normdense.convert_model is convert_model


def test_bn_to_bcn_keeps_the_eval_bn_in_the_batch_stage_and_reverts_exactly(net, capsys):
    original = copy.deepcopy(net)
    inp = x()
    ref = net(inp)
    model = convert_model(net, norm=dict(type='BCN', num_groups=8, mode='estimate'), conv='WSConv2d')
    assert isinstance(model.stem[1], BatchChannelNorm2d) and isinstance(model.block[1], BatchChannelNorm2d)
    assert isinstance(model.stem[0], WSConv2d) and isinstance(model.block[0], WSConv2d)
    assert type(model.head) is nn.Conv2d  # feeds no norm
    assert not model.training and model.stem[1].mode == 'estimate'
    feats = model.stem[0](inp)
    torch.testing.assert_close(model.stem[1]._batch_stage(feats), original.stem[1](feats), rtol=0, atol=1e-12)
    # GN -> BCN: the channel stage takes GN's affine only where it is constant per group (not here); the
    # summary says so
    assert 'not carried' in report.table() if (report := model.normdense_conversion) else False
    report = model.normdense_conversion
    assert report.counts() == {('BatchNorm2d', 'BatchChannelNorm2d'): 1, ('GroupNorm', 'BatchChannelNorm2d'): 1,
                               ('Conv2d', 'WSConv2d'): 2}
    assert [r[0] for r in report.left] == ['head']
    assert 'feeds no norm' in report.table() and 'BatchNorm2d -> BatchChannelNorm2d' in report.table()
    # norm only, then revert: the original function in eval
    back = revert_model(convert_model(copy.deepcopy(original), norm='BCN', include='stem'))
    assert type(back.stem[1]) is nn.BatchNorm2d and type(back.block[1]) is nn.GroupNorm
    torch.testing.assert_close(back(inp), ref, rtol=0, atol=0)


@pytest.mark.parametrize('norm', ['Unitization', dict(type='IterNorm', group_size=16)])
def test_bn_statistics_keep_the_eval_function(net, norm):
    inp = x()
    ref = net(inp)
    model = convert_model(net, norm=norm, exclude=['block'], verbose=False)
    assert isinstance(model.stem[1], (Unitization2d, IterNorm)) and type(model.block[1]) is nn.GroupNorm
    assert ('block.1', 'GroupNorm', None, 'excluded') in model.normdense_conversion.rows
    torch.testing.assert_close(model(inp), ref, rtol=0, atol=1e-12)
    back = revert_model(model, verbose=False)
    assert type(back.stem[1]) is nn.BatchNorm2d
    torch.testing.assert_close(back(inp), ref, rtol=0, atol=1e-12)


def test_gn_to_bcn_keeps_gn_up_to_eps_and_ws_reverts_to_its_standardized_conv(net):
    net.block[1] = nn.GroupNorm(8, 32).double()  # affine constant per group: carried into the channel stage
    with torch.no_grad():
        net.block[1].weight.copy_(torch.arange(8.).repeat_interleave(4)), net.block[1].bias.fill_(0.5)
    inp = x()
    ref = net(inp)
    model = convert_model(net, norm=dict(type='BCN', num_groups=8, update_rate=0.0), include='block',
                          verbose=False)
    torch.testing.assert_close(model(inp), ref, rtol=0, atol=1e-4)  # the batch stage divides by sqrt(1 + eps)
    model = convert_model(model, conv=dict(type='WSConv2d', formula='var_unbiased'), verbose=False)
    assert model.stem[0].formula == 'var_unbiased'
    ws_out = model(inp)
    back = revert_model(model, verbose=False)
    assert not any(isinstance(m, (WSConv2d, BatchChannelNorm2d)) for m in back.modules())
    assert type(back.block[1]) is nn.GroupNorm
    # the WS convs became plain convs with the standardized weights: same function
    ws = WSConv2d(3, 32, 3, padding=1, bias=False).double()
    with torch.no_grad():
        ws.weight.copy_(torch.randn_like(ws.weight))
    plain = revert_model(nn.Sequential(ws), verbose=False)[0]
    torch.testing.assert_close(plain(inp), ws(inp), rtol=0, atol=1e-12)
    assert ws_out.shape == ref.shape


def test_training_step_after_conversion_moves_the_estimates(net):
    model = convert_model(net, norm='BCN', conv='WSConv2d', verbose=False).float().train()
    normdense.layers.set_update_rate(model, 0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # after conversion: the optimizer sees the new layers
    before = model.stem[1].running_mean.clone()
    model(x().float()).square().mean().backward()
    opt.step()
    assert not torch.equal(before, model.stem[1].running_mean)


def test_errors_name_the_fix(net):
    with pytest.raises(ValueError, match="choose one of 'BCN', 'GN', 'IterNorm'"):
        convert_model(net, norm='BatchChannel')
    with pytest.raises(ValueError, match='gn-pn'):
        convert_model(net, norm='GNPN')
    with pytest.raises(ValueError, match='norm= and/or conv='):
        convert_model(net)
    with pytest.raises(ValueError, match="'WSConv2d'"):
        convert_model(net, conv='WS')


def test_normdense_group_norm_converts_as_nn_group_norm(net):
    """GNAuto (normdense.layers.groups.GroupNorm, what the switch builds for 'gn') is a GroupNorm to the
    converter, as nn.GroupNorm is: converted, its affine carried over, not left as 'not a type it replaces'."""
    from normdense.layers.groups import GroupNorm as GNAuto
    gn = GNAuto(32, num_groups=8).double()
    with torch.no_grad():  # constant per group: a per-group channel stage carries it exactly
        gn.weight.copy_(torch.arange(8, dtype=torch.float64).repeat_interleave(4) + 1)
        gn.bias.copy_(-torch.arange(8, dtype=torch.float64).repeat_interleave(4))
    net.block[1] = gn
    model = convert_model(net, norm=dict(type='BCN', num_groups=8, mode='estimate'))
    assert isinstance(model.block[1], BatchChannelNorm2d)
    assert model.normdense_conversion.counts()[('GroupNorm', 'BatchChannelNorm2d')] == 1
    torch.testing.assert_close(model.block[1].weight, torch.arange(8, dtype=torch.float64) + 1)


_TORCH_ONLY = r'''
import importlib.abc, os, sys
class Block(importlib.abc.MetaPathFinder):  # a torch-only machine (the GPU image): no mmengine, no mmcv
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('mmengine', 'mmcv'):
            raise ImportError(f'blocked: {name}')
sys.meta_path.insert(0, Block())
os.environ['NORMDENSE_LAYERS_ONLY'] = '1'
import torch
import torch.nn as nn
HARDCODED
from normdense.model_convert import convert_model
for norm, conv in NORMS:
    torch.manual_seed(0)
    model = convert_model(HardCoded().double(), norm=norm, conv=conv, verbose=False)
    out = model.train()(torch.randn(2, 3, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1)))
    print(repr(norm), [type(m).__name__ for m in model.modules()], sorted(model.state_dict()),
          [p.requires_grad for p in model.parameters()], out.sum().item())
'''
_NORMS = [(dict(type='BCN', mode='estimate', update_rate=0.1), 'WSConv2d'), ('GN', 'WSConv2d'), ('Unitization', None),
          ('IterNorm', None), (dict(type='GN', num_groups=8, requires_grad=False), None)]


def test_converts_on_a_torch_only_machine_as_through_the_registry(tmp_path):
    """The GPU image has torch but no mmengine/mmcv: under NORMDENSE_LAYERS_ONLY=1 convert_model builds the same
    layers (types, state keys, training output) without them."""
    import inspect
    import subprocess
    import sys
    script = tmp_path / 'torch_only.py'
    script.write_text(_TORCH_ONLY.replace('NORMS', repr(_NORMS)).replace('HARDCODED', inspect.getsource(HardCoded)))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    assert len(lines) == len(_NORMS)
    for (norm, conv), line in zip(_NORMS, lines):
        torch.manual_seed(0)
        model = convert_model(HardCoded().double(), norm=norm, conv=conv, verbose=False)
        out = model.train()(x())
        expect = (f'{norm!r} {[type(m).__name__ for m in model.modules()]} {sorted(model.state_dict())} '
                  f'{[p.requires_grad for p in model.parameters()]} {out.sum().item()}')
        assert line == expect
