"""normdense's additions to mmdeploy's export are registrations in mmdeploy's own registries, active inside its
RewriterContext only: GN+PN with CELU exports at opset 11 there (ONNX has CELU from opset 12), and not outside
it; our own export registers the same symbolic for its duration only."""
import pytest
import torch
import torch.nn as nn

pytest.importorskip('onnxruntime', reason='needs the [deploy] extra (make install installs it): not run')
pytest.importorskip('mmdeploy', reason='needs mmdeploy 1.3.1: not run')


def _celu_model():
    from normdense.layers.proxy_norm import GroupProxyNorm
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), GroupProxyNorm(8, num_groups=2, act='celu'))
    with torch.no_grad():
        model[1].proxy_beta.uniform_(-0.3, 0.3)
        model[1].weight.uniform_(0.5, 1.5)
    return model.eval()


def test_celu_at_opset_11_inside_mmdeploy_context_only(tmp_path):
    from mmdeploy.core import RewriterContext

    from normdense.deploy.mmdeploy import register_rewriters
    from normdense.deploy.onnx import relative_difference, run_onnxruntime
    model, x = _celu_model(), torch.randn(1, 3, 8, 8)
    path = str(tmp_path / 'm.onnx')
    with pytest.raises(Exception, match='celu'):  # torch alone: no translation before opset 12
        torch.onnx.export(model, (x, ), path, dynamo=False, opset_version=11)
    register_rewriters()
    with pytest.raises(Exception, match='celu'):  # registered, but not active outside mmdeploy's context
        torch.onnx.export(model, (x, ), path, dynamo=False, opset_version=11)
    with RewriterContext(cfg=dict(), backend='onnxruntime', opset=11), torch.no_grad():
        torch.onnx.export(model, (x, ), path, dynamo=False, opset_version=11)
    with torch.no_grad():
        ref = model(x)
    assert relative_difference([ref], run_onnxruntime(path, (x, ))) <= 1e-4
    with pytest.raises(Exception, match='celu'):  # and gone again after it
        torch.onnx.export(model, (x, ), path, dynamo=False, opset_version=11)


def test_our_export_registers_celu_for_its_duration_only(tmp_path):
    from normdense.deploy.onnx import export_and_check
    model, x = _celu_model(), torch.randn(1, 3, 8, 8)
    _, diff = export_and_check(model, (x, ), str(tmp_path / 'a.onnx'), opset=11)
    assert diff <= 1e-4
    with pytest.raises(Exception, match='celu'):
        torch.onnx.export(model, (x, ), str(tmp_path / 'b.onnx'), dynamo=False, opset_version=11)
