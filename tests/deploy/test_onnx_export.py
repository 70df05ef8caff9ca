"""Every normdense layer leaves PyTorch: eval-mode export with the TorchScript exporter (opset 11, mmdeploy's
default, and 17) and with dynamo=True, as trained and after ``fuse``, equal in ONNX Runtime to PyTorch's eval
output (<= 1e-4 relative). Each layer sits behind a conv (what ``fuse`` folds into) and has its statistics
and parameters moved by a few training steps."""
import copy

import pytest
import torch
import torch.nn as nn

from normdense.deploy import fuse
from normdense.deploy.onnx import export_and_check, export_onnx
from normdense.errors import ExportError
from normdense.layers._activations import PROXY_NORM_ACTIVATIONS
from normdense.layers.bcn import BatchChannelNorm2d
from normdense.layers.equinorm import ChannelAffine, EquiConv2d
from normdense.layers.groups import GroupNorm as GNAuto
from normdense.layers.iternorm import IterNorm
from normdense.layers.proxy_norm import GroupProxyNorm
from normdense.layers.unitization import Unitization2d
from normdense.layers.ws import WS_FORMULAS, WSConv2d

pytest.importorskip('onnxruntime', reason='needs the [deploy] extra (make install installs it): not run')

NORMDENSE = (WSConv2d, EquiConv2d, BatchChannelNorm2d, IterNorm, Unitization2d, GroupProxyNorm)
C = 8


def _behind_conv(norm):
    return nn.Sequential(nn.Conv2d(3, C, 3, padding=1), norm)


CASES = {
    **{f'ws_{f}': (lambda f=f: nn.Sequential(WSConv2d(3, C, 3, padding=1, formula=f), GNAuto(C))) for f in WS_FORMULAS},
    'bcn_estimate': lambda: _behind_conv(BatchChannelNorm2d(C, num_groups=4, mode='estimate', update_rate=0.2)),
    'bcn_batch': lambda: _behind_conv(BatchChannelNorm2d(C, num_groups=4, mode='batch')),
    'bcn_per_channel_affine': lambda: _behind_conv(BatchChannelNorm2d(C, num_groups=2, update_rate=0.2,
                                                                      group_affine=False)),
    **{f'gnpn_{a}': (lambda a=a: _behind_conv(GroupProxyNorm(C, num_groups=2, act=a))) for a in PROXY_NORM_ACTIVATIONS},
    'gnpn_no_proxy_scaling': lambda: _behind_conv(GroupProxyNorm(C, num_groups=4, proxy_scaling=False)),
    'iternorm': lambda: _behind_conv(IterNorm(C, group_size=4)),
    'unitization_batch': lambda: _behind_conv(Unitization2d(C)),
    'unitization_estimate': lambda: _behind_conv(Unitization2d(C, mode='estimate', update_rate=0.2,
                                                               norm_divisor='hw_squared')),
    'equinorm': lambda: nn.Sequential(nn.Conv2d(3, 4, 1), nn.ReLU(), EquiConv2d(4, C, 3, padding=1),
                                      ChannelAffine(C)),
    'gnauto': lambda: _behind_conv(GNAuto(C)),
}


def _trained(name):
    """The case's model after 3 SGD steps on shifted, scaled inputs (statistics, estimates and every
    parameter moved off their initial values), in eval mode."""
    torch.manual_seed(sorted(CASES).index(name))
    model = CASES[name]()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.train()
    for _ in range(3):
        loss = model(torch.randn(2, 3, 10, 10) * 2 + 0.5).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():  # the proxy's and the channel stage's parameters well away from their init
        for m in model.modules():
            if isinstance(m, GroupProxyNorm) and m.proxy_affine:
                m.proxy_beta.uniform_(-0.3, 0.3)
                m.proxy_gamma.uniform_(-0.3, 0.3)
            if isinstance(m, (BatchChannelNorm2d, Unitization2d, GroupProxyNorm)):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.3, 0.3)
    return model.eval()


EXPORTERS = {'ts11': dict(dynamo=False, opset=11), 'ts17': dict(dynamo=False, opset=17),
             'dynamo': dict(dynamo=True, opset=None)}


@pytest.mark.parametrize('exporter', sorted(EXPORTERS))
@pytest.mark.parametrize('fused', [False, True], ids=['trained', 'fused'])
@pytest.mark.parametrize('name', sorted(CASES))
def test_export_matches_onnxruntime(name, fused, exporter, tmp_path):
    if EXPORTERS[exporter]['dynamo']:
        pytest.importorskip('onnxscript', reason='dynamo=True needs onnxscript (the [deploy] extra): not run')
    model = _trained(name)
    if fused:
        model = fuse(model)
        assert not any(isinstance(m, NORMDENSE) for m in model.modules()), model
    x = torch.randn(2, 3, 10, 10) * 2 + 0.5
    _, diff = export_and_check(model, (x, ), str(tmp_path / 'm.onnx'), **EXPORTERS[exporter])
    assert diff <= 1e-4, diff


@pytest.mark.parametrize('name', sorted(CASES))
def test_fused_equals_trained(name):
    """fuse keeps the eval output (GN+PN included, which fuse used to leave as it was)."""
    model = _trained(name)
    x = torch.randn(2, 3, 10, 10) * 2 + 0.5
    with torch.no_grad():
        ref = model(x)
        out = fuse(copy.deepcopy(model))(x)
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.parametrize('dynamo', [False, True], ids=['ts', 'dynamo'])
@pytest.mark.parametrize('layer', ['bcn', 'unitization'])
def test_training_mode_export_is_one_line_error(layer, dynamo, tmp_path):
    from normdense.errors import known_error
    if dynamo:
        pytest.importorskip('onnxscript', reason='dynamo=True needs onnxscript: not run')
    norm = BatchChannelNorm2d(C, num_groups=4, update_rate=0.1) if layer == 'bcn' else Unitization2d(C)
    model = _behind_conv(norm).train()
    x = torch.randn(2, 3, 6, 6)
    with pytest.raises(ExportError, match='call model.eval'):
        export_onnx(model, (x, ), str(tmp_path / 'm.onnx'), opset=17, dynamo=dynamo)
    # straight through torch.onnx.export (which keeps the model's mode with dynamo=True; the TorchScript exporter
    # is told training=TRAINING): the layer's own error, one line through the tools' wrapper
    from torch.onnx import TrainingMode
    kw = dict(dynamo=True) if dynamo else dict(dynamo=False, training=TrainingMode.TRAINING)
    with pytest.raises(Exception) as info:
        torch.onnx.export(model, (x, ), str(tmp_path / 'm.onnx'), **kw)
    assert 'exports in eval mode only' in known_error(info.value)


EVAL_FORMS = ['bcn_estimate', 'bcn_batch', 'bcn_per_channel_affine', 'gnpn_gelu', 'gnpn_no_proxy_scaling',
              'unitization_batch', 'unitization_estimate']


@pytest.mark.parametrize('name', EVAL_FORMS)
def test_eval_form_equals_the_engine_in_float64(name):
    """What an export records (the layer's eval form of standard ops) is the engine's eval output to float64
    rounding, and the exported path is taken only while exporting."""
    from unittest import mock
    model = _trained(name).double()
    norm = model[1]
    x = (torch.randn(2, 3, 10, 10, dtype=torch.float64) * 2 + 0.5)
    h = model[0](x).detach()
    with torch.no_grad():
        ref = norm(h)
        form = norm._eval_form(h)
        with mock.patch.object(norm, '_eval_form', side_effect=AssertionError('eval form outside export')):
            norm(h)  # the engine, not the eval form
    torch.testing.assert_close(form, ref, rtol=1e-12, atol=1e-12)


def test_proxy_quantile_constants_equal_erfinv():
    """GN+PN's quantiles in an exported graph are Python constants (erfinv has no ONNX operator)."""
    from normdense.layers.proxy_norm import _quantile_values, proxy_quantiles
    for n in (2, 7, 200):
        torch.testing.assert_close(torch.tensor(_quantile_values(n), dtype=torch.float64), proxy_quantiles(n),
                                   rtol=0, atol=1e-13)


@pytest.mark.parametrize('alpha', [0.5, 2.0])
def test_celu_at_opset_11_with_alpha_other_than_one(alpha, tmp_path):
    """CELU exists in ONNX from opset 12; before, normdense writes alpha elu(x / alpha): an alpha of 1 cannot tell
    a division from a multiplication."""
    torch.manual_seed(0)
    model = _behind_conv(GroupProxyNorm(C, 2, act=dict(type='CELU', alpha=alpha))).eval()
    with torch.no_grad():
        model[1].weight.uniform_(0.5, 3.0)
    _, diff = export_and_check(model, (torch.randn(1, 3, 8, 8) * 3, ), str(tmp_path / 'celu.onnx'), opset=11)
    assert diff <= 1e-4
